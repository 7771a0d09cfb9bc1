"""What one placement writes on its `scheduler.route` span: the outcome and the workers, the
path and its predicted TTFT; and the prediction kept to compare with the TTFT observed
(predictions.py).

The one subtle rule: a prediction is kept only when there is one and the gateway timed the
submit (`submitted_at`): without both, the observed TTFT has nothing to be compared with.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Span

from services.scheduler.path_cost import Path
from services.scheduler.predictions import Prediction, PredictionBook
from shared.protocol import SubmitAck, SubmitRequest
from shared.telemetry.tracing import fail


def record_route(
    span: Span, request: SubmitRequest, ack: SubmitAck, predictions: PredictionBook, now: float
) -> None:
    span.set_attributes(
        {
            "splitserve.accepted": ack.accepted,
            "splitserve.outcome": ack.outcome.name,
            "splitserve.prefill_worker": ack.prefill_worker,
            "splitserve.decode_worker": ack.decode_worker,
            "splitserve.disaggregated": bool(ack.prefill_worker),
        }
    )
    if not ack.accepted:
        fail(span, ack.error)
        return
    path = Path.SPLIT if ack.prefill_worker else Path.LOCAL
    span.set_attribute("splitserve.path", path.label)
    span.set_attribute("splitserve.predicted_ttft_s", ack.predicted_ttft)
    if ack.predicted_ttft > 0 and request.submitted_at > 0:
        route = trace.set_span_in_context(span)
        prediction = Prediction(path, ack.predicted_ttft, request.submitted_at, now, route)
        predictions.remember(request.request_id, prediction)
