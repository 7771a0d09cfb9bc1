"""The vLLM worker's end of vLLM's KV event stream: a ZMQ SUB socket on a local ipc socket.

vLLM's engine core runs in a process of its own; its scheduler publishes each step's KV
cache events as a `KVEventBatch` on a ZMQ PUB socket it binds (`KVEventsConfig`, publisher
"zmq") as frames (topic, 8-byte big-endian sequence number, msgpack batch). The worker
subscribes on a unix socket of its own and drains whatever arrived when it beats (`drain`
never blocks, so nothing polls in between; ZMQ's I/O thread queues the batches).

A gap in the sequence numbers (batches dropped past a high-water mark), or an unreadable
batch, means the worker no longer knows what vLLM holds: the translator then reports
everything removed, as vLLM's own AllBlocksCleared would, and learns the cache again from
the next events.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import msgspec
import zmq
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import KVEventBatch

from services.worker.vllm_kv_events import VllmKVEventTranslator

log = logging.getLogger(__name__)
MAX_BATCHES_QUEUED = 1_000_000  # ZMQ's receive high-water mark: far above a beat's batches


class VllmKVEventSubscriber:
    def __init__(self, translator: VllmKVEventTranslator) -> None:
        self.translator = translator
        self.num_gaps = 0  # times batches went missing and the index was cleared
        self._dir = Path(tempfile.mkdtemp(prefix="splitserve-kv-"))
        self.endpoint = f"ipc://{self._dir / 'events'}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, MAX_BATCHES_QUEUED)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(self.endpoint)  # ZMQ connects once vLLM's publisher binds
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._next_seq = 0  # vLLM numbers its batches from 0

    def events_config(self) -> KVEventsConfig:
        """What vLLM's engine is started with, to publish where this socket listens."""
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint)

    def drain(self) -> None:
        """Apply every batch that arrived since the last drain, without waiting for more."""
        while True:
            try:
                _, seq_bytes, payload = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq != self._next_seq:
                self._lost(f"batches {self._next_seq}..{seq - 1} lost")
            self._next_seq = seq + 1
            try:
                batch = self._decoder.decode(payload)
            except msgspec.DecodeError as exc:
                self._lost(f"batch {seq} unreadable ({exc})")
                continue
            self.translator.apply(batch.events)

    def _lost(self, why: str) -> None:
        self.num_gaps += 1
        log.warning("vLLM KV events: %s; the cache index starts again", why)
        self.translator.clear()

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
