"""`make bench`'s matrix driven end to end against fake meshes (the fake SSE server in a
thread instead of `splitserve up`): every mesh is started fresh and stopped, every run
lands in the table and in its own JSON and PNG."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from loadtest import matrix
from loadtest.fake_server import FakeServer, Script


class FakeMesh:
    started: ClassVar[list[list[str]]] = []
    stopped: ClassVar[int] = 0

    def __init__(self, model_dir: Path, extra: list[str], log_path: Path) -> None:
        FakeMesh.started.append(extra)
        self.loop = asyncio.new_event_loop()
        self.server = FakeServer(Script(ttft_s=0.005, itl_s=0.001))
        self.url = self.loop.run_until_complete(self.server.start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def wait_ready(self) -> None:
        assert self.thread.is_alive()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        FakeMesh.stopped += 1


def test_matrix_runs_every_mesh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 500}))
    monkeypatch.setattr(matrix, "MeshProcess", FakeMesh)
    cfg = matrix.MatrixConfig(model="fake-model", model_dir=model_dir, out=tmp_path / "out",
                              num_prompts=4, concurrencies=(1, 4), output_len=3,
                              prefix_len=16, prefix_output_len=2)  # fmt: skip
    rows = matrix.run_matrix(cfg)
    assert FakeMesh.started == [[], ["--aggregated"], []] and FakeMesh.stopped == 3
    assert list(rows) == [
        "disaggregated c=1", "disaggregated c=4", "aggregated c=1", "aggregated c=4",
        "no shared prefix c=1", "shared prefix c=1",
    ]  # fmt: skip
    assert all(s.completed == 4 and s.failed == 0 for s in rows.values())
    assert rows["aggregated c=4"].total_output_tokens == 12
    assert rows["shared prefix c=1"].total_input_tokens == 4 * (16 + 128)
    assert "| aggregated c=4 |" in (tmp_path / "out" / "matrix.md").read_text()
    assert (tmp_path / "out" / "shared-prefix.png").exists()
    assert "llama-server F32 c=16" in capsys.readouterr().out
