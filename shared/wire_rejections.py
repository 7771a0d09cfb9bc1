"""`splitserve_wire_rejected_total{subject}`: frames a service refused, counted and logged.

A frame that does not decode, or breaks a bound (shared/wire_checks.py), is refused before
any handler sees it: one warning naming the subject and the reason (never the payload,
which may hold a prompt) and +1 on the counter. Each `Bus` has one `WireRejections`;
a service adds `rejections.counter` to the registry its /metrics serves.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

log = logging.getLogger(__name__)


class WireRejections:
    def __init__(self) -> None:
        self.counter = Counter(
            "splitserve_wire_rejected",
            "Incoming NATS frames refused: undecodable, wrong kind or shape, out of range",
            ["subject"],
            registry=None,  # the service's own registry adds it
        )

    def reject(self, subject: str, reason: object) -> None:
        self.counter.labels(subject).inc()
        log.warning("rejected a frame on %s: %s", subject, reason)

    def count(self, subject: str) -> float:
        """Frames refused on `subject` so far."""
        for metric in self.counter.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels == {"subject": subject}:
                    return sample.value
        return 0.0
