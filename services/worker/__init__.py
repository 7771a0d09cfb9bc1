"""One worker process: the NATS runtime around an `LLMEngine` (role prefill, decode or both)."""
