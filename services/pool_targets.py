"""The PoolTarget `splitserve up` follows: of the targets heard on `<ns>.pool.target`, the
newest of each publisher (shared/pool_messages.py).

The subtle rule: a target is a whole state, so only order matters: one whose `seq_no` is
not above the last accepted from its publisher (repeated, or overtaken on the way) is
dropped, and the last accepted, whoever published it, is the one followed.
"""

from __future__ import annotations

from shared.pool_messages import PoolTarget


class TargetBook:
    def __init__(self) -> None:
        self._newest: dict[str, int] = {}  # publisher → the last seq_no accepted from it
        self.current: PoolTarget | None = None  # the target followed; None: none heard yet

    def offer(self, target: PoolTarget) -> bool:
        """Accept `target` unless its publisher already sent a newer (or the same) one."""
        last = self._newest.get(target.publisher)
        if last is not None and target.seq_no <= last:
            return False
        self._newest[target.publisher] = target.seq_no
        self.current = target
        return True
