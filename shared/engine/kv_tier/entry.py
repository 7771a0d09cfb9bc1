"""One tier entry: a block's KV for every layer, behind a header that names what it is.

Layout of an entry file (little-endian):
    magic b"SSKV" | version u16 | layout length u16 | block hash u64 | payload length u64 |
    CRC-32 of the payload u32 | layout (UTF-8) | zeros to a multiple of 64 bytes | payload
(the payload aligned, so a tensor of any dtype may be made on a buffer the file was read
into, without a copy)
The layout names the model, dtype, block size and the payload's shape, so an entry written
by another model, dtype or cache layout never decodes as this one's; the block hash names
the block, so an entry renamed or copied under another hash is refused too. The checksum
catches damage (a torn or flipped file), not an adversary: no unkeyed checksum does, and
the directory is the engine's own. CRC-32 (zlib) costs a fraction of the blake2b it
replaced, and both hash outside the GIL.

The one subtle rule: `decode_entry` trusts nothing in the file. Every field is compared
with what the reader expects before the payload's checksum is, and a refusal names why
(`Refusal`); the caller recomputes the block.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

MAGIC = b"SSKV"
VERSION = 2  # 1: a blake2b-16 checksum
_HEADER = struct.Struct("<4sHHQQI")
ALIGN = 64  # the payload's offset in the file is a multiple of this

Buffer = bytes | bytearray | memoryview


class Refusal(IntEnum):
    """Why an entry was not loaded (the block is recomputed)."""

    TRUNCATED = 1  # shorter than its header says
    NOT_AN_ENTRY = 2  # wrong magic or version
    FOREIGN = 3  # another model, dtype, block size or layout
    OTHER_BLOCK = 4  # names another block hash than the one asked for
    CHECKSUM = 5  # the payload is not what was written
    UNREADABLE = 6  # the file could not be read


class BadEntry(Exception):
    def __init__(self, refusal: Refusal, detail: str) -> None:
        super().__init__(f"{refusal.name.lower()}: {detail}")
        self.refusal = refusal


@dataclass(frozen=True, slots=True)
class TierLayout:
    """What every entry of one engine's tier holds: one block, every layer."""

    model_id: str
    dtype: str  # torch dtype name: float32, bfloat16, float16
    block_size: int
    shape: tuple[int, ...]  # the payload: [layers, block_size, 2, kv_heads, head_dim]
    element_size: int  # bytes per element

    @property
    def name(self) -> str:
        dims = "x".join(str(n) for n in self.shape)
        return f"model={self.model_id};dtype={self.dtype};block={self.block_size};shape={dims}"

    @property
    def digest(self) -> str:
        """A short name for the layout, safe in a file name."""
        return hashlib.blake2b(self.name.encode(), digest_size=8).hexdigest()

    @property
    def payload_bytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * self.element_size

    @property
    def entry_bytes(self) -> int:
        """The size of one entry's file."""
        return _payload_offset(len(self.name.encode())) + self.payload_bytes


def _payload_offset(name_len: int) -> int:
    head = _HEADER.size + name_len
    return head + (-head) % ALIGN


def checksum(parts: Sequence[Buffer]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def entry_parts(layout: TierLayout, block_hash: int, payload: Sequence[Buffer]) -> list[Buffer]:
    """The entry of one block, as the buffers to write one after another: header and layout
    name, then `payload` (the block's bytes in one or more pieces, e.g. one per layer)."""
    size = sum(len(part) for part in payload)
    assert size == layout.payload_bytes, "a payload is one block of this layout"
    name = layout.name.encode()
    header = _HEADER.pack(MAGIC, VERSION, len(name), block_hash, size, checksum(payload))
    padding = bytes(_payload_offset(len(name)) - len(header) - len(name))
    return [header + name + padding, *payload]


def decode_entry(layout: TierLayout, block_hash: int, data: Buffer) -> memoryview:
    """The payload of `data`, an entry for `block_hash` in `layout` (a view of `data`, not
    a copy); else BadEntry."""
    if len(data) < _HEADER.size:
        raise BadEntry(Refusal.TRUNCATED, f"{len(data)} bytes, no whole header")
    magic, version, name_len, entry_hash, payload_len, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BadEntry(Refusal.NOT_AN_ENTRY, f"magic {magic!r} version {version}")
    name_end = _HEADER.size + name_len
    name = bytes(data[_HEADER.size : name_end]).decode(errors="replace")
    if name != layout.name or payload_len != layout.payload_bytes:
        raise BadEntry(Refusal.FOREIGN, f"written for {name!r}, this tier is {layout.name!r}")
    if entry_hash != block_hash:
        raise BadEntry(Refusal.OTHER_BLOCK, f"holds block {entry_hash:x}, not {block_hash:x}")
    payload = memoryview(data)[_payload_offset(name_len) :]
    if len(payload) != payload_len:
        raise BadEntry(Refusal.TRUNCATED, f"payload of {len(payload)} bytes, not {payload_len}")
    if checksum([payload]) != crc:
        raise BadEntry(Refusal.CHECKSUM, "the payload does not match its checksum")
    return payload
