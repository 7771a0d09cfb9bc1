"""The READ-hold test hook (shared/kvtransfer/read_hold.py) over the `fake` transport: one
READ held at each point while its peer goes away, as the chaos case with NIXL does it
(tests/chaos/test_hand_off.py), and the hook's file claimed once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from shared.kvtransfer.read_hold import VARIABLE, HoldFile, HoldPoint, ReadHold, hold_file
from shared.kvtransfer.transfer import TransferError, read_blocks
from tests.unit.fake_kv_pair import LOCAL, REMOTE, pair

HOLD_S = 0.5  # long enough for the test to act while held; the hold ends it


def arm(tmp_path: Path, text: str) -> HoldFile:
    path = tmp_path / "hold"
    path.write_text(text)
    return HoldFile(path)


async def read_killed_while_held(holds: HoldFile, caplog: pytest.LogCaptureFixture) -> tuple:
    """READ with `holds`; once the hold has begun, the peer goes (the SIGKILL). Returns
    (the error raised or None, the decode side's layers, the prefill side's)."""
    fabric, prefill, decode = pair()
    deadline = asyncio.get_running_loop().time() + 30
    read = asyncio.create_task(read_blocks(decode, "prefill-0", REMOTE, LOCAL, deadline, holds))
    while "held" not in caplog.text:
        await asyncio.sleep(0.01)
    fabric.remove("prefill-0")
    try:
        await read
    except TransferError as exc:
        return exc, decode.layers, prefill.layers
    return None, decode.layers, prefill.layers


@pytest.mark.parametrize("point", ["before", "in_flight"])
def test_a_peer_gone_while_the_read_is_held_fails_it_and_writes_nothing(
    tmp_path, caplog, point
) -> None:
    caplog.set_level(logging.WARNING)
    holds = arm(tmp_path, f"{point}:{HOLD_S}")
    error, mine, _ = asyncio.run(read_killed_while_held(holds, caplog))
    assert error is not None and "gone" in str(error)
    assert all(torch.equal(layer, torch.full_like(layer, -1.0)) for layer in mine)
    state = "not posted" if point == "before" else "FAILED"
    assert f"released {point}: {state}" in caplog.text
    assert not holds.path.exists()


def test_a_peer_gone_after_the_bytes_landed_leaves_them_read(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    error, mine, theirs = asyncio.run(read_killed_while_held(arm(tmp_path, "landed:0.5"), caplog))
    assert error is None
    assert all(torch.equal(m[LOCAL], t[REMOTE]) for m, t in zip(mine, theirs, strict=True))
    assert "released landed: SUCCESS" in caplog.text


def test_a_cancel_while_held_in_flight_releases_the_handle(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING)

    async def run() -> None:
        _, _, decode = pair()
        holds = arm(tmp_path, "in_flight:30")
        deadline = asyncio.get_running_loop().time() + 60
        read = asyncio.create_task(read_blocks(decode, "prefill-0", REMOTE, LOCAL, deadline, holds))
        while "held" not in caplog.text:
            await asyncio.sleep(0.01)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read

    asyncio.run(run())
    assert "released" not in caplog.text  # cancelled, not run out


def test_one_file_holds_one_read_however_many_race(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    holds = arm(tmp_path, "before:0.2")

    async def run() -> None:
        _, _, decode = pair()
        deadline = asyncio.get_running_loop().time() + 30
        reads = [read_blocks(decode, "prefill-0", [b], [b], deadline, holds) for b in range(4)]
        await asyncio.gather(*reads)

    asyncio.run(run())
    assert caplog.text.count("held before") == 1
    assert holds.claim() is None


@pytest.mark.parametrize(
    ("text", "hold"),
    [
        ("before:1", ReadHold(HoldPoint.BEFORE, 1.0)),
        (" landed:0.25\n", ReadHold(HoldPoint.LANDED, 0.25)),
    ],
)
def test_a_hold_reads_its_point_and_seconds(text, hold) -> None:
    assert ReadHold.parse(text) == hold


@pytest.mark.parametrize("text", ["sideways:1", "before", "before:x", "before:-1", "a:1:2"])
def test_a_bad_hold_is_refused_by_what_is_wrong(text) -> None:
    with pytest.raises(ValueError, match="before"):
        ReadHold.parse(text)


def test_a_bad_file_is_removed_and_holds_nothing(tmp_path, caplog) -> None:
    holds = arm(tmp_path, "sideways:1")
    assert holds.claim() is None
    assert not holds.path.exists() and "no READ held" in caplog.text


def test_the_hook_is_off_unless_the_environment_names_a_file(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    assert hold_file() is None
    monkeypatch.setenv(VARIABLE, str(tmp_path / "hold"))
    assert hold_file() == HoldFile(tmp_path / "hold")
