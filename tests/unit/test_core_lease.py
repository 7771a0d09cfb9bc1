"""The core lease of co-located workers: homes, borrowing idle workers' cores, giving them
back to an owner that wakes, sharing homes when workers outnumber cores, and locks that die
with their process. A wait on another worker stops for the caller's commands and resumes
with its limit running on."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.worker.core_lease import CoreLease


def _waiting_acquire(lease: CoreLease) -> tuple[threading.Thread, list[int]]:
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(lease.acquire()), daemon=True)
    thread.start()
    time.sleep(0.2)
    return thread, got


def _prefill_and_decode(directory: Path) -> tuple[CoreLease, CoreLease]:
    return CoreLease(2, directory, role="prefill"), CoreLease(2, directory, role="decode")


def test_each_worker_claims_its_own_home_core(tmp_path):
    a, b = CoreLease(2, tmp_path / "locks"), CoreLease(2, tmp_path / "locks")
    assert {a.home, b.home} == {0, 1}
    assert (tmp_path / "locks").stat().st_mode & 0o777 == 0o700
    a.close(), b.close()


def test_a_step_borrows_the_cores_of_idle_workers_only(tmp_path):
    a, b = CoreLease(2, tmp_path), CoreLease(2, tmp_path)
    assert a.acquire() == 2  # b has no work: its core too
    a.release(), a.idle()
    assert b.acquire() == 2
    b.release()  # b still has work (its flag stays up) between its steps
    assert a.acquire() == 1  # so a keeps to its own core
    a.release()
    b.idle()
    assert a.acquire() == 2
    a.release()
    a.close(), b.close()


def test_an_owner_that_wakes_gets_its_core_after_the_borrowers_step(tmp_path):
    a, b = CoreLease(2, tmp_path), CoreLease(2, tmp_path)
    assert a.acquire() == 2
    waiter, got = _waiting_acquire(b)
    assert not got, "b waits while a's step runs on b's core"
    a.release()
    waiter.join(timeout=5)
    assert got == [1]  # a is active: b does not borrow its core either
    assert a.acquire() == 1  # and a borrows b's no more
    a.release(), b.release()
    a.close(), b.close()


def test_workers_beyond_the_cores_share_homes_and_take_turns(tmp_path):
    leases = [CoreLease(2, tmp_path) for _ in range(3)]
    homes = [lease.home for lease in leases]
    assert sorted(homes[:2]) == [0, 1] and homes[2] in (0, 1)
    sharer = next(lease for lease in leases[:2] if lease.home == homes[2])
    assert sharer.acquire() == 2
    waiter, got = _waiting_acquire(leases[2])
    assert not got, "a shared home is one step at a time"
    sharer.release()
    waiter.join(timeout=5)
    assert got == [2]  # the home is shared; the other worker is idle, so its core is free
    leases[2].release()
    for lease in leases:
        lease.close()


def _unlocked_cores(lease: CoreLease, monkeypatch) -> list[int]:
    """The cores `lease` lets go from now on, in order."""
    unlocked: list[int] = []
    flock = fcntl.flock

    def recording_flock(fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_UN and fd in lease._files:
            unlocked.append(lease._files.index(fd))
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", recording_flock)
    return unlocked


def test_a_step_gives_back_last_the_core_a_waking_worker_waits_on(tmp_path, monkeypatch):
    # A worker wakes on its home core, then borrows the idle ones: they must be free by then.
    a, b = CoreLease(2, tmp_path), CoreLease(2, tmp_path)
    assert a.acquire() == 2
    unlocked = _unlocked_cores(a, monkeypatch)
    a.release()
    assert unlocked == [b.home, a.home], "active: a worker sharing a's home may wait on it"
    a.idle()
    prefill, decode = _prefill_and_decode(tmp_path / "turn")
    assert prefill.acquire() == 2
    waiter, got = _waiting_acquire(decode)  # its flag is up; it waits on its home core
    unlocked = _unlocked_cores(prefill, monkeypatch)
    prefill.idle()  # as before an overdue turn
    prefill.release()
    waiter.join(timeout=5)
    assert unlocked == [prefill.home, decode.home], "the decode waits on its home core"
    assert got == [2]
    decode.release()
    for lease in (a, b, prefill, decode):
        lease.close()


def lease_holder(tmp_path) -> subprocess.Popen[str]:
    """Another process holding a 2-core lease in `tmp_path`: it prints its core, then sleeps."""
    script = (
        "import sys, time; from pathlib import Path;"
        "from services.worker.core_lease import CoreLease;"
        "lease = CoreLease(2, Path(sys.argv[1])); print(lease.acquire(), flush=True);"
        "time.sleep(60)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )


def test_a_killed_worker_strands_no_core(tmp_path):
    holder = lease_holder(tmp_path)
    try:
        assert holder.stdout.readline().strip() == "2"
        mine = CoreLease(2, tmp_path)
        waiter, got = _waiting_acquire(mine)
        assert not got  # the holder steps on both cores
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        waiter.join(timeout=5)
        mine.release()
        assert mine.acquire() == 2  # the dead worker's flag and core are gone
        mine.release()
        mine.close()
    finally:
        holder.kill()


def test_an_owner_waits_for_a_wedged_borrower_for_a_while_at_most(tmp_path, monkeypatch, caplog):
    # A borrower stopped mid-step (SIGSTOP, a stuck native call) keeps its locks while its
    # process lives: the owner logs it and steps on its own core regardless.
    monkeypatch.setattr("services.worker.core_lease.HOME_WAIT_LIMIT_S", 0.3)
    borrower, owner = CoreLease(2, tmp_path), CoreLease(2, tmp_path)
    assert borrower.acquire() == 2  # the owner was idle: the borrower steps on its core too
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="services.worker.core_lease"):
        assert owner.acquire() == 1
    assert 0.3 <= time.monotonic() - started < 3
    assert f"core {owner.home} is still held by another worker's step" in caplog.text
    owner.release()  # lets go of nothing it does not hold: the borrower's lock stays
    assert not _free_core(tmp_path, owner.home)
    borrower.release()
    assert owner.acquire() == 1  # its home now, at once; the borrower is active
    owner.release(), borrower.release()
    owner.close(), borrower.close()


def _free_core(directory: Path, core: int) -> bool:
    fd = os.open(directory / f"core-{core}", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_an_owner_waiting_for_its_core_answers_its_commands(tmp_path):
    borrower, owner = CoreLease(2, tmp_path), CoreLease(2, tmp_path)
    assert borrower.acquire() == 2
    commands = [True]
    started = time.monotonic()
    assert owner.acquire(interrupted=lambda: bool(commands)) is None  # holding nothing
    assert time.monotonic() - started < 0.25
    commands.clear()  # applied; the owner asks again and waits on
    waiter, got = _waiting_acquire(owner)
    assert not got
    borrower.release()
    waiter.join(timeout=5)
    assert got == [1]
    owner.release(), borrower.release()
    owner.close(), borrower.close()


def test_a_decode_worker_yields_its_core_to_a_prefill_backlog(tmp_path):
    prefill, decode = _prefill_and_decode(tmp_path)
    assert decode.acquire() == 2  # no backlog: decode borrows the idle prefill's core
    decode.release()
    assert prefill.acquire() == 1  # decode is active between its steps
    prefill.set_backlog(True)  # the step left prompts waiting
    prefill.release()
    waiter, got = _waiting_acquire(decode)
    assert not got, "decode waits while the prefill has a backlog"
    assert prefill.acquire() == 2  # and the prefill steps on both cores meanwhile
    prefill.set_backlog(False)
    prefill.release()
    waiter.join(timeout=5)
    assert got == [1]  # the prefill still has work: its core stays its own
    decode.release()
    prefill.close(), decode.close()


def test_a_prefill_with_a_backlog_waits_for_an_active_decode_to_yield(tmp_path):
    prefill, decode = _prefill_and_decode(tmp_path)
    assert decode.acquire() == 2  # the prefill has no work yet
    prefill.set_backlog(True)  # prompts arrive during the decode's step
    prefill_waiter, prefill_got = _waiting_acquire(prefill)  # waits on its home core
    decode.release()  # the decode is still active between its steps
    time.sleep(0.1)
    assert not prefill_got, "the prefill waits for the decode's next step to yield"
    decode_waiter, decode_got = _waiting_acquire(decode)  # lowers its flag: the backlog
    prefill_waiter.join(timeout=5)
    assert prefill_got == [2], "not one core, with the decode's idle while it waits"
    prefill.set_backlog(False)
    prefill.release()
    decode_waiter.join(timeout=5)
    assert decode_got == [1]  # the prefill is active between its steps
    decode.release()
    prefill.close(), decode.close()


def test_a_prefill_waits_for_a_decode_to_yield_for_a_while_at_most(tmp_path, monkeypatch):
    monkeypatch.setattr("services.worker.core_lease.BORROW_WAIT_S", 0.3)
    prefill, decode = _prefill_and_decode(tmp_path)
    other = CoreLease(2, tmp_path / "both", role="both")
    prefill_beside_other = CoreLease(2, tmp_path / "both", role="prefill")
    for active in (decode, other):
        active.acquire(), active.release()  # active between steps, and steps no more
    prefill.set_backlog(True), prefill_beside_other.set_backlog(True)
    started = time.monotonic()
    assert prefill.acquire() == 1
    assert 0.3 <= time.monotonic() - started < 3
    started = time.monotonic()
    assert prefill_beside_other.acquire() == 1  # a worker of both roles never yields
    assert time.monotonic() - started < 0.25
    for lease in (prefill, prefill_beside_other):
        lease.release()
    for lease in (prefill, decode, other, prefill_beside_other):
        lease.close()


def test_a_prefill_waiting_for_a_yield_stops_for_commands_and_keeps_its_limit(
    tmp_path, monkeypatch
):
    """New prompts come in as the prefill waits for the decode's yield: it lets its core go
    and answers (they join the step it waits to take), then waits the rest of its limit."""
    monkeypatch.setattr("services.worker.core_lease.BORROW_WAIT_S", 0.3)
    prefill, decode = _prefill_and_decode(tmp_path)
    decode.acquire(), decode.release()  # active between steps, and steps no more
    prefill.set_backlog(True)
    came = threading.Event()
    threading.Timer(0.1, came.set).start()
    started = time.monotonic()
    assert prefill.acquire(interrupted=came.is_set) is None  # a command came: no step yet
    assert 0.1 <= time.monotonic() - started < 0.25
    assert _free_core(tmp_path, prefill.home), "the prefill holds no core meanwhile"
    assert prefill.acquire(interrupted=lambda: False) == 1  # the rest of the same 0.3 s
    assert 0.3 <= time.monotonic() - started < 0.45
    prefill.release()
    assert prefill.acquire(interrupted=lambda: True) is None
    prefill.idle()
    prefill.set_backlog(True)
    began = time.monotonic()
    assert prefill.acquire(interrupted=lambda: time.monotonic() - began > 0.1) is None, (
        "work after an idle spell waits a limit of its own"
    )
    prefill.idle()
    prefill.close(), decode.close()


def _leases_with_a_backlog(tmp_path, monkeypatch) -> tuple[CoreLease, CoreLease]:
    """(prefill, decode) with a 0.3 s yield limit, after a prefill step that left a backlog."""
    monkeypatch.setattr("services.worker.core_lease.YIELD_LIMIT_S", 0.3)
    prefill, decode = _prefill_and_decode(tmp_path)
    prefill.acquire()
    prefill.set_backlog(True)
    prefill.release()
    return prefill, decode


def test_a_backlog_holds_a_decode_step_back_for_the_yield_limit_at_most(tmp_path, monkeypatch):
    prefill, decode = _leases_with_a_backlog(tmp_path, monkeypatch)
    started = time.monotonic()
    assert decode.acquire() == 1  # waited out the limit, then stepped on its own core
    assert 0.3 <= time.monotonic() - started < 3
    decode.release()
    prefill.idle()  # no work: the backlog goes with it
    assert decode.acquire() == 2
    decode.release()
    prefill.close(), decode.close()


def test_a_decode_waiting_on_a_backlog_stops_for_commands_and_keeps_its_limit(
    tmp_path, monkeypatch
):
    prefill, decode = _leases_with_a_backlog(tmp_path, monkeypatch)  # a 0.3 s limit
    came = threading.Event()
    threading.Timer(0.1, came.set).start()
    started = time.monotonic()
    assert decode.acquire(interrupted=came.is_set) is None  # a command came: no step yet
    assert 0.1 <= time.monotonic() - started < 0.25
    assert prefill.acquire() == 2, "the decode holds nothing meanwhile"
    prefill.release()
    assert decode.acquire(interrupted=lambda: False) == 1  # the rest of the same 0.3 s
    assert 0.3 <= time.monotonic() - started < 0.45
    decode.release()
    assert decode.acquire(interrupted=lambda: True) is None
    time.sleep(0.35)  # its limit has passed; then the commands left it no work
    decode.idle()
    began = time.monotonic()
    assert decode.acquire(interrupted=lambda: time.monotonic() - began > 0.1) is None, (
        "work after an idle spell waits a limit of its own"
    )
    decode.idle()
    prefill.close(), decode.close()


def test_an_overdue_decode_step_takes_every_core_for_one_turn(tmp_path, monkeypatch):
    monkeypatch.setattr("services.worker.core_lease.YIELD_LIMIT_S", 0.3)
    prefill, decode = _prefill_and_decode(tmp_path)
    assert prefill.acquire() == 2  # decode has no work yet
    prefill.set_backlog(True)  # and this step leaves prompts waiting
    decode_waiter, decode_got = _waiting_acquire(decode)
    deadline = time.monotonic() + 10  # the decode waits out the limit, turns overdue, then
    while not prefill._some_overdue():  # waits for its core, in the prefill's step
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not decode_got
    prefill.release()  # the prefill's step ends
    decode_waiter.join(timeout=5)
    assert decode_got == [2], "an overdue decode step runs on every core, not beside a prefill"
    prefill_waiter, prefill_got = _waiting_acquire(prefill)
    assert not prefill_got, "the prefill waits for the decode's turn to end"
    decode.release()
    prefill_waiter.join(timeout=5)
    assert prefill_got == [2], "then it has every core again: the decode yields to the backlog"
    prefill.release()
    prefill.close(), decode.close()


def test_a_prefill_waits_for_an_overdue_decode_step_for_the_yield_limit_at_most(
    tmp_path, monkeypatch
):
    prefill, decode = _leases_with_a_backlog(tmp_path, monkeypatch)
    assert decode.acquire() == 1  # overdue: the prefill is active between its steps
    started = time.monotonic()
    assert prefill.acquire() == 1  # the decode step is not over: after the limit, its own core
    assert 0.3 <= time.monotonic() - started < 3
    prefill.release(), decode.release()
    prefill.close(), decode.close()


def test_workers_of_both_roles_neither_raise_nor_heed_backlogs(tmp_path):
    a, b = CoreLease(2, tmp_path, role="both"), CoreLease(2, tmp_path, role="both")
    a.acquire()
    a.set_backlog(True)
    a.release()
    started = time.monotonic()
    assert b.acquire() == 1
    assert time.monotonic() - started < 0.5
    b.release()
    a.close(), b.close()


def test_an_owner_does_not_wait_on_a_stopped_holder(tmp_path, caplog):
    # A worker frozen mid-step (SIGSTOP) holds its locks for as long as it is stopped: the
    # owner of the core it holds steps at once rather than after HOME_WAIT_LIMIT_S (60 s).
    holder = lease_holder(tmp_path)
    try:
        assert holder.stdout.readline().strip() == "2"  # its home and the idle one
        os.kill(holder.pid, signal.SIGSTOP)
        owner = CoreLease(2, tmp_path)
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="services.worker.core_lease"):
            assert owner.acquire() == 1  # its own core, unlocked: the holder still has it
        assert time.monotonic() - started < 3
        assert f"held by process {holder.pid}, which is stopped" in caplog.text
        owner.release()
        os.kill(holder.pid, signal.SIGCONT)
        owner.close()
    finally:
        holder.kill()
        holder.wait(timeout=10)
