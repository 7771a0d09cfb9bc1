"""KV cache events: the net change of each block hash between two takes.

The block manager's state machine (test_block_manager.py) checks a subscriber against real
admissions and evictions; here the log alone, against every order of stores and removals.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.engine.stats import KVCacheEvents, KVEventLog


def test_a_hash_stored_then_removed_in_one_window_is_reported_in_neither_list() -> None:
    log = KVEventLog()
    log.stored(1)
    log.stored(2)
    log.removed(1)
    assert log.take() == KVCacheEvents(stored=[2], removed=[])
    assert log.take() == KVCacheEvents()


def test_a_hash_removed_then_stored_again_is_reported_stored() -> None:
    log = KVEventLog()
    log.stored(7)
    log.take()
    log.removed(7)
    log.stored(7)
    assert log.take() == KVCacheEvents(stored=[7], removed=[])
    log.removed(7)
    log.stored(7)
    log.removed(7)
    assert log.take() == KVCacheEvents(stored=[], removed=[7])


# Each op toggles one hash (stored if absent, evicted if present), as the block manager does;
# True between ops means "the subscriber takes the events now".
ops = st.lists(st.one_of(st.integers(0, 5), st.just(True)), max_size=60)


@given(ops=ops)
def test_a_subscriber_applying_removed_then_stored_stays_exact(ops: list[int | bool]) -> None:
    log, cached, subscriber = KVEventLog(), set(), set()
    for op in [*ops, True]:
        if op is True:
            events = log.take()
            assert not set(events.stored) & set(events.removed)
            subscriber.difference_update(events.removed)
            subscriber.update(events.stored)
            assert subscriber == cached
        elif op in cached:
            cached.remove(op)
            log.removed(op)
        else:
            cached.add(op)
            log.stored(op)
