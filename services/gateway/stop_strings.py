"""Stop strings: cut the output before the first match, even when a match spans pieces.

Text that could still become a stop string (a suffix that is a prefix of one) is held
back until the next piece decides; `flush` releases it when generation ends otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.buffer = ""  # held back: might be the start of a stop string
        self.matched = ""  # the stop string that matched, once one has

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched); after a match, stop feeding."""
        self.buffer += text
        matches = [i for i in (self.buffer.find(s) for s in self.stop) if i >= 0]
        if matches:
            first = min(matches)
            self.matched = next(s for s in self.stop if self.buffer.find(s) == first)
            out, self.buffer = self.buffer[:first], ""
            return out, True
        keep = self._partial_match_len()
        cut = len(self.buffer) - keep
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out

    def _partial_match_len(self) -> int:
        longest = min(len(self.buffer), max((len(s) - 1 for s in self.stop), default=0))
        for k in range(longest, 0, -1):
            tail = self.buffer[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
