// The playground: a chat streamed from /v1/chat/completions with fetch + ReadableStream.
// Each answer shows its time to first token and decode speed; Stop aborts the fetch,
// which makes the gateway cancel the request on every worker.
"use strict";

const $ = (id) => document.getElementById(id);
const turns = [];
let controller = null;

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function requestBody() {
  const body = {
    model: $("model").value,
    messages: [...turns],
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("system").value.trim()) body.messages.unshift({ role: "system", content: $("system").value });
  return body;
}

function showStats(box, s) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const parts = [];
  if (s.ttft !== null) parts.push(`TTFT ${Math.round(s.ttft)} ms`);
  if (s.tokens > 1 && s.last > s.first) {
    parts.push(`${((s.tokens - 1) / ((s.last - s.first) / 1000)).toFixed(1)} tok/s`);
  }
  if (s.tokens) parts.push(`${s.tokens} tokens`);
  parts.push(s.finish);
  stats.textContent = parts.join(" · ");
  box.append(stats);
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  turns.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  const content = box.querySelector(".content");
  box.dataset.state = "streaming";
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const sent = performance.now();
  const s = { ttft: null, first: 0, last: 0, tokens: 0, finish: "" };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders(), body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error((await response.json()).error.message);
    for await (const event of sseEvents(response)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) s.tokens = event.usage.completion_tokens;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        const now = performance.now();
        if (s.ttft === null) { s.ttft = now - sent; s.first = now; }
        s.last = now;
        content.textContent += choice.delta.content;
        box.scrollIntoView({ block: "end" });
      }
      if (choice.finish_reason) s.finish = `finish: ${choice.finish_reason}`;
    }
    box.dataset.state = "done";
  } catch (err) {
    if (err.name === "AbortError") {
      box.dataset.state = "stopped";
      s.finish = "stopped";
    } else {
      box.dataset.state = "error";
      content.textContent += (content.textContent ? "\n" : "") + err.message;
      s.finish = "error";
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  turns.push({ role: "assistant", content: content.textContent });
  showStats(box, s);
}

async function loadModels() {
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders() });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error.message);
    $("model").replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    $("status").textContent = `${body.data.length} model(s)`;
  } catch (err) {
    $("status").textContent = `models: ${err.message}`;
  }
}

$("api-key").value = localStorage.getItem("splitserve.apiKey") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("splitserve.apiKey", $("api-key").value);
  loadModels();
});
$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { turns.length = 0; $("messages").replaceChildren(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
loadModels();
