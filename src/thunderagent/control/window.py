"""Sums over a sliding time window, for the seed metrics' rates (``control/seed_metrics.py``).

Pure and clock-injected. The window is cut into ``buckets`` equal slices in a ring; adding or
reading at ``now`` first clears the slices that fell out of it, so a read covers the last
``window_s`` seconds to within one slice (``window_s / buckets``), with O(buckets) work at most and
no per-observation allocation: each slice keeps one running sum per tracked quantity.
"""

from __future__ import annotations

import math


class WindowSums:
    __slots__ = ("_slice", "_sums", "_current", "width")

    def __init__(self, window_s: float, width: int, buckets: int = 12) -> None:
        if window_s <= 0 or buckets < 1 or width < 1:
            raise ValueError("window_s > 0, buckets >= 1 and width >= 1 are needed")
        self._slice = window_s / buckets
        self.width = width
        self._sums = [[0.0] * width for _ in range(buckets)]
        self._current = -math.inf  # index (in slices since time 0) of the newest slice written

    def _advance(self, now: float) -> list[float]:
        k = math.floor(now / self._slice)
        sums = self._sums
        n = len(sums)
        if k > self._current:
            stale = min(n, k - self._current) if self._current != -math.inf else n
            for j in range(stale):  # the slices between the last write and now hold nothing
                row = sums[(k - j) % n]
                for i in range(self.width):
                    row[i] = 0.0
            self._current = k
        return sums[int(self._current) % n]

    def add(self, now: float, *values: float) -> None:
        """Add ``values`` (one per tracked quantity) at ``now``. A ``now`` older than the newest
        slice (a clock that went back) counts in the newest slice."""
        row = self._advance(now)
        for i, v in enumerate(values):
            row[i] += v

    def totals(self, now: float) -> list[float]:
        """Each quantity's sum over the window ending at ``now``."""
        self._advance(now)
        out = [0.0] * self.width
        for row in self._sums:
            for i in range(self.width):
                out[i] += row[i]
        return out
