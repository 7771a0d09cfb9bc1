"""The scheduler's book of predicted TTFTs: a first token reported once is compared once
(the error in the metric, by path), and the book stays bounded by age and by size."""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.trace import NoOpTracer

from services.scheduler.path_cost import Path
from services.scheduler.predictions import Prediction, PredictionBook
from shared.protocol import FirstToken
from shared.telemetry.metrics import SchedulerMetrics

NAME = "splitserve_scheduler_ttft_prediction_error_seconds"


def book(**limits: float) -> tuple[PredictionBook, SchedulerMetrics]:
    metrics = SchedulerMetrics()
    return PredictionBook(NoOpTracer(), metrics.ttft_error, **limits), metrics


def predicted(ttft: float, placed_at: float = 100.0, path: Path = Path.SPLIT) -> Prediction:
    return Prediction(path, ttft, placed_at - 0.01, placed_at, Context())


def sample(metrics: SchedulerMetrics, suffix: str, path: str) -> float:
    return metrics.registry.get_sample_value(f"{NAME}_{suffix}", {"path": path}) or 0.0


def bucket(metrics: SchedulerMetrics, path: str, le: str) -> float:
    labels = {"path": path, "le": le}
    return metrics.registry.get_sample_value(f"{NAME}_bucket", labels) or 0.0


def test_a_reported_first_token_is_compared_once_by_path():
    predictions, metrics = book()
    predictions.remember("r1", predicted(0.4))
    predictions.remember("r2", predicted(0.35, path=Path.LOCAL))
    seen = predictions.observe(FirstToken("r1", 0.5), "p1")
    assert seen is not None and abs(seen.error - 0.1) < 1e-9
    assert predictions.observe(FirstToken("r1", 0.5), "p1") is None  # reported twice
    assert predictions.observe(FirstToken("r9", 0.5), "p1") is None  # never placed here
    predictions.observe(FirstToken("r2", 0.1), "d1")  # faster than predicted: negative
    counts = [sample(metrics, "count", path) for path in ("disaggregated", "decode_only")]
    assert counts == [1, 1]
    # counted below zero (a histogram with negative buckets has no _sum: OpenMetrics)
    assert (bucket(metrics, "decode_only", "-0.3"), bucket(metrics, "decode_only", "-0.2")) == (
        0,
        1,
    )
    assert (bucket(metrics, "disaggregated", "0.08"), bucket(metrics, "disaggregated", "0.1")) == (
        0,
        1,
    )


def test_the_book_forgets_by_age_and_keeps_at_most_its_size():
    predictions, _ = book(keep_s=60.0, max_kept=2)
    predictions.remember("old", predicted(0.4, placed_at=10.0))
    predictions.remember("new", predicted(0.4, placed_at=50.0))
    predictions.forget_older(now=100.0)  # "old" is 90 s old
    assert len(predictions) == 1
    predictions.remember("a", predicted(0.4, placed_at=90.0))
    predictions.remember("b", predicted(0.4, placed_at=95.0))  # over the size: "new" goes
    assert len(predictions) == 2
    assert predictions.observe(FirstToken("new", 0.5), "p1") is None
    assert predictions.observe(FirstToken("b", 0.5), "p1") is not None
