"""Stop sequences over streamed text.

Text that might be the beginning of a stop sequence is held back (at most ``longest stop - 1``
characters), so a client never sees part of a stop string that turns out to match.
"""

from __future__ import annotations


class StopMatcher:
    __slots__ = ("stops", "_hold", "_held", "stopped")

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """New text in; the part now safe to emit out. Sets ``stopped`` when a stop matched."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        pending = self._held + text
        first = -1
        for s in self.stops:
            i = pending.find(s)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first != -1:
            self.stopped = True
            self._held = ""
            return pending[:first]
        cut = max(0, len(pending) - self._hold)
        self._held = pending[cut:]
        return pending[:cut]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out
