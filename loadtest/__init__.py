"""Load harness for OpenAI-compatible endpoints (see the load-harness issue; not built yet)."""
