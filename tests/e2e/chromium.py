"""Headless Chromium driven over its DevTools protocol (aiohttp websockets, no new dependency).

`Chromium` is the browser process (a fresh profile, loopback only); `Page` is one tab with
the few commands the browser tests need: navigate, evaluate JavaScript, wait for a
condition, screenshot. JavaScript exceptions and console errors are kept for failure
messages.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

EXECUTABLE = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1280,800",
]


def chromium_missing() -> str:
    """Why the browser tests cannot run here, or "" when they can."""
    if not Path(EXECUTABLE).exists() and shutil.which("chromium") is None:
        return f"{EXECUTABLE} not found: `apt-get install chromium` (.ci/run does)"
    return ""


class Chromium:
    def __init__(self, profile: Path) -> None:
        executable = EXECUTABLE if Path(EXECUTABLE).exists() else str(shutil.which("chromium"))
        self.process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.port = self._wait_port(profile / "DevToolsActivePort")

    def _wait_port(self, path: Path, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}")
            if path.exists() and path.read_text().count("\n") >= 1:
                return int(path.read_text().split("\n")[0])
            time.sleep(0.1)
        raise RuntimeError(f"chromium did not open its DevTools port in {timeout}s")

    async def new_page(self) -> Page:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{self.port}/json/new?about:blank"
            async with http.put(url) as reply:
                target = await reply.json()
        session = aiohttp.ClientSession()
        socket = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(session, socket)
        await page.send("Runtime.enable")
        await page.send("Page.enable")
        return page

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Page:
    def __init__(self, session: aiohttp.ClientSession, socket: Any) -> None:
        self.session = session
        self.socket = socket
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.errors: list[str] = []  # uncaught exceptions and console errors, for messages
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.socket:
            data = json.loads(message.data)
            if "id" in data:
                future = self.pending.pop(data["id"])
                if "error" in data:
                    future.set_exception(RuntimeError(f"CDP: {data['error']}"))
                else:
                    future.set_result(data.get("result", {}))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.errors.append(data["params"]["exceptionDetails"]["exception"]["description"])
            elif data.get("method") == "Runtime.consoleAPICalled" and (
                data["params"]["type"] == "error"
            ):
                self.errors.append(str([a.get("value") for a in data["params"]["args"]]))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self.ids)
        future = self.pending[call_id] = asyncio.get_running_loop().create_future()
        await self.socket.send_json({"id": call_id, "method": method, "params": params})
        return await asyncio.wait_for(future, 30)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited), as JSON."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(details.get("exception", {}).get("description", str(details)))
        return result["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    async def wait_for(self, expression: str, timeout: float = 20) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {expression}; page errors: {self.errors}")

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        self.reader.cancel()
        await self.socket.close()
        await self.session.close()
