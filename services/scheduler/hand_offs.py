"""KV hand-offs that never arrived, and the placements that keep off their link (issue 60,
case 5: a degraded KV path loses nothing).

On a split path the prefill worker streams the request's first token, then the KV moves to
the decode worker, whose first step streams the next one. Each split placement is
remembered by its request (the gateway's id without a migration's `~attempt`): the pair and
the tokens already delivered. When a later attempt of that request arrives having gained at
most one token since (the prefill's first), the hand-off never reached the decode worker's
first step: the transfer failed, passed its deadline, or stalled until the gateway migrated
it (or a worker of the pair died). Then
- the request prefills where it decodes from then on (`Avoid.local`,
  `Rule.FAILED_HAND_OFF`), so no attempt of it needs a KV link again;
- the pair (prefill, decode) is split over by no request for `PAIR_COOLOFF_S`
  (`Avoid.pairs`): a request placed on that decode worker splits with another prefill
  worker, or prefills there itself (`Rule.FAILED_PAIR`).
Each placement kept off a link this way is counted
(`splitserve_scheduler_kv_fallbacks_total{reason}`: request, pair). The book is soft state
of one scheduler replica, but the judgement is not: a migrated attempt names the previous
attempt's split itself (`SubmitRequest.last_prefill`, `last_decode`, `last_delivered`, set
by the gateway), so whichever replica the queue group hands it judges that hand-off, and
keeps the request off every link from then on. The pair's cool-off is each replica's own,
learnt from the attempts it places; a pair judged from what an attempt names is marked with
the epochs the judging replica knows (a worker of it that restarted in between is avoided
for the cool-off too: it cannot tell).

The one subtle rule: a pair is marked with the process epochs of both its workers, and
avoided only while both ids still run those processes: a worker that restarted (or a
killed one that came back) is a fresh end of the link, not the one that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from services.scheduler.path_cost import Rule
from services.scheduler.registry import Registry
from shared.protocol import SubmitRequest

PAIR_COOLOFF_S = 60.0  # how long a pair whose hand-off failed is not split over
REASONS = {Rule.FAILED_HAND_OFF: "request", Rule.FAILED_PAIR: "pair"}  # the metric's label

Pair = tuple[str, str]  # (prefill worker id, decode worker id)


@dataclass(frozen=True, slots=True)
class Avoid:
    """What one placement keeps off: every split, or splits over the given pairs."""

    local: bool = False
    pairs: frozenset[Pair] = frozenset()

    def prefills(self, decode: str) -> frozenset[str]:
        """The prefill workers not to split with when decoding on `decode`."""
        return frozenset(p for p, d in self.pairs if d == decode)


NOTHING = Avoid()  # every link may be used


@dataclass(slots=True)
class _Split:
    attempt: int
    delivered: int  # tokens delivered before this attempt
    pair: Pair
    epochs: tuple[int, int]  # the pair's processes when it was placed
    deadline: float  # the request's: forgotten after it


@dataclass(slots=True)
class HandOffs:
    registry: Registry  # the workers' current process epochs
    clock: Callable[[], float]
    fallbacks: Counter | None = None  # labelled `reason`
    cooloff: float = PAIR_COOLOFF_S
    _splits: dict[str, _Split] = field(default_factory=dict)  # by request (no `~attempt`)
    _local: dict[str, float] = field(default_factory=dict)  # request → its deadline
    _pairs: dict[Pair, tuple[tuple[int, int], float]] = field(default_factory=dict)  # → until

    def placed(self, request: SubmitRequest, prefill: str, decode: str) -> None:
        """`request` was split over (prefill, decode)."""
        epochs = (self.registry.epoch(prefill), self.registry.epoch(decode))
        delivered = len(request.delivered_token_ids)
        split = _Split(request.attempt, delivered, (prefill, decode), epochs, request.deadline)
        self._splits[base_id(request)] = split

    def avoid(self, request: SubmitRequest) -> Avoid:
        """What placing `request` keeps off, having judged the hand-off of its last split
        attempt if this is a later one."""
        key, now = base_id(request), self.clock()
        split = self._last_split(key, request)
        if split is not None and len(request.delivered_token_ids) <= split.delivered + 1:
            self._local[key] = request.deadline
            self._pairs[split.pair] = (split.epochs, now + self.cooloff)
        pairs = frozenset(
            pair
            for pair, (epochs, until) in self._pairs.items()
            if until > now and self._epochs(pair) == epochs
        )
        return Avoid(key in self._local, pairs)

    def count(self, rule: Rule) -> None:
        """A request was placed by `rule`: counted if that kept it off a failed link."""
        if self.fallbacks is not None and rule in REASONS:
            self.fallbacks.labels(REASONS[rule]).inc()

    def forget_older(self, now: float) -> None:
        """Drop what concerns requests past their deadline, and pairs past their cool-off."""
        self._splits = {k: s for k, s in self._splits.items() if s.deadline >= now}
        self._local = {k: deadline for k, deadline in self._local.items() if deadline >= now}
        self._pairs = {p: mark for p, mark in self._pairs.items() if mark[1] > now}

    def _last_split(self, key: str, request: SubmitRequest) -> _Split | None:
        """The split of an earlier attempt of `request`, taken out of the book: this
        replica's record when it placed the previous attempt, else the previous attempt's
        split as the request names it (whichever replica placed it), else this replica's
        older record; None when there is none."""
        booked = self._splits.get(key)
        if booked is not None and booked.attempt < request.attempt:
            del self._splits[key]
        else:
            booked = None
        previous = booked is not None and booked.attempt == request.attempt - 1
        if request.attempt and request.last_prefill and not previous:
            pair = (request.last_prefill, request.last_decode)
            delivered = request.last_delivered
            epochs = self._epochs(pair)  # as it knows them: the placing replica's are not said
            return _Split(request.attempt - 1, delivered, pair, epochs, request.deadline)
        return booked

    def _epochs(self, pair: Pair) -> tuple[int, int]:
        return self.registry.epoch(pair[0]), self.registry.epoch(pair[1])


def base_id(request: SubmitRequest) -> str:
    """The request's id across its attempts (the gateway adds `~<attempt>` on migration)."""
    if not request.attempt:
        return request.request_id
    return request.request_id.removesuffix(f"~{request.attempt}")
