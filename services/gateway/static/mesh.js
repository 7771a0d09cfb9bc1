// The live mesh view: polls /v1/mesh/status every second, redraws the worker table, the
// prefill → decode KV pairs (from the prefill workers' kv_peers: the transport each pair
// used last, blocks and transfers) and the sparklines of the gateway's recent history
// (mean TTFT and tokens/s per sample). Workers are grouped by the model they serve (the
// status lists them by model), each group under a row naming it. With a planner, its panel
// shows the objectives against the p99s it measured, the workers it wants of each role,
// why it holds, and its recent decisions with their reasons (newest first).
"use strict";

const POLL_MS = 1000;
const WINDOW = 150; // sparkline width in points: the gateway keeps 5 min at one per 2 s
const $ = (id) => document.getElementById(id);

function cell(text, className) {
  const td = document.createElement("td");
  if (className) td.className = className;
  td.textContent = text;
  return td;
}

function kvCell(w) {
  const td = document.createElement("td");
  const bar = document.createElement("span");
  bar.className = "bar";
  const fill = document.createElement("span");
  fill.style.width = `${(w.kv_usage * 100).toFixed(1)}%`;
  bar.append(fill);
  const used = w.total_blocks - w.free_blocks;
  td.append(bar, `${used} / ${w.total_blocks} blocks (${(w.kv_usage * 100).toFixed(1)}%)`);
  return td;
}

function workerRow(w) {
  const tr = document.createElement("tr");
  tr.dataset.worker = w.id;
  const role = document.createElement("td");
  const badge = document.createElement("span");
  badge.className = `role ${w.role}`;
  badge.textContent = w.role;
  role.append(badge);
  tr.append(cell(w.id), role, cell(w.state, `state ${w.state}`), cell(w.running), cell(w.waiting),
    kvCell(w), cell(`${(w.prefix_hit_rate * 100).toFixed(1)}%`, "hit-rate"),
    cell(`${w.kv_blocks_sent} / ${w.kv_blocks_received}`), cell(w.assigned),
    cell(w.kv_transports.join(" › ") || "–", "transports"));
  return tr;
}

function modelRow(model, count) {
  const tr = document.createElement("tr");
  tr.className = "model-group";
  tr.dataset.model = model;
  const th = document.createElement("th");
  th.colSpan = 10;
  th.textContent = `${model} · ${count} worker${count === 1 ? "" : "s"}`;
  tr.append(th);
  return tr;
}

function workerRows(workers) {
  const rows = [];
  workers.forEach((w, i) => {
    if (i === 0 || workers[i - 1].model !== w.model) {
      rows.push(modelRow(w.model, workers.filter((x) => x.model === w.model).length));
    }
    rows.push(workerRow(w));
  });
  return rows;
}

function transportBadge(name) {
  const badge = document.createElement("span");
  badge.className = `transport ${name}`;
  badge.textContent = name;
  return badge;
}

function pairRow(pair) {
  const tr = document.createElement("tr");
  tr.dataset.prefill = pair.prefill;
  tr.dataset.decode = pair.worker_id;
  tr.dataset.transport = pair.transport;
  const transport = document.createElement("td");
  transport.append(transportBadge(pair.transport));
  tr.append(cell(pair.prefill), cell("→", "arrow"), cell(pair.worker_id), transport,
    cell(pair.blocks), cell(pair.transfers));
  return tr;
}

function kvPairs(workers) {
  const pairs = workers.flatMap((w) => w.kv_peers.map((p) => ({ prefill: w.id, ...p })));
  $("kv-pairs").replaceChildren(...pairs.map(pairRow));
  $("kv-pairs-empty").hidden = pairs.length > 0;
}

function draw(svgId, values) {
  const max = Math.max(...values, 1e-9);
  const points = values.map((v, i) => `${WINDOW - values.length + i},${58 - (v / max) * 54}`);
  document.querySelector(`#${svgId} polyline`).setAttribute("points", points.join(" "));
}

function sparklines(gateway) {
  const history = gateway.history;
  draw("ttft-spark", history.map((p) => p.ttft_ms ?? 0));
  draw("tps-spark", history.map((p) => p.tokens_per_s));
  const last = history[history.length - 1];
  const lastTtft = [...history].reverse().find((p) => p.ttft_ms !== null);
  $("ttft-now").textContent = lastTtft ? `last ${Math.round(lastTtft.ttft_ms)} ms` : "no requests yet";
  $("tps-now").textContent = last ? `now ${last.tokens_per_s.toFixed(1)} tok/s` : "";
}

function seconds(value) {
  return value >= 1 ? `${value.toFixed(2)} s` : `${Math.round(value * 1000)} ms`;
}

function decisionRow(d) {
  const tr = document.createElement("tr");
  tr.dataset.action = d.action;
  tr.append(cell(new Date(d.time * 1000).toLocaleTimeString()), cell(d.action.replace("_", " ")),
    cell(d.role), cell(d.worker_id || "–"), cell(d.reason.replaceAll("_", " ")), cell(d.detail),
    cell(d.outcome));
  return tr;
}

function plannerPanel(planner) {
  $("planner-panel").hidden = !planner;
  if (!planner) return;
  $("planner-mode").textContent = `${planner.id} · ${planner.mode} mode`;
  $("planner-ttft").textContent = `${seconds(planner.p99.ttft_s)} / ${seconds(planner.slo.ttft_s)}`;
  $("planner-tpot").textContent = `${seconds(planner.p99.tpot_s)} / ${seconds(planner.slo.tpot_s)}`;
  const want = planner.desired;
  $("planner-desired").textContent = `${want.prefill} / ${want.decode} / ${want.both}`;
  $("planner-holding").textContent = planner.holding ? `holding: ${planner.holding}` : "";
  $("planner-decisions").replaceChildren(...planner.decisions.map(decisionRow));
  $("planner-decisions-empty").hidden = planner.decisions.length > 0;
}

async function poll() {
  try {
    const response = await fetch("/v1/mesh/status", { headers: apiHeaders() });
    const status = await response.json();
    if (!response.ok) throw new Error(status.error.message);
    $("queue").textContent = status.scheduler.queue_length;
    $("admitted").textContent = status.scheduler.admitted;
    $("rejected").textContent = status.scheduler.rejected;
    $("streaming").textContent = status.gateway.requests_running;
    $("workers").replaceChildren(...workerRows(status.workers));
    kvPairs(status.workers);
    plannerPanel(status.planner);
    sparklines(status.gateway);
    $("updated").textContent = `${status.workers.length} workers · ${new Date().toLocaleTimeString()}`;
    $("updated").classList.remove("error");
  } catch (err) {
    $("updated").textContent = `no status: ${err.message}`;
    $("updated").classList.add("error");
  }
  setTimeout(poll, POLL_MS);
}

poll();
