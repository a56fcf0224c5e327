"""Slow-worker ejection and circuit breaking: which live workers routing should skip for a while.

Pure and clock-injected (``now`` is passed in). The fleet reports each finished request
(:meth:`Breakers.finished`: its worker, TTFT, mean inter-token latency, ok or error) and each launch
(:meth:`Breakers.launched`), calls :meth:`Breakers.check` on its health tick and leaves out of
routing every worker :meth:`Breakers.blocked` names. Rules (``control_plane.outlier``):

- **closed** (normal) -> **open** (ejected) when the worker is *slow*: its median TTFT or median
  ITL over the window is more than ``factor`` times the median of the other workers' medians (the
  reference: an outlier against the fleet, not against a fixed number, so a loaded fleet that is
  slow everywhere ejects nobody); or when ``failure_threshold`` requests in a row failed on it.
- **open** -> **half-open** after the ejection time (doubled on each consecutive ejection).
- **half-open**: at most ``probe_requests`` requests at a time; the first to finish decides:
  normal -> closed, slow or failed -> open again.

Why medians of medians: one worker's burst of long prompts moves its mean a lot and its median
little, and the reference ignores the judged worker itself so a 3-worker fleet can still tell a
slow one apart. At most ``max_ejected_fraction`` of the fleet is out at once, never all of it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from statistics import median

from thunderagent.config.outlier import OutlierConfig

__all__ = ["BreakerChange", "BreakerState", "Breakers"]


class BreakerState(StrEnum):
    closed = "closed"
    open = "open"
    half_open = "half_open"


@dataclass(slots=True, frozen=True)
class BreakerChange:
    """A worker's breaker moved: to ``state``, for ``reason``."""

    worker_id: str
    state: BreakerState
    reason: str


@dataclass(slots=True)
class _Worker:
    #: finished requests in the window: (finish time, TTFT s, mean ITL s or nan for one token)
    samples: deque[tuple[float, float, float]] = field(default_factory=deque)
    state: BreakerState = BreakerState.closed
    reason: str = ""
    until: float = 0.0  # open: when it turns half-open
    ejections: int = 0  # consecutive ejections (each doubles the next one's length); 0 once closed
    failures: int = 0  # errors in a row
    probes: int = 0  # requests in flight while half-open


@dataclass(slots=True, frozen=True)
class _Medians:
    ttft: float | None
    itl: float | None


class Breakers:
    def __init__(self, cfg: OutlierConfig) -> None:
        self.cfg = cfg
        self._workers: dict[str, _Worker] = {}
        self._fleet = 0  # live workers at the last check (the cap's base)
        #: workers whose breaker is not closed (open or half-open): routing filters only while any is
        self.out: set[str] = set()
        self.ejections_total = 0  # for the metric

    # -- reports -------------------------------------------------------------------------------
    def launched(self, worker_id: str) -> None:
        w = self._workers.get(worker_id)
        if w is not None and w.state is BreakerState.half_open:
            w.probes += 1

    def released(self, worker_id: str) -> None:
        """A request launched on ``worker_id`` ended with no verdict on it (another worker failed it)."""
        w = self._workers.get(worker_id)
        if w is not None and w.state is BreakerState.half_open:
            w.probes = max(0, w.probes - 1)

    def finished(self, worker_id: str, now: float, *, ok: bool, ttft: float | None = None,
                 itl: float | None = None) -> BreakerChange | None:
        """A request on ``worker_id`` ended: ``ok`` (it produced its answer; ``ttft`` and mean
        ``itl`` in seconds, None if unknown) or failed on the worker's side. Returns the breaker's
        change, if this decided one (a probe's verdict, or the failure that opened it)."""
        if not self.cfg.enabled:
            return None
        w = self._workers.setdefault(worker_id, _Worker())
        if ok:
            w.failures = 0
            if ttft is not None:
                w.samples.append((now, ttft, math.nan if itl is None else itl))
        else:
            w.failures += 1
        if w.state is BreakerState.half_open:
            w.probes = max(0, w.probes - 1)
            if not ok:
                return self._eject(worker_id, w, now, "probe failed")
            slow = self._slow(self._reference(worker_id, now), ttft, itl)
            if slow:
                return self._eject(worker_id, w, now, f"probe slow: {slow}")
            w.state, w.reason, w.ejections = BreakerState.closed, "", 0
            self.out.discard(worker_id)
            return BreakerChange(worker_id, BreakerState.closed, "probe normal")
        if w.state is BreakerState.closed and w.failures >= self.cfg.failure_threshold:
            if self._room() > 0:
                return self._eject(worker_id, w, now, f"{w.failures} errors in a row")
        return None

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet: its history goes with it."""
        self._workers.pop(worker_id, None)
        self.out.discard(worker_id)

    # -- periodic ------------------------------------------------------------------------------
    def check(self, workers: Sequence[str], now: float) -> list[BreakerChange]:
        """Expire old samples, turn finished ejections half-open and eject the slowest outliers
        among ``workers`` (the fleet's live ones) within the cap. Returns the changes."""
        if not self.cfg.enabled:
            return []
        changes: list[BreakerChange] = []
        horizon = now - self.cfg.window_s
        for wid in workers:
            w = self._workers.get(wid)
            if w is None:
                continue
            while w.samples and w.samples[0][0] < horizon:
                w.samples.popleft()
            if w.state is BreakerState.open and now >= w.until:
                w.state, w.probes = BreakerState.half_open, 0
                changes.append(BreakerChange(wid, BreakerState.half_open, f"probing after {w.reason}"))
        slow: list[tuple[float, str, str]] = []
        for wid in workers:
            w = self._workers.get(wid)
            if w is None or w.state is not BreakerState.closed:
                continue
            mine = self._medians(w)
            if mine is None:
                continue
            ref = self._reference(wid, now)
            why = self._slow(ref, mine.ttft, mine.itl)
            if why:
                slow.append((self._severity(ref, mine), wid, why))
        self._fleet = len(workers)
        room = self._room()
        for _, wid, why in sorted(slow, reverse=True)[:max(0, room)]:
            changes.append(self._eject(wid, self._workers[wid], now, why))
        return changes

    # -- routing -------------------------------------------------------------------------------
    def blocked(self, worker_id: str) -> str | None:
        """Why routing must skip this worker now (None: it may take a request)."""
        w = self._workers.get(worker_id)
        if w is None or w.state is BreakerState.closed:
            return None
        if w.state is BreakerState.open:
            return f"ejected ({w.reason})"
        if w.probes >= self.cfg.probe_requests:
            return f"half-open: {w.probes} probe(s) in flight"
        return None

    def state(self, worker_id: str) -> BreakerState:
        w = self._workers.get(worker_id)
        return BreakerState.closed if w is None else w.state

    def states(self) -> Iterable[tuple[str, BreakerState, str]]:
        return ((wid, w.state, w.reason) for wid, w in self._workers.items())

    # -- internals -----------------------------------------------------------------------------
    def _eject(self, wid: str, w: _Worker, now: float, why: str) -> BreakerChange:
        length = min(self.cfg.eject_s * 2 ** w.ejections, self.cfg.max_eject_s)
        w.state, w.reason, w.until, w.probes = BreakerState.open, why, now + length, 0
        self.out.add(wid)
        w.ejections += 1
        self.ejections_total += 1
        return BreakerChange(wid, BreakerState.open, f"{why}; out for {length:g}s")

    def _room(self) -> int:
        """Workers that may still be ejected: the cap less those out now."""
        n = max(self._fleet, len(self._workers))
        cap = min(int(self.cfg.max_ejected_fraction * n), n - 1)
        return cap - len(self.out)

    def _medians(self, w: _Worker) -> _Medians | None:
        if len(w.samples) < self.cfg.min_requests:
            return None
        itls = [s[2] for s in w.samples if not math.isnan(s[2])]
        return _Medians(median(s[1] for s in w.samples), median(itls) if itls else None)

    def _reference(self, wid: str, now: float) -> _Medians | None:
        """The median of the other workers' medians (None with fewer than 2 others reporting)."""
        horizon = now - self.cfg.window_s
        ttfts: list[float] = []
        itls: list[float] = []
        for other, w in self._workers.items():
            if other == wid or w.state is not BreakerState.closed:
                continue
            while w.samples and w.samples[0][0] < horizon:
                w.samples.popleft()
            m = self._medians(w)
            if m is None:
                continue
            ttfts.append(m.ttft)  # type: ignore[arg-type]
            if m.itl is not None:
                itls.append(m.itl)
        if len(ttfts) < 2:
            return None
        return _Medians(median(ttfts), median(itls) if len(itls) >= 2 else None)

    def _slow(self, ref: _Medians | None, ttft: float | None, itl: float | None) -> str:
        """Why these latencies are slow against ``ref`` ("" when they are not)."""
        if ref is None:
            return ""
        f = self.cfg.factor
        if ttft is not None and ref.ttft is not None and ttft >= self.cfg.min_ttft_s and ttft > f * ref.ttft:
            return f"TTFT {ttft:.3g}s is {ttft / ref.ttft:.1f}x the fleet's median {ref.ttft:.3g}s"
        if itl is not None and ref.itl is not None and itl >= self.cfg.min_itl_s and itl > f * ref.itl:
            return f"ITL {itl * 1e3:.3g}ms is {itl / ref.itl:.1f}x the fleet's median {ref.itl * 1e3:.3g}ms"
        return ""

    @staticmethod
    def _severity(ref: _Medians | None, mine: _Medians) -> float:
        assert ref is not None
        worst = 0.0
        if mine.ttft is not None and ref.ttft:
            worst = mine.ttft / ref.ttft
        if mine.itl is not None and ref.itl:
            worst = max(worst, mine.itl / ref.itl)
        return worst
