"""The gateway's web pages in a real browser (headless Chromium) against `splitserve up`.

The mesh runs the real default model (so a long answer is still streaming when Stop is
pressed) and allows one extra origin for CORS. Screenshots land in artifacts/web/.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.ports import free_port
from tests.e2e.chromium import Chromium, Page, chromium_missing
from tests.e2e.test_mesh import Mesh, start_mesh

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(bool(chromium_missing()), reason=chromium_missing() or "-"),
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "web"
QUESTION = "What is the capital of France?"
# A page on another origin streams a chat answer with fetch + ReadableStream.
CROSS_ORIGIN_PAGE = """<!doctype html><title>other origin</title><script>
async function streamFrom(base, model) {
  const response = await fetch(base + "/v1/chat/completions", {
    method: "POST",
    headers: {"Content-Type": "application/json", "Authorization": "Bearer none"},
    body: JSON.stringify({model, stream: true, temperature: 0, max_tokens: 12,
                          messages: [{role: "user", content: "Hi"}]}),
  });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let raw = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    raw += decoder.decode(value, {stream: true});
  }
  return raw.split("\\n").filter((l) => l.startsWith("data: {"))
    .map((l) => JSON.parse(l.slice(6)).choices[0]?.delta?.content || "").join("");
}
</script>"""


class StaticSite:
    """A plain HTTP server for one directory on 127.0.0.1:`port` (another origin)."""

    def __init__(self, root: Path, port: int) -> None:
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.url = f"http://127.0.0.1:{port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def allowed_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def mesh(real_model_dir, tmp_path_factory, allowed_port) -> Iterator[Mesh]:
    """The real model: at its ~30 tok/s a long answer is still streaming when Stop is
    pressed (the tiny model finishes 1900 tokens within a few seconds)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPLITSERVE_CORS_ORIGINS", f"http://127.0.0.1:{allowed_port}")
        yield from start_mesh(real_model_dir, tmp_path_factory.mktemp("home"), [])


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Chromium]:
    chromium = Chromium(tmp_path_factory.mktemp("profile"))
    yield chromium
    chromium.close()


def with_page(browser: Chromium, scenario) -> None:
    async def run() -> None:
        page = await browser.new_page()
        try:
            await scenario(page)
        finally:
            await page.close()

    asyncio.run(run())


def model_name(mesh: Mesh) -> str:
    return mesh.client.models.list().data[0].id


def mesh_status(mesh: Mesh) -> dict:
    with urllib.request.urlopen(f"{mesh.base}/v1/mesh/status", timeout=5) as reply:
        return json.loads(reply.read())


def wait_status(mesh: Mesh, check, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = mesh_status(mesh)
        if check(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"mesh status never matched: {status}")


async def chat(page: Page, mesh: Mesh, text: str, max_tokens: int) -> None:
    """Fill the playground's settings (greedy) and send `text`."""
    await page.goto(mesh.base + "/")
    await page.wait_for("document.querySelector('#model').options.length > 0")
    await page.evaluate(
        f"""document.querySelector('#temperature').value = '0';
        document.querySelector('#max_tokens').value = '{max_tokens}';
        document.querySelector('#prompt').value = {json.dumps(text)};
        document.querySelector('#send').click()"""
    )


LAST_ANSWER = "document.querySelector('.message.assistant:last-child')"


def test_playground_streams_the_same_answer_as_the_api(mesh, browser):
    expected = mesh.client.chat.completions.create(
        model=model_name(mesh),
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
    )

    async def scenario(page: Page) -> None:
        await chat(page, mesh, QUESTION, 24)
        await page.wait_for(f"{LAST_ANSWER}.dataset.state === 'done'")
        answer = await page.evaluate(f"{LAST_ANSWER}.querySelector('.content').textContent")
        stats = await page.evaluate(f"{LAST_ANSWER}.querySelector('.stats').textContent")
        assert answer == expected.choices[0].message.content
        tokens = f"{expected.usage.completion_tokens} tokens"
        assert "TTFT" in stats and "tok/s" in stats and tokens in stats, stats
        await page.screenshot(ARTIFACTS / "playground.png")

    with_page(browser, scenario)


def test_stop_cancels_the_request_and_frees_its_blocks(mesh, browser):
    async def scenario(page: Page) -> None:
        await chat(page, mesh, "Tell me a very long story.", 1900)
        await page.wait_for(f"{LAST_ANSWER}.querySelector('.content').textContent.length > 0")
        busy = wait_status(
            mesh, lambda s: any(w["role"] == "decode" and w["running"] for w in s["workers"])
        )
        assert any(w["free_blocks"] < w["total_blocks"] for w in busy["workers"])
        assert await page.evaluate(f"{LAST_ANSWER}.dataset.state") == "streaming"
        await page.evaluate("document.querySelector('#stop').click()")
        await page.wait_for(f"{LAST_ANSWER}.dataset.state === 'stopped'")
        wait_status(
            mesh,
            lambda s: all(
                w["free_blocks"] == w["total_blocks"] and w["running"] == 0 for w in s["workers"]
            ),
        )
        metrics = urllib.request.urlopen(f"{mesh.base}/metrics", timeout=5).read().decode()
        assert 'splitserve_requests_total{finish_reason="cancelled"} 1.0' in metrics

    with_page(browser, scenario)


def test_mesh_page_lists_the_workers(mesh, browser):
    workers = sorted(w.heartbeat.worker_id for w in mesh.status().workers)
    mesh.client.chat.completions.create(  # something for the sparklines to show
        model=model_name(mesh), messages=[{"role": "user", "content": QUESTION}], max_tokens=16
    )
    history = wait_status(
        mesh, lambda s: any(p["tokens_per_s"] > 0 for p in s["gateway"]["history"])
    )["gateway"]["history"]
    assert any(p["ttft_ms"] is not None and p["ttft_ms"] > 0 for p in history)
    # The prompt is too long to skip prefill: its KV went prefill → decode by some transport.
    moved = wait_status(mesh, lambda s: any(w["kv_peers"] for w in s["workers"]))["workers"]
    pairs = sorted((w["id"], p["worker_id"], p["transport"]) for w in moved for p in w["kv_peers"])
    assert len(pairs) == 1 and pairs[0][2] in ("nixl", "nats"), pairs
    transports = sorted(" › ".join(w["kv_transports"]) or "–" for w in moved)

    async def scenario(page: Page) -> None:
        await page.goto(mesh.base + "/mesh")
        rows = "[...document.querySelectorAll('#workers tr[data-worker]')]"  # not group rows
        await page.wait_for(f"{rows}.length === {len(workers)}")
        shown = await page.evaluate(f"{rows}.map((r) => r.dataset.worker).sort()")
        roles = await page.evaluate(f"{rows}.map((r) => r.cells[1].textContent).sort()")
        assert (shown, roles) == (workers, ["decode", "prefill"])
        cells = await page.evaluate(
            f"{rows}.map((r) => r.querySelector('.transports').textContent).sort()"
        )
        assert cells == transports
        pair_rows = "[...document.querySelectorAll('#kv-pairs tr')]"
        await page.wait_for(f"{pair_rows}.length === {len(pairs)}")
        drawn = await page.evaluate(
            f"{pair_rows}.map((r) => [r.cells[0].textContent, r.cells[2].textContent, "
            "r.querySelector('.transport').textContent])"
        )
        assert sorted(map(tuple, drawn)) == pairs
        assert await page.evaluate("document.querySelector('#kv-pairs-empty').hidden")
        status = wait_status(mesh, lambda s: True)  # idle now: the hit rates hold still
        hit_rates = sorted(f"{w['prefix_hit_rate'] * 100:.1f}%" for w in status["workers"])
        await page.wait_for(
            f"{rows}.map((r) => r.querySelector('.hit-rate').textContent).sort().join() === "
            f"{json.dumps(','.join(hit_rates))}"
        )
        # The gateway's history is there at once: the request above shows in both lines.
        await page.wait_for("document.querySelector('#ttft-now').textContent.startsWith('last')")
        points = await page.evaluate(
            "document.querySelector('#tps-spark polyline').getAttribute('points')"
        )
        assert min(float(p.split(",")[1]) for p in points.split()) < 10  # a peak near the top
        await page.screenshot(ARTIFACTS / "mesh.png")

    with_page(browser, scenario)


def test_cross_origin_streaming_only_from_an_allowed_origin(mesh, browser, allowed_port, tmp_path):
    (tmp_path / "index.html").write_text(CROSS_ORIGIN_PAGE)
    allowed, other = StaticSite(tmp_path, allowed_port), StaticSite(tmp_path, free_port())
    expected = mesh.client.chat.completions.create(
        model=model_name(mesh),
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=12,
    )
    call = f"streamFrom({json.dumps(mesh.base)}, {json.dumps(model_name(mesh))})"

    async def scenario(page: Page) -> None:
        await page.goto(allowed.url + "/index.html")
        assert await page.evaluate(call) == expected.choices[0].message.content
        await page.goto(other.url + "/index.html")
        refused = await page.evaluate(f"{call}.then(() => 'served', (e) => e.name)")
        assert refused == "TypeError"  # fetch rejects: the gateway did not allow this origin

    try:
        with_page(browser, scenario)
    finally:
        allowed.close()
        other.close()
