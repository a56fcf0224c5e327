"""Fault injection on a KV-event stream: events dropped, duplicated, reordered and delayed.

A seam for chaos runs and tests (``tests/integration/test_event_chaos.py``,
``tests/unit/test_kv_chaos.py``): it sits where a worker's events (ours, or an engine's frames)
enter the router and decides, per item, what the router receives and when. Pure: the caller passes
``now`` and a seeded ``random.Random``, so a run is reproducible.

- ``drop``: the item is lost;
- ``duplicate``: it is delivered twice (the copy right after it);
- ``reorder``: it is held back and delivered after the next item that passes;
- ``delay``: it is delivered ``delay_s`` x U(0, 1) later (:meth:`EventChaos.due`).

Turning the faults off (``active = False``) stops new faults; items already held back or delayed
are still delivered (a network's in-flight messages do not vanish when it heals).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class ChaosSpec:
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder", "delay"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {p}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")


@dataclass(slots=True)
class ChaosStats:
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    delayed: int = 0


class EventChaos(Generic[T]):
    def __init__(self, spec: ChaosSpec, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self.active = True
        self.stats = ChaosStats()
        self._held: list[T] = []  # reordered: out after the next item that passes
        self._delayed: list[tuple[float, int, T]] = []  # (due, tie-break, item), a heap
        self._n = 0

    def push(self, items: list[T], now: float) -> list[T]:
        """``items`` as a worker sent them at ``now``; returns what the router receives now, in order."""
        out: list[T] = []
        spec, rng, st = self.spec, self.rng, self.stats
        for item in items:
            if not self.active:
                self._pass(item, out)
                continue
            if rng.random() < spec.drop:
                st.dropped += 1
                continue
            if rng.random() < spec.reorder:
                st.reordered += 1
                self._held.append(item)
                continue
            if rng.random() < spec.delay:
                st.delayed += 1
                self._n += 1
                heapq.heappush(self._delayed, (now + spec.delay_s * rng.random(), self._n, item))
                continue
            self._pass(item, out)
            if rng.random() < spec.duplicate:
                st.duplicated += 1
                out.append(item)
        if not self.active and self._held:  # healed: nothing more to wait behind
            out.extend(self._held)
            self._held = []
        return out + self.due(now)

    def due(self, now: float) -> list[T]:
        """Delayed items whose time has come (the caller polls, e.g. every heartbeat)."""
        out: list[T] = []
        while self._delayed and self._delayed[0][0] <= now:
            out.append(heapq.heappop(self._delayed)[2])
        return out

    def pending(self) -> int:
        """Items held back or delayed, not delivered yet."""
        return len(self._held) + len(self._delayed)

    def _pass(self, item: T, out: list[T]) -> None:
        out.append(item)
        if self._held:  # items held back go right after the one that overtook them
            out.extend(self._held)
            self._held = []
