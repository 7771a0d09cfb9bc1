"""Prefix blocks read from another worker (docs/kv_tier.md): the scheduler's hint, the pin a
reading worker asks of the holder, and the counters its heartbeat carries.

`PeerPrefix` rides on a `PrefillTask` or `DecodeTask` (None: no hint): worker `holder` holds
more of the prompt's leading blocks in its pool than the worker computing it, and `others`
(at most `MAX_HOLDERS` - 1, best first) hold some too: when a read from one fails, the
reader tries the next, within the same deadline. The reader
asks the holder (`PrefixPin` on `<ns>.worker.<holder>.prefix`, request/reply) to pin the
blocks it lacks; the holder answers `PrefixPinned` naming them in its cache and keeps them
until the reader's `PrefixPin` with `op=RELEASE` (published) or `read_by`, whichever comes
first. The one subtle rule: the reader trusts nothing in the answer it did not ask for —
the pin id, the holder's name and epoch, the hashes, the layout and every block id are
checked (shared/kvtransfer/peer_pin.py) before a byte moves, and any doubt means recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from shared.outcome import Outcome

MAX_HOLDERS = 3  # holders one hint names, at most: the first, then `others`


@dataclass(slots=True)
class PeerHolder:
    """Another worker holding blocks [first_block, first_block + num_blocks) of the hint."""

    holder: str
    holder_epoch: int
    num_blocks: int  # at most the hint's own: holders come longest run first


@dataclass(slots=True)
class PeerPrefix:
    holder: str  # the worker id whose pool holds the blocks
    holder_epoch: int  # its process's (shared/epoch.py), as its heartbeat said; 0: not said
    first_block: int  # index in the prompt of the first block it holds that the computer lacks
    num_blocks: int  # blocks [first_block, first_block + num_blocks) of the prompt
    others: list[PeerHolder] = field(default_factory=list)  # tried in turn if a read fails

    def holders(self) -> list[PeerPrefix]:
        """The hint, then one per other holder (with its own run), in the order to try."""
        return [self] + [
            PeerPrefix(o.holder, o.holder_epoch, self.first_block, o.num_blocks)
            for o in self.others
        ]


class PinOp(IntEnum):
    PIN = 0  # pin the blocks for a READ; answered with a PrefixPinned
    RELEASE = 1  # the READ is over (published, no answer): unpin now


@dataclass(slots=True)
class PrefixPin:
    pin_id: str  # the reader's name for this read (its request id); echoed in the answer
    reader: str  # the reading worker's id
    op: PinOp = PinOp.PIN
    block_hashes: list[int] = field(default_factory=list)  # PIN: the blocks wanted, in order
    hold_s: float = 0.0  # PIN: how long at most the holder keeps them pinned
    to_epoch: int = 0  # the holder process the hint named: another process refuses


@dataclass(slots=True)
class PrefixPinned:
    pin_id: str
    outcome: Outcome
    error: str = ""
    holder: str = ""  # the holder's worker id (its agent name)
    epoch: int = 0  # the holder's process epoch
    transport: str = ""  # its one-sided transport ("nixl", "fake")
    agent_metadata: bytes = b""  # what the reader needs to connect to it
    num_cache_blocks: int = 0  # blocks in the holder's cache: every id is below
    layout: list[int] = field(default_factory=list)  # [num_layers, block_size, 2, heads, dim]
    dtype: str = ""
    block_ids: list[int] = field(default_factory=list)  # pinned: the leading run it holds
    block_hashes: list[int] = field(default_factory=list)  # theirs, one per block id
    read_by: float = 0.0  # Unix seconds: the holder unpins then

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK


class PeerFallback(IntEnum):
    """Why a hinted read was not made, or not used: the prompt's blocks are computed."""

    NO_TRANSPORT = 0  # this worker or its engine cannot READ (no one-sided transport)
    NOT_WORTH = 1  # the measured read cost is above the measured recompute cost
    NO_ROOM = 2  # no free blocks to read into
    HOLDER_GONE = 3  # no answer from the holder (dead, lost, timed out)
    PIN_REFUSED = 4  # the holder refused, or holds none of the blocks any more
    BAD_REPLY = 5  # a stale or forged answer: another process, hashes, layout or ids
    READ_FAILED = 6  # the READ failed (its source died mid-read)
    READ_LATE = 7  # the READ passed its deadline


@dataclass(slots=True)
class PeerReadCounters:
    """A worker's reads of prefix blocks from other workers, since it started (cumulative)."""

    blocks: int = 0  # blocks read from peers into its pool
    bytes: int = 0
    seconds: float = 0.0  # pin and READ, end to end
    fallbacks: list[int] = field(default_factory=list)  # per PeerFallback value, its count
    pinned_for_peers: int = 0  # holder side: blocks it pinned for other workers' reads


def by_reason(counters: PeerReadCounters) -> dict[str, int]:
    """The fallbacks counted, by reason name (a value this version does not know is left
    out: a newer worker's)."""
    known = len(PeerFallback)
    return {PeerFallback(i).name.lower(): n for i, n in enumerate(counters.fallbacks) if i < known}
