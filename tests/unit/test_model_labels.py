"""A worker's metrics carry the model it serves (`model`, as vLLM's `model_name`), beside
its role, on every sample; without a model they are as before."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.telemetry.metrics import WorkerMetrics


def samples(metrics: WorkerMetrics) -> list[tuple[str, dict[str, str], float]]:
    text = generate_latest(metrics.registry).decode()
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def test_every_worker_sample_names_its_model():
    metrics = WorkerMetrics("decode", "smol-b")
    metrics.running.labels("decode").set(3)
    metrics.transfer_bytes.labels("decode", "receive", "nats").inc(4096)
    metrics.queue_time.labels("decode").observe(0.01)
    found = samples(metrics)
    assert ("splitserve_num_requests_running", {"role": "decode", "model": "smol-b"}, 3.0) in found
    transfer = {"role": "decode", "direction": "receive", "transport": "nats", "model": "smol-b"}
    assert ("splitserve_kv_transfer_bytes_total", transfer, 4096.0) in found
    assert found and all(labels.get("model") == "smol-b" for _, labels, _ in found)


def test_without_a_model_the_labels_are_the_roles_alone():
    metrics = WorkerMetrics("prefill")
    metrics.running.labels("prefill").set(1)
    assert ("splitserve_num_requests_running", {"role": "prefill"}, 1.0) in samples(metrics)
