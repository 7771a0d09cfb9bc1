"""Observability for every service (DESIGN.md section 7).

- `tracing`: one tracer provider per service (`service.name` = `splitserve-<service>`),
  OTLP/HTTP export only when an endpoint is set (`--otlp-endpoint` or
  `OTEL_EXPORTER_OTLP_ENDPOINT`), W3C `traceparent` in NATS headers. Without an endpoint
  the tracer is OpenTelemetry's no-op one: no SDK import, no span objects kept.
- `metrics`: the Prometheus metrics of each service (names prefixed `splitserve_`), each
  service in its own registry, and the small `/metrics` HTTP server of workers and scheduler.
"""
