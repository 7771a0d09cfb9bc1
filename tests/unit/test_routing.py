"""Placement rules as pure functions: prefix overlap minus load, decode by free blocks and
batch, conditional disaggregation, draining, mid-change and full workers skipped."""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.routing import (
    WorkerView,
    held_prefix,
    prefills_locally,
    rank_decode,
    rank_prefill,
)

HASHES = [11, 22, 33, 44]  # a 64-token prompt in 16-token blocks


def worker(
    worker_id: str,
    role: str = "prefill",
    cached: set[int] | None = None,
    load: int = 0,
    free_blocks: int = 100,
    draining: bool = False,
) -> WorkerView:
    return WorkerView(worker_id, role, draining, free_blocks, load, cached or set())


def test_prefix_overlap_counts_leading_blocks_only():
    assert held_prefix(HASHES, worker("w", cached={11, 22, 44})) == (2, 0, 2.0)
    assert held_prefix(HASHES, worker("w", cached={22, 33})) == (0, 0, 0.0)
    assert held_prefix([], worker("w", cached={11})) == (0, 0, 0.0)


def tiered(worker_id: str, cached: set[int], in_tier: set[int], weight: float, **kw) -> WorkerView:
    return replace(worker(worker_id, cached=cached, **kw), in_tier=in_tier, tier_weight=weight)


def test_a_block_in_the_second_tier_counts_by_its_weight():
    # 11 in the pool, 22 and 33 in the tier: three blocks held, worth 1 + 2 x 0.25
    assert held_prefix(HASHES, tiered("w", {11}, {22, 33}, 0.25)) == (3, 2, 1.5)
    # a tier that does not pay (weight 0) holds nothing the worker would load
    assert held_prefix(HASHES, tiered("w", {11}, {22, 33}, 0.0)) == (1, 0, 1.0)
    workers = [
        tiered("pool", {11, 22}, set(), 0.0),  # worth 2
        tiered("tier", {11}, {22, 33, 44}, 0.5),  # worth 1 + 1.5 = 2.5
        tiered("slow", {11}, {22, 33, 44}, 0.1),  # worth 1.3
    ]
    ranked = rank_prefill(workers, HASHES, load_penalty=0.0)
    assert [(c.worker_id, c.overlap, c.tier_blocks) for c in ranked] == [
        ("tier", 4, 3),
        ("pool", 2, 0),
        ("slow", 4, 3),
    ]


def test_tier_blocks_need_free_blocks_on_a_decode_worker():
    # 4 prompt blocks + 1 for output: the pool holds 1, so 4 more are needed, tier or not
    fits = tiered("w", {11}, {22, 33, 44}, 0.5, role="decode", free_blocks=4)
    short = tiered("v", {11}, {22, 33, 44}, 0.5, role="decode", free_blocks=3)
    ranked = rank_decode([fits, short], HASHES, 64, 16, load_penalty=0.0)
    assert [(c.worker_id, c.overlap) for c in ranked] == [("w", 4)]


def test_prefill_prefers_overlap_minus_load():
    workers = [
        worker("a", cached={11}),
        worker("b", cached={11, 22, 33}),
        worker("c", cached={11, 22, 33, 44}, load=3),  # 4 - 3 = 1 < b's 3
    ]
    ranked = rank_prefill(workers, HASHES, load_penalty=1.0)
    assert [c.worker_id for c in ranked] == ["b", "a", "c"]
    assert ranked[0].overlap == 3
    # with no penalty the full overlap wins
    assert rank_prefill(workers, HASHES, load_penalty=0.0)[0].worker_id == "c"


def test_prefill_skips_draining_and_non_prefill_roles():
    workers = [
        worker("d", role="decode", cached={11, 22}),
        worker("both", role="both", cached={11, 22}),
        worker("drain", cached={11, 22, 33, 44}, draining=True),
        worker("p"),
    ]
    assert [c.worker_id for c in rank_prefill(workers, HASHES, 1.0)] == ["p"]


def test_decode_by_running_batch_then_free_blocks():
    workers = [
        worker("busy", role="decode", load=2, free_blocks=500),
        worker("small", role="decode", free_blocks=20),
        worker("big", role="both", free_blocks=80),
        worker("pre", role="prefill", free_blocks=900),
    ]
    ranked = rank_decode(workers, HASHES, 64, block_size=16, load_penalty=1.0)
    assert [c.worker_id for c in ranked] == ["big", "small", "busy"]


def test_decode_skips_draining_and_workers_without_room():
    workers = [
        worker("drain", role="decode", draining=True),
        worker("full", role="decode", free_blocks=4),  # 64 tokens + 1 need 5 blocks
        worker("cached", role="decode", free_blocks=2, cached={11, 22, 33, 44}),  # needs 1
        worker("ok", role="decode", free_blocks=5),
    ]
    ranked = rank_decode(workers, HASHES, 64, block_size=16, load_penalty=1.0)
    assert [c.worker_id for c in ranked] == ["cached", "ok"]
    assert ranked[0].overlap == 4


def test_a_worker_changing_its_role_is_skipped_for_both_roles():
    """Mid-change (its heartbeat names a next role) nothing is placed on it, whatever the
    role it still serves; once changed it is ranked for its new role."""
    best = {11, 22, 33, 44}
    changing = [
        WorkerView("p-to-d", "prefill", False, 100, 0, best, changing=True),
        WorkerView("d-to-p", "decode", False, 100, 0, best, changing=True),
        WorkerView("both-to-d", "both", False, 100, 0, best, changing=True),
    ]
    steady = [worker("p"), worker("d", role="decode")]
    workers = changing + steady
    assert [c.worker_id for c in rank_prefill(workers, HASHES, 1.0)] == ["p"]
    ranked = rank_decode(workers, HASHES, 64, block_size=16, load_penalty=1.0)
    assert [c.worker_id for c in ranked] == ["d"]
    changed = [WorkerView("d-to-p", "prefill", False, 100, 0, best), *steady]
    assert [c.worker_id for c in rank_prefill(changed, HASHES, 1.0)] == ["d-to-p", "p"]
    ranked = rank_decode(changed, HASHES, 64, block_size=16, load_penalty=1.0)
    assert [c.worker_id for c in ranked] == ["d"]


def test_conditional_disaggregation_threshold():
    # 20 tokens, nothing cached: 20 uncached > 16 → disaggregate
    assert not prefills_locally(20, 0, 16, local_prefill_tokens=16, have_prefill_workers=True)
    # 16 tokens fit the threshold → the decode worker prefills itself
    assert prefills_locally(16, 0, 16, local_prefill_tokens=16, have_prefill_workers=True)
    # a long prompt mostly cached on decode: 70 - 4*16 = 6 uncached
    assert prefills_locally(70, 4, 16, local_prefill_tokens=16, have_prefill_workers=True)
    # threshold 0: always disaggregate when a prefill pool exists
    assert not prefills_locally(5, 0, 16, local_prefill_tokens=0, have_prefill_workers=True)
    # no prefill pool: always local
    assert prefills_locally(5000, 0, 16, local_prefill_tokens=0, have_prefill_workers=False)
