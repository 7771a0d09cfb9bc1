"""Which evicted blocks the tier writes (shared/engine/kv_tier/admission.py): none while no
evicted block returns; a returned block at its next eviction; every block for a window of
evictions after a return; the remembered hashes bounded."""

from __future__ import annotations

from shared.engine.kv_tier.admission import WriteAdmission

NOTHING_HELD = frozenset[int]().__contains__


def test_a_workload_that_never_returns_writes_nothing():
    admission = WriteAdmission(ghost_capacity=100, window=8)
    for start in range(0, 60, 6):  # prompts that share nothing, each missing the pool
        assert admission.asked(list(range(start + 1000, start + 1006)), NOTHING_HELD) == 0
        assert admission.admit(list(range(start, start + 6))) == [False] * 6
    assert admission.unwritten == 60


def test_a_returned_block_is_written_at_its_next_eviction():
    admission = WriteAdmission(ghost_capacity=100, window=0)
    assert admission.admit([1, 2, 3]) == [False] * 3
    assert admission.asked([2, 3, 99], NOTHING_HELD) == 2  # 2 and 3 came back; 99 is new
    assert admission.admit([4, 2, 3, 1]) == [False, True, True, False]
    assert admission.admit([2]) == [False]  # written once: a later eviction is a first again


def test_a_return_writes_every_block_for_a_window_of_evictions():
    admission = WriteAdmission(ghost_capacity=100, window=4)
    admission.admit([1, 2])
    assert admission.asked([1], NOTHING_HELD) == 1
    assert admission.admit([10, 11, 12]) == [True] * 3  # the window: the next 4 evicted
    assert admission.admit([13]) == [True]
    assert admission.admit([14]) == [False]  # the 5th: past it
    held = {20, 21}.__contains__
    assert admission.asked([20, 21, 22], held) == 2  # entries the tier holds return too
    assert admission.admit([15]) == [True]


def test_the_remembered_hashes_are_bounded():
    admission = WriteAdmission(ghost_capacity=3, window=0)
    admission.admit([1, 2, 3, 4, 5])
    assert admission.asked([1], NOTHING_HELD) == 0  # forgotten: the oldest went first
    assert admission.asked([3, 4, 5], NOTHING_HELD) == 3
