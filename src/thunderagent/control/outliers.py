"""The fleet's side of slow-worker ejection (``control/breaker.py``): feeds the breakers what its
requests did, filters routing, logs and counts each change, and notes skipped workers in decisions."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

from thunderagent.config import OutlierConfig
from thunderagent.control.breaker import BreakerChange, BreakerState, Breakers
from thunderagent.control.metrics import Metrics
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.execution.handle import WorkerHandle
from thunderagent.types import WorkerState

log = logging.getLogger(__name__)

#: the metric's value per state
_GAUGE = {BreakerState.closed: 0, BreakerState.half_open: 1, BreakerState.open: 2}


class Served(Protocol):
    """What is read of a request that ended normally (``control.fleet.Generation``)."""

    worker: WorkerHandle
    dispatch: Dispatch
    received: float  # fleet time it arrived
    migrations: int


class OutlierWatch:
    def __init__(self, cfg: OutlierConfig, metrics: Metrics) -> None:
        self.breakers = Breakers(cfg)
        self.metrics = metrics
        self._skipped: tuple[tuple[str, str], ...] = ()  # at the last routing filter

    def routable(self, workers: Sequence[WorkerState]) -> Sequence[WorkerState]:
        """``workers`` less those the breakers skip now (remembered for the decision's explanation);
        ``workers`` itself when none is skipped (a FleetView stays whole: the router's fast path)."""
        # Called on every routing decision: with every breaker closed (the usual case) it costs O(1),
        # not a scan of the fleet (that would undo the fleet view's O(log n) routing).
        blocked = self.breakers.blocked
        skipped = tuple((w.worker_id, why) for w in workers if (why := blocked(w.worker_id)) is not None) \
            if self.breakers.out else ()
        self._skipped = skipped
        if not skipped:
            return workers
        out = {wid for wid, _ in skipped}
        return [w for w in workers if w.worker_id not in out]

    def launched(self, d: Dispatch) -> None:
        """A request goes to its worker: counted as a probe on a half-open one; its decision notes
        the workers routing skipped."""
        self.breakers.launched(d.decision.worker_id)
        if self._skipped:
            d.decision = dataclasses.replace(d.decision, skipped=self._skipped)

    def ended(self, worker_id: str, now: float, *, ok: bool, ttft: float | None = None,
              itl: float | None = None) -> None:
        self._report(self.breakers.finished(worker_id, now, ok=ok, ttft=ttft, itl=itl))

    def served(self, gen: Served, first_t: float | None, last_t: float, completion: int) -> None:
        """A request ended normally: its worker's TTFT (from leaving the holding queue; unknown
        after a migration, which restarts on another worker) and mean inter-token latency."""
        ttft = itl = None
        if first_t is not None:
            if gen.migrations == 0:
                ttft = max(0.0, first_t - gen.received - gen.dispatch.queue_wait)
            if completion > 1:
                itl = (last_t - first_t) / (completion - 1)
        self.ended(gen.worker.worker_id, last_t, ok=True, ttft=ttft, itl=itl)

    def tick(self, workers: Sequence[str], now: float) -> None:
        for change in self.breakers.check(workers, now):
            self._report(change)

    def forget(self, worker_id: str) -> None:
        self.breakers.forget(worker_id)
        self.metrics.breaker_state.labels(worker_id).set(0)

    def _report(self, change: BreakerChange | None) -> None:
        if change is None:
            return
        wid = change.worker_id
        self.metrics.breaker_state.labels(wid).set(_GAUGE[change.state])
        if change.state is BreakerState.open:
            self.metrics.ejections.labels(wid).inc()
            log.warning("worker %s ejected from routing: %s", wid, change.reason)
        else:
            log.info("worker %s breaker %s: %s", wid, change.state.value.replace("_", "-"), change.reason)
