"""Which other worker the scheduler names for a prefix read (services/scheduler/peer_prefix.py)."""

from __future__ import annotations

from services.scheduler.peer_prefix import peer_prefix, with_peer
from services.scheduler.routing import Candidate, WorkerView
from shared.prefix_messages import PeerHolder, PeerPrefix

HASHES = [1, 2, 3, 4, 5]
TOKENS = 5 * 16 + 3  # 5 full blocks, all reusable


def view(worker_id: str, cached: set[int], transports=("nixl", "nats"), **kw) -> WorkerView:
    return WorkerView(worker_id, "both", False, 100, 0, cached, transports=transports, **kw)


def hint(workers: list[WorkerView], overlap: int = 1, tokens: int = TOKENS) -> PeerPrefix | None:
    return peer_prefix(workers, HASHES, "w", overlap, tokens, 16)


def test_the_worker_holding_the_longest_leading_run_is_named() -> None:
    workers = [
        view("w", {1}),
        view("a", {1, 2, 3}, epoch=5),
        view("b", {1, 2, 3, 4}, epoch=9),
        view("c", {2, 3, 4, 5}),  # no block 1: nothing of it is reusable
    ]
    # the next longest run rides along, tried if the read from b fails
    assert hint(workers) == PeerPrefix("b", 9, 1, 3, [PeerHolder("a", 5, 2)])


def test_ties_go_to_the_smaller_id_and_the_computer_never_names_itself() -> None:
    workers = [view("w", {1, 2, 3, 4, 5}), view("z", {1, 2, 3}), view("y", {1, 2, 3})]
    assert hint(workers).holder == "y"


def test_no_hint_when_nobody_holds_more_or_no_read_is_possible() -> None:
    assert hint([view("w", {1, 2}), view("a", {1, 2})], overlap=2) is None
    assert hint([view("w", {1}, ("nats",)), view("a", {1, 2, 3})]) is None  # w cannot READ
    assert hint([view("w", {1}), view("a", {1, 2, 3}, ("nats",))]) is None  # a cannot be read
    assert hint([view("w", {1}), view("a", {1, 2, 3}, ("fake",))]) is None  # no common one
    draining = WorkerView("a", "both", True, 100, 0, {1, 2, 3}, transports=("nixl",))
    assert hint([view("w", {1}), draining]) is None
    assert hint([view("a", {1, 2, 3})]) is None  # the computer is not among the workers


def test_the_last_tokens_block_is_never_counted() -> None:
    """A prompt of exactly 3 blocks reuses 2 of them: its last token is always computed."""
    assert hint([view("w", set()), view("a", {1, 2, 3})], overlap=0, tokens=48) == PeerPrefix(
        "a", 0, 0, 2
    )


def test_the_predicted_hit_counts_the_blocks_read() -> None:
    candidate = Candidate("w", 1, 1.0)
    assert with_peer(candidate, PeerPrefix("a", 0, 1, 3)).overlap == 4
    assert with_peer(candidate, None) is candidate
