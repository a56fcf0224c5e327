"""Recent traffic per worker: an exponentially decayed sum of what was routed to it (the router adds
the uncached prompt tokens of each request it sends).

Used to place *misses* (requests no worker holds a meaningfully longer prefix of). A miss usually
starts a new conversation or agent program whose later turns will stick to wherever it lands, so
the best predictor of a worker's future load is how much traffic it has been drawing lately, not its
instantaneous queue (which is noisy between turns). Pure: time comes in as ``now``.

The workers are also kept sorted by rate (``order``), for the router's fleet-view fast path: every
worker decays with the same time constant, so ``rate = exp(log(value) + stamp / tau - now / tau)``
and the order by ``log(value) + stamp / tau`` is the order by rate at *any* ``now``; it changes only
when ``add`` changes one worker's key (O(log n) to find, one ``memmove`` to move).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort


class RecentRequests:
    __slots__ = ("_tau", "_value", "_stamp", "_key", "_order")

    def __init__(self, half_life: float) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self._tau = half_life / math.log(2)
        self._value: dict[str, float] = {}
        self._stamp: dict[str, float] = {}
        self._key: dict[str, tuple[float, str]] = {}  # tracked workers' keys in _order
        self._order: list[tuple[float, str]] = []  # ascending rate (tracked workers only)

    def rate(self, worker_id: str, now: float) -> float:
        v = self._value.get(worker_id)
        if v is None:
            return 0.0
        dt = now - self._stamp[worker_id]
        return v * math.exp(-dt / self._tau) if dt > 0 else v

    def add(self, worker_id: str, now: float, amount: float = 1.0) -> None:
        v = self._value[worker_id] = self.rate(worker_id, now) + amount
        self._stamp[worker_id] = now
        if worker_id in self._key:
            self._move(worker_id, (math.log(v) + now / self._tau, worker_id) if v > 0 else (-math.inf, worker_id))

    def track(self, worker_id: str) -> None:
        """Keep ``worker_id`` in ``order`` (a worker never added has rate 0: it sorts first)."""
        if worker_id in self._key:
            return
        v = self._value.get(worker_id, 0.0)
        key = (math.log(v) + self._stamp[worker_id] / self._tau, worker_id) if v > 0 else (-math.inf, worker_id)
        self._key[worker_id] = key
        insort(self._order, key)

    @property
    def tracked(self) -> list[str]:
        """The workers kept in ``order``."""
        return list(self._key)

    @property
    def order(self) -> list[tuple[float, str]]:
        """(key, worker) of the tracked workers, least recent traffic first. Read only."""
        return self._order

    def _move(self, worker_id: str, key: tuple[float, str]) -> None:
        old = self._key[worker_id]
        if old != key:
            del self._order[bisect_left(self._order, old)]
            insort(self._order, key)
            self._key[worker_id] = key

    def forget(self, worker_id: str) -> None:
        self._value.pop(worker_id, None)
        self._stamp.pop(worker_id, None)
        old = self._key.pop(worker_id, None)
        if old is not None:
            del self._order[bisect_left(self._order, old)]
