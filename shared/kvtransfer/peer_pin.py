"""What a reading worker checks of a holder's `PrefixPinned` before it READs a byte: that the
answer is to its own question, from the process the hint named, about the blocks it asked
for, in its own cache layout (shared/prefix_messages.py says who asks what).

The one subtle rule: the answer may pin fewer blocks than asked (the holder evicted the
tail meanwhile), but only a leading run, hash for hash — anything else is refused whole.
"""

from __future__ import annotations

import time

from shared.epoch import stale
from shared.kvtransfer.chunks import KVLayout
from shared.prefix_messages import PeerFallback, PeerPrefix, PrefixPinned


class PinRefused(Exception):
    """The pin is not to be read: `reason` is the fallback counted, the message says why."""

    def __init__(self, reason: PeerFallback, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def check_pinned(
    reply: PrefixPinned,
    pin_id: str,
    hint: PeerPrefix,
    asked: list[int],
    layout: KVLayout,
    transport: str,
) -> int:
    """How many of the `asked` blocks the reply pins, from the first; PinRefused otherwise."""
    if reply.pin_id != pin_id:
        raise PinRefused(PeerFallback.BAD_REPLY, f"an answer for pin {reply.pin_id!r}")
    if not reply.ok:
        raise PinRefused(PeerFallback.PIN_REFUSED, reply.error or reply.outcome.name.lower())
    if reply.holder != hint.holder:
        raise PinRefused(PeerFallback.BAD_REPLY, f"answered by {reply.holder!r}, not the holder")
    if stale(reply.epoch, hint.holder_epoch) or (hint.holder_epoch and not reply.epoch):
        detail = f"holder process epoch {reply.epoch}, the hint named {hint.holder_epoch}"
        raise PinRefused(PeerFallback.BAD_REPLY, detail)
    if reply.transport != transport:
        raise PinRefused(
            PeerFallback.BAD_REPLY, f"transport {reply.transport!r}, not {transport!r}"
        )
    expected = [layout.num_layers, *layout.block_shape]
    if reply.layout != expected or reply.dtype != layout.dtype:
        detail = f"layout {reply.layout} {reply.dtype}, this worker's {expected} {layout.dtype}"
        raise PinRefused(PeerFallback.BAD_REPLY, detail)
    count = len(reply.block_ids)
    if not 0 < count <= len(asked) or reply.block_hashes != asked[:count]:
        raise PinRefused(PeerFallback.BAD_REPLY, "pinned blocks are not the ones asked for")
    if any(not 0 <= b < reply.num_cache_blocks for b in reply.block_ids):
        raise PinRefused(PeerFallback.BAD_REPLY, f"ids outside [0, {reply.num_cache_blocks})")
    if len(set(reply.block_ids)) != count:
        raise PinRefused(PeerFallback.BAD_REPLY, "a block id appears twice")
    if reply.read_by <= time.time():
        raise PinRefused(PeerFallback.READ_LATE, "the pin has expired already")
    return count
