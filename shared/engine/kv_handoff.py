"""The KV hand-off: what crosses from a prefill engine to a decode engine, and `KVHandOff`,
the one owner of the blocks being handed off.

A prefill engine *holds* a request after its first token (its blocks, with their hashes);
a decode engine *reserves* blocks for a prompt. `KVHandOff` pins both kinds: it copies a
held request's blocks out (`export`), checks and copies received blocks into a reservation
(`write`), and keeps the blocks of a request pinned while any copy of them (or a READ by a
transport, `pinned`) is in flight.

The one subtle rule: the engine's thread pins and forgets; any other thread may copy, and
only `unpin` lets go of a request. `unpin(request_id, then)` runs `then` (which asks the
engine's thread to free the blocks) once the last copy in flight is done, so no block is
freed, and handed to another request, while bytes still move in or out of it. Every method
is thread-safe; copies run in the caller's thread, on blocks no running sequence touches.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from shared.engine.errors import InvalidRequest, UnknownRequest
from shared.engine.kv_cache import KVCache


@dataclass(slots=True)
class Reservation:
    block_ids: list[int]  # the decode engine's blocks for the whole prompt, in order
    num_cached_blocks: int  # leading blocks it already holds (prefix cache): not to be sent


@dataclass(slots=True)
class HeldBlocks:
    block_ids: list[int]  # in the engine's cache, in the request's block-table order
    block_hashes: list[int | None]  # chained hash per block; None for a partly filled one


@dataclass(slots=True)
class KVBlocks:
    request_id: str
    layer_start: int
    layer_end: int  # exclusive
    first_block: int  # index in the request's block table of the first block carried
    block_hashes: list[int | None]  # chained hash per block; None for a partly filled block
    data: torch.Tensor  # [layers, blocks, block_size, 2, kv_heads, head_dim]

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


class PinKind(IntEnum):
    HELD = 0  # prefill side: exported, then released
    RESERVED = 1  # decode side: written into, then decoded


@dataclass(slots=True)
class _Pin:
    kind: PinKind
    blocks: HeldBlocks  # reserved: hashes of the prompt's full blocks (None past them)
    copies: int = 0  # in flight
    then: list[Callable[[], None]] = field(default_factory=list)  # once unpinned and copies are 0


class KVHandOff:
    def __init__(self, cache: KVCache) -> None:
        self._cache = cache
        self._lock = threading.Lock()
        self._pins: dict[str, _Pin] = {}

    # -- the engine's thread ------------------------------------------------------------------
    def pin(self, request_id: str, kind: PinKind, blocks: HeldBlocks) -> None:
        with self._lock:
            self._pins[request_id] = _Pin(kind, blocks)

    def forget(self, request_id: str) -> None:
        """The engine ended the request (released, aborted, decoding): no longer pinned."""
        with self._lock:
            self._pins.pop(request_id, None)

    # -- any thread ---------------------------------------------------------------------------
    def layers(self) -> list[torch.Tensor]:
        """The paged cache, one tensor per layer (a transport registers them; never moved)."""
        return self._cache.layers

    def held(self, request_id: str) -> HeldBlocks:
        pin = self._pin(request_id, PinKind.HELD)
        return HeldBlocks(list(pin.blocks.block_ids), list(pin.blocks.block_hashes))

    def reserved(
        self, request_id: str, first_block: int, block_hashes: list[int | None]
    ) -> list[int]:
        """The reserved block ids the offered blocks go to, after `check_offered`."""
        pin = self._pin(request_id, PinKind.RESERVED)
        ids, hashes = pin.blocks.block_ids, pin.blocks.block_hashes
        indices = check_offered(request_id, len(ids), hashes, first_block, block_hashes)
        return ids[indices.start : indices.stop]

    def export(
        self, request_id: str, first_block: int = 0, layers: range | None = None
    ) -> KVBlocks:
        """A CPU copy of a held request's blocks from `first_block` on, for `layers`
        (default: all)."""
        layers = range(self._cache.num_layers) if layers is None else layers
        if layers.start < 0 or layers.stop > self._cache.num_layers:
            raise InvalidRequest("layers", f"layers {layers} outside the model's")
        held = self.held(request_id)
        if not 0 <= first_block <= len(held.block_ids):
            reason = f"block {first_block} outside [0, {len(held.block_ids)}]"
            raise InvalidRequest("first_block", reason)
        with self.pinned(request_id):
            data = self._cache.read_blocks(held.block_ids[first_block:], layers)
        return KVBlocks(
            request_id,
            layers.start,
            layers.stop,
            first_block,
            held.block_hashes[first_block:],
            data,
        )

    def write(self, request_id: str, blocks: KVBlocks) -> None:
        """Write received blocks into the reservation, after checking they belong there
        (InvalidRequest, field `kv`)."""
        block_ids = self.reserved(request_id, blocks.first_block, blocks.block_hashes)
        with self.pinned(request_id):
            self._cache.write_blocks(block_ids, blocks.layers, blocks.data)

    @contextlib.contextmanager
    def pinned(self, request_id: str) -> Iterator[None]:
        """Keep the request's blocks while the body runs, however soon `unpin` comes."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None:
                raise UnknownRequest(f"request {request_id!r} holds no blocks here")
            pin.copies += 1
        try:
            yield
        finally:
            with self._lock:
                pin.copies -= 1
                ready, pin.then = (pin.then, []) if not pin.copies else ([], pin.then)
            for then in ready:
                then()

    def unpin(self, request_id: str, then: Callable[[], None]) -> None:
        """Let go of the request; `then()` runs once no copy of its blocks is in flight (at
        once when none is, else in the thread whose copy ends last)."""
        with self._lock:
            pin = self._pins.pop(request_id, None)
            if pin is not None and pin.copies:
                pin.then.append(then)
                return
        then()

    def _pin(self, request_id: str, kind: PinKind) -> _Pin:
        with self._lock:
            pin = self._pins.get(request_id)
        if pin is None or pin.kind != kind:
            state = kind.name.lower()
            raise UnknownRequest(f"request {request_id!r} holds no {state} blocks here")
        return pin


def check_offered(
    request_id: str,
    num_reserved: int,
    expected_hashes: Sequence[int | None],
    first_block: int,
    block_hashes: list[int | None],
) -> range:
    """The reservation's block indices the offered blocks fill, after checking they fit in
    it and that every full block's hash is the prompt's (InvalidRequest, field `kv`)."""
    end = first_block + len(block_hashes)
    if first_block < 0 or end > num_reserved:
        raise InvalidRequest("kv", f"{request_id}: blocks [{first_block}, {end}) out of range")
    for index, block_hash in enumerate(block_hashes, start=first_block):
        due = expected_hashes[index] if index < len(expected_hashes) else None
        if block_hash is not None and due is not None and block_hash != due:
            reason = f"{request_id}: block {index} hash does not match the prompt"
            raise InvalidRequest("kv", reason)
    return range(first_block, end)
