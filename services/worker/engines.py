"""Which engine a worker runs (`--engine`): its `EngineClient` and one-sided KV transport.

vLLM is imported only for `--engine vllm`, so a native worker never needs it installed.
"""

from __future__ import annotations

from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from services.worker.native_client import NativeEngineClient
from shared.kvtransfer.select import make_transport
from shared.kvtransfer.transfer import TransportFactory


def make_engine(config: WorkerConfig) -> tuple[EngineClient, TransportFactory]:
    if config.engine_kind == "vllm":
        try:
            from services.worker.vllm_client import VllmEngineClient
        except ImportError as exc:
            raise RuntimeError(
                f"--engine vllm needs vLLM in this environment ({exc}): make install ENGINE=vllm"
            ) from exc
        client = VllmEngineClient(config)
        return client, lambda *_: client.transport()
    return NativeEngineClient(config.engine_config(), config.role), make_transport
