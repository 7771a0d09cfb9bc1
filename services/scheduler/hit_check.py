"""Predicted against actual prefix hits: does the registry's view of the workers' caches
(their pools and second KV tiers, from KV events) match what their engines find?

Each placement predicts, for the worker that computes the prompt, how many prompt tokens it
will find cached: its overlap (routing.held_prefix) in tokens, capped as the engine caps it
(at least the last token is computed). The actual comes back two ways:
- side "reserve": on a split path the decode worker's `Reservation.num_cached_blocks`,
  compared at once with the decode candidate's overlap (placement.py);
- side "compute": the computing worker's own count, `FirstToken.cached_tokens` in its next
  heartbeat (the prefill worker on a split path, the decode worker on a local one).
Both sides feed splitserve_scheduler_prefix_{predicted,actual}_tokens_total{side}; their
ratio over time is the router's accuracy. A comparison off by more than `DIVERGENCE_BLOCKS`
blocks counts in splitserve_scheduler_prefix_divergences_total{side} and is logged, at
most once per `LOG_EVERY_S` with the number since. The compute side's comparison is also a
`scheduler.prefix_hit` span, a child of the request's `scheduler.route` span.

The one subtle rule: like predictions.py, the book is soft state and bounded (`KEEP_S`,
`MAX_KEPT`); a report for a request it does not hold, or from another worker than the one
predicted for, is ignored.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import CollectorRegistry, Counter

from shared.protocol import FirstToken
from shared.telemetry.metrics import P

log = logging.getLogger(__name__)

DIVERGENCE_BLOCKS = 1  # a prediction off by more blocks than this is a divergence
LOG_EVERY_S = 10.0
KEEP_S = 300.0
MAX_KEPT = 65536
SIDES = ("compute", "reserve")


@dataclass(frozen=True, slots=True)
class Expected:
    worker_id: str  # the worker computing the prompt
    predicted_tokens: int
    block_size: int  # of its model's workers: the divergence bound's unit
    placed_at: float  # the scheduler's clock
    route: Context | None  # the `scheduler.route` span's context


def predicted_tokens(overlap: int, num_tokens: int, block_size: int) -> int:
    """The cached prompt tokens an engine finds for `overlap` held leading blocks: never
    the whole prompt (its last token is computed, for the logits)."""
    return min(overlap, max(0, num_tokens - 1) // block_size) * block_size


class HitBook:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        tracer: trace.Tracer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tracer = tracer or trace.get_tracer(__name__)
        self.clock = clock
        registry = registry or CollectorRegistry()
        self.predicted = Counter(
            P + "scheduler_prefix_predicted_tokens", "Prompt tokens placements predicted "
            "cached, by side (compute: the computing worker; reserve: the decode reservation)",
            ["side"], registry=registry,
        )  # fmt: skip
        self.actual = Counter(
            P + "scheduler_prefix_actual_tokens", "Prompt tokens the workers found cached, by "
            "side, for the placements predicted", ["side"], registry=registry,
        )  # fmt: skip
        self.divergences = Counter(
            P + "scheduler_prefix_divergences", "Placements whose actual prefix hit was off "
            f"the predicted by more than {DIVERGENCE_BLOCKS} block(s), by side",
            ["side"], registry=registry,
        )  # fmt: skip
        self._kept: OrderedDict[str, Expected] = OrderedDict()  # in placement order
        self._unlogged = 0  # divergences since the last log line
        self._logged_at = -LOG_EVERY_S

    def __len__(self) -> int:
        return len(self._kept)

    def remember(
        self,
        request_id: str,
        worker_id: str,
        predicted: int,
        block_size: int,
        route: Context | None = None,
    ) -> None:
        self._kept.pop(request_id, None)
        self._kept[request_id] = Expected(worker_id, predicted, block_size, self.clock(), route)
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)

    def observe(self, first: FirstToken, worker_id: str) -> int | None:
        """The computing worker's first token: compare its cached tokens with the prediction
        (once). Returns the difference (actual − predicted), None when nothing was kept."""
        expected = self._kept.get(first.request_id)
        if expected is None or expected.worker_id != worker_id:
            return None
        del self._kept[first.request_id]
        span = self.tracer.start_span("scheduler.prefix_hit", expected.route)
        span.set_attributes(
            {
                "splitserve.request_id": first.request_id,
                "splitserve.worker": worker_id,
                "splitserve.prefix_predicted_tokens": expected.predicted_tokens,
                "splitserve.prefix_actual_tokens": first.cached_tokens,
            }
        )
        span.end()
        self.compare("compute", first.request_id, worker_id, expected.predicted_tokens,
                     first.cached_tokens, expected.block_size)  # fmt: skip
        return first.cached_tokens - expected.predicted_tokens

    def compare(
        self,
        side: str,
        request_id: str,
        worker_id: str,
        predicted: int,
        actual: int,
        block_size: int,
    ) -> bool:
        """Count one comparison; True (and logged, rate-limited) when it diverges by more
        than DIVERGENCE_BLOCKS blocks of `block_size` tokens."""
        self.predicted.labels(side).inc(predicted)
        self.actual.labels(side).inc(actual)
        if abs(actual - predicted) <= DIVERGENCE_BLOCKS * block_size:
            return False
        self.divergences.labels(side).inc()
        self._unlogged += 1
        now = self.clock()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "prefix hit off its prediction (%s): %s on %s found %d tokens cached, %d "
                "predicted (%d such since the last report)",
                side, request_id, worker_id, actual, predicted, self._unlogged,
            )  # fmt: skip
            self._logged_at, self._unlogged = now, 0
        return True

    def forget_older(self, now: float) -> None:
        horizon = now - KEEP_S
        while self._kept:
            request_id, oldest = next(iter(self._kept.items()))
            if oldest.placed_at >= horizon:
                return
            del self._kept[request_id]
