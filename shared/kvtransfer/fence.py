"""Epoch fencing of a decode worker's KV subject: every `KVReady`, `KVChunk` and `KVDone`
is checked before it reaches a receiver (and so before any READ is posted or byte written).

- `to_epoch` names the decode process whose reservation the transfer was agreed with; a
  message for another process under this worker id (its predecessor, before a restart) is
  refused, naming both epochs.
- `epoch` names the sending process. Offers (`KVReady`) name their agent: the newest epoch
  seen per agent is kept, and an offer from an older process of that agent is refused — so
  a stale offer can never re-`connect` a transport to a dead process's memory. Every later
  message of a transfer must come from the process that sent its first one.
The subtle rule: 0 means "not said" (shared/epoch.py) and is never refused, so a sender
that predates epochs still works; what it says is checked whenever it says it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.errors import InvalidRequest
from shared.epoch import stale
from shared.kvtransfer.transfer import KVMessage
from shared.protocol import KVReady


class StaleEpoch(InvalidRequest):
    """A KV message from or for another process than the one it must be."""


@dataclass(slots=True)
class Fence:
    epoch: int  # this (receiving) process's
    newest: dict[str, int] = field(default_factory=dict)  # agent → newest offering epoch

    def check(self, message: KVMessage, first_epoch: int | None) -> None:
        """Raise StaleEpoch for a message this process must not take; `first_epoch`: the
        sender epoch of the transfer's first message (None: this is its first)."""
        name = type(message).__name__
        if stale(message.to_epoch, self.epoch):
            reason = (
                f"{name} for {message.request_id} is for process epoch {message.to_epoch} of "
                f"this worker; this process is epoch {self.epoch} (it restarted)"
            )
            raise StaleEpoch("to_epoch", reason)
        if first_epoch is not None and stale(message.epoch, first_epoch):
            reason = (
                f"{name} for {message.request_id} comes from process epoch {message.epoch}, "
                f"the transfer from epoch {first_epoch}"
            )
            raise StaleEpoch("epoch", reason)
        if isinstance(message, KVReady) and message.epoch:
            newest = self.newest.get(message.agent, 0)
            if message.epoch < newest:
                reason = (
                    f"stale offer for {message.request_id}: agent {message.agent!r} process "
                    f"epoch {message.epoch} was replaced by epoch {newest}"
                )
                raise StaleEpoch("epoch", reason)
            self.newest[message.agent] = message.epoch
