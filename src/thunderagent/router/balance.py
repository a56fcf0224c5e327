"""Recent traffic per worker: an exponentially decayed sum of what was routed to it (the router adds
the uncached prompt tokens of each request it sends).

Used to place *misses* (requests no worker holds a meaningfully longer prefix of). A miss usually
starts a new conversation or agent program whose later turns will stick to wherever it lands, so
the best predictor of a worker's future load is how much traffic it has been drawing lately, not its
instantaneous queue (which is noisy between turns). Pure: time comes in as ``now``.
"""

from __future__ import annotations

import math


class RecentRequests:
    __slots__ = ("_tau", "_value", "_stamp")

    def __init__(self, half_life: float) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self._tau = half_life / math.log(2)
        self._value: dict[str, float] = {}
        self._stamp: dict[str, float] = {}

    def rate(self, worker_id: str, now: float) -> float:
        v = self._value.get(worker_id)
        if v is None:
            return 0.0
        dt = now - self._stamp[worker_id]
        return v * math.exp(-dt / self._tau) if dt > 0 else v

    def add(self, worker_id: str, now: float, amount: float = 1.0) -> None:
        self._value[worker_id] = self.rate(worker_id, now) + amount
        self._stamp[worker_id] = now

    def forget(self, worker_id: str) -> None:
        self._value.pop(worker_id, None)
        self._stamp.pop(worker_id, None)
