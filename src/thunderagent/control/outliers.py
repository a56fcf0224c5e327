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
from thunderagent.router.candidates import FleetView
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

    def skipping(self, workers: Sequence[WorkerState]) -> frozenset[str]:
        """The workers of ``workers`` the breakers skip now (remembered, with why, for the decision's
        explanation). Called on every routing decision: it reads the breakers that are not closed
        (none, usually), never the whole fleet."""
        blocked = self.breakers.blocked
        skipped = [(wid, why) for wid in self.breakers.out if (why := blocked(wid)) is not None]
        if skipped:
            if isinstance(workers, FleetView):
                order = {wid: workers.position(wid) for wid, _ in skipped}
            else:
                pos = {w.worker_id: i for i, w in enumerate(workers)}
                order = {wid: pos.get(wid) for wid, _ in skipped}
            skipped = sorted((s for s in skipped if order[s[0]] is not None), key=lambda s: order[s[0]])
        self._skipped = tuple(skipped)
        return frozenset(wid for wid, _ in skipped)

    def launched(self, d: Dispatch) -> None:
        """A request goes to its worker: counted as a probe on a half-open one; its decision notes
        the workers routing skipped."""
        self.breakers.launched(d.decision.worker_id)
        if self._skipped:
            d.decision = dataclasses.replace(d.decision, skipped=self._skipped)

    def failed(self, handle: WorkerHandle, now: float) -> None:
        """A request ended on ``handle``'s side without an answer. A disaggregated attempt that a
        strict flow ended for its prefill worker's failure (``PdAttempt.blamed``) charges that worker,
        and its decode worker gets no verdict (a half-open one's probe is given back)."""
        worker_id = handle.worker_id
        blamed = getattr(handle, "blamed", worker_id)
        if blamed != worker_id:
            self.breakers.released(worker_id)
        self.ended(blamed, now, ok=False)

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
        """The worker left the fleet (``Fleet.leave``): kept, its breaker would count in the ejection cap's
        base for good, letting a churned fleet eject more of its live workers than ``max_ejected_fraction``."""
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
