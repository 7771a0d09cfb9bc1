"""Each placed request's predicted TTFT, kept until a worker reports its first token.

The worker that streams a request's first token reports the TTFT it observed (from the
gateway's `submitted_at`) in its next heartbeat (`Heartbeat.first_tokens`); `observe` pairs
it with the prediction, and the scheduler records the error (observed − predicted) in
`splitserve_scheduler_ttft_prediction_error_seconds{path}` and a `scheduler.first_token`
span, a child of the request's `scheduler.route` span (ended by then; a child keeps it in
the request's own trace, where a link would start another).

The one subtle rule: the book is soft state and bounded. A prediction is kept `KEEP_S` at
most, and `MAX_KEPT` in all (oldest dropped first); a report for a request it does not hold
(placed by another scheduler replica, or before a restart) is ignored.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import Histogram

from services.scheduler.path_cost import Path
from shared.protocol import FirstToken
from shared.telemetry.tracing import ns

KEEP_S = 300.0  # a first token later than this after placement is not compared
MAX_KEPT = 65536


@dataclass(frozen=True, slots=True)
class Prediction:
    path: Path
    predicted_ttft: float  # seconds
    submitted_at: float  # the gateway's Unix seconds (the observed TTFT starts there)
    placed_at: float  # the scheduler's clock
    route: Context  # the `scheduler.route` span's context


@dataclass(frozen=True, slots=True)
class Observed:
    prediction: Prediction
    observed_ttft: float

    @property
    def error(self) -> float:
        return self.observed_ttft - self.prediction.predicted_ttft


class PredictionBook:
    def __init__(
        self,
        tracer: trace.Tracer,
        errors: Histogram,
        keep_s: float = KEEP_S,
        max_kept: int = MAX_KEPT,
    ) -> None:
        self.tracer = tracer
        self.errors = errors  # labelled by path
        self.keep_s = keep_s
        self.max_kept = max_kept
        self._kept: OrderedDict[str, Prediction] = OrderedDict()  # in placement order

    def __len__(self) -> int:
        return len(self._kept)

    def remember(self, request_id: str, prediction: Prediction) -> None:
        self._kept.pop(request_id, None)
        self._kept[request_id] = prediction
        while len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)

    def observe(self, first: FirstToken, worker_id: str) -> Observed | None:
        """A first token `worker_id` streamed: its error in the metric and a span, once."""
        prediction = self._kept.pop(first.request_id, None)
        if prediction is None:
            return None
        seen = Observed(prediction, first.ttft)
        self.errors.labels(prediction.path.label).observe(seen.error)
        span = self.tracer.start_span(
            "scheduler.first_token", prediction.route, start_time=ns(prediction.submitted_at)
        )
        span.set_attributes(
            {
                "splitserve.request_id": first.request_id,
                "splitserve.worker": worker_id,
                "splitserve.path": prediction.path.label,
                "splitserve.predicted_ttft_s": prediction.predicted_ttft,
                "splitserve.observed_ttft_s": first.ttft,
                "splitserve.ttft_error_s": seen.error,
            }
        )
        span.end(ns(prediction.submitted_at + first.ttft))
        return seen

    def forget_older(self, now: float) -> None:
        horizon = now - self.keep_s
        while self._kept:
            request_id, oldest = next(iter(self._kept.items()))
            if oldest.placed_at >= horizon:
                return
            del self._kept[request_id]
