"""The scheduler: worker registry from heartbeats, KV- and load-aware placement, admission."""
