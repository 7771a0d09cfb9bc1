"""`splitserve bench burst --mesh` against a scripted server: bursts of fresh token-id prompts
alternate between wanting one token and wanting `output_len`, the pair's gap has the right
sign, a failed request fails the bench, and the CLI keeps the engine's flags and the mesh's
apart."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from loadtest.fake_server import FakeServer, Script
from loadtest.mesh_bench.burst import MeshBurstConfig, last_first_token_ms, run_pairs
from loadtest.request import RequestRecord
from services.cli import build_parser


class StreamsCostMore(FakeServer):
    """First tokens come 0.2 s later for requests that want more than one token; records
    each request's (prompt, max_tokens)."""

    def __init__(self) -> None:
        super().__init__(Script(ttft_s=0.02, itl_s=0.001))
        self.bodies: list[tuple[list[int], int]] = []

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append((body["prompt"], body["max_tokens"]))
        if body["max_tokens"] > 1:
            await asyncio.sleep(0.2)
        return await super()._complete(request)


def test_pairs_alternate_one_token_and_streams_over_fresh_prompts(tiny_model_dir, capsys):
    config = MeshBurstConfig(tiny_model_dir, prompts=3, prompt_len=5, output_len=4, pairs=2)
    server = StreamsCostMore()

    async def main() -> list:
        url = await server.start()
        try:
            return await run_pairs(config, url, "fake-model")
        finally:
            await server.stop()

    pairs = asyncio.run(main())
    assert len(pairs) == 2
    for pair in pairs:
        assert 20 <= pair.alone_ms < 200 <= pair.streaming_ms
        assert pair.gap_ms == pair.streaming_ms - pair.alone_ms > 0
    wanted = [max_tokens for _, max_tokens in server.bodies]
    assert sorted(wanted[:3]) == [2] * 3  # the warm-up burst
    assert sorted(wanted[3:6]) == [1] * 3 and sorted(wanted[6:9]) == [4] * 3
    assert sorted(wanted[9:12]) == [1] * 3 and sorted(wanted[12:]) == [4] * 3
    prompts = [tuple(prompt) for prompt, _ in server.bodies]
    assert len(set(prompts)) == len(prompts) == 15, "every burst is new to the prefix cache"
    assert all(len(p) == 5 for p in prompts)
    assert "pair 2: last first token" in capsys.readouterr().out


def test_a_failed_request_fails_the_burst():
    ok = RequestRecord(label="burst", send=1.0, chunk_times=[1.5])
    assert last_first_token_ms([ok]) == 500.0
    failed = RequestRecord(label="burst", send=1.0, error="http_503")
    with pytest.raises(RuntimeError, match=r"1 request\(s\) of the burst failed: http_503"):
        last_first_token_ms([ok, failed])


def test_bad_sizes_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="output_len > 1"):
        MeshBurstConfig(tiny_model_dir, output_len=1)
    with pytest.raises(ValueError, match="positive"):
        MeshBurstConfig(tiny_model_dir, pairs=0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "--threads", "2"], "--threads only without --mesh"),
        (["--mesh", "--dtype", "float32"], "--dtype only without --mesh"),
        (["--pairs", "3"], "--pairs only with --mesh"),
        (["--", "--dtype", "float32"], "flags after -- are for `splitserve up`, with --mesh"),
    ],
)
def test_the_cli_keeps_engine_and_mesh_flags_apart(argv, message):
    args = build_parser().parse_args(["bench", "burst", *argv])
    with pytest.raises(SystemExit, match=message):
        args.func(args)
