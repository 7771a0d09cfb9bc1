"""The engine's LoRA operations, on its adapter bank (None: the engine serves no adapters):
load and unload by name, the check that a request's adapter is served, and the counters
its stats report.

The one subtle rule: an adapter a request in the engine uses is neither unloaded nor read
again: the rows of that request would change adapter mid-stream.
"""

from __future__ import annotations

from collections.abc import Set
from pathlib import Path

from shared.engine.errors import InvalidRequest
from shared.engine.lora.bank import AdapterBank
from shared.engine.lora.modules import adapter_name_error


def serve_adapter(bank: AdapterBank | None, in_use: Set[str], name: str, path: Path) -> None:
    bank = _served(bank)
    if (reason := adapter_name_error(name)) is not None:
        raise InvalidRequest("lora_name", reason)
    if name in in_use:
        raise InvalidRequest("lora_name", f"adapter {name!r} is serving requests")
    bank.load(name, path)


def stop_adapter(bank: AdapterBank | None, in_use: Set[str], name: str) -> None:
    bank = _served(bank)
    if not bank.knows(name):
        raise InvalidRequest("lora_name", f"no adapter {name!r} is loaded")
    if name in in_use:
        raise InvalidRequest("lora_name", f"adapter {name!r} is serving requests")
    bank.unload(name)


def check_adapter(bank: AdapterBank | None, adapter: str) -> None:
    """InvalidRequest unless `adapter` ("": the base model) is served."""
    if adapter and (bank is None or not bank.knows(adapter)):
        raise InvalidRequest("model", f"no LoRA adapter {adapter!r} is loaded")


def adapter_stats(bank: AdapterBank | None) -> dict[str, object]:
    """EngineStats' adapter fields (none without a bank)."""
    if bank is None:
        return {}
    return {
        "adapters": tuple(bank.paths),
        "adapters_loaded": tuple(bank.in_slots),
        "adapter_swap_ins": bank.stats.swap_ins,
    }


def _served(bank: AdapterBank | None) -> AdapterBank:
    if bank is None:
        raise InvalidRequest("lora_name", "this engine serves no LoRA adapters (enable_lora)")
    return bank
