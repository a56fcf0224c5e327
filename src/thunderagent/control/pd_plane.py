"""The live flow's transfers (``control/disagg_flow.py``) on the transfer plane (``transfer/plane.py``).

A plan reserves its transfer's slot and bytes on the plane when it starts (its prefill half first:
the KV is held from the prefill's end until the decode worker has it) and frees them when the decode
worker's first output shows the KV arrived, or when it failed. A plan that finds the plane at its
in-flight cap prefills on its decode worker instead (backpressure, counted ``plane_full``; strict
disaggregation: it waits for room, and nothing is counted until it gives up). A plan's own duration
never teaches its link: the links learn from the moves that landed (``control/link_learning.py``: a
decode worker's own pull, or its server's NIXL metrics).
"""

from __future__ import annotations

from thunderagent.control.link_learning import LinkLearner
from thunderagent.control.metrics import Metrics
from thunderagent.control.registry import WorkerRegistry
from thunderagent.scheduler.disagg import Disaggregator
from thunderagent.types import KvPull, PdPlan

ABORTED = "aborted"


class PlaneObserver:
    def __init__(self, disagg: Disaggregator, metrics: Metrics, registry: WorkerRegistry) -> None:
        self.plane = disagg.plane
        self.strict = disagg.strict
        self.metrics = metrics
        self.registry = registry
        #: the plane's links learn from the plans that landed (and from cache migration's copies on a shared plane)
        self.learner = LinkLearner(self.plane, metrics.pd_links_learned, registry.worker_ids)

    def on_planned(self, plan: PdPlan) -> None:
        """A plan's prefill half is about to start (in a task): count it on its prefill worker at once, or the
        requests routed before that task runs would all see the worker's backlog without it (the scheduler's
        prefill gate let a whole burst through). Its tokens: the ones moved, about what it prefills."""
        self.registry.add_pending(plan.prefill_worker, 1, plan.transfer_tokens)

    def on_transfer_start(self, request_id: str, plan: PdPlan, decode_worker: str, now: float) -> bool:
        plane = self.plane
        if not plane.room(plan.transfer_bytes):
            if not self.strict:  # strict: the plan waits and asks again; nothing fell back
                plane.fallback("plane_full")
            return False
        plane.start(request_id, plan.prefill_worker, decode_worker, plan.transfer_bytes, now)
        self.learner.started(plan.prefill_worker, decode_worker, now)
        self.metrics.pd_inflight.set(len(plane.inflight))
        return True

    def on_transfer_end(self, request_id: str, plan: PdPlan, ok: bool, cause: str, nbytes: int, seconds: float,
                        now: float, pull: KvPull | None = None) -> None:
        plane = self.plane
        if request_id not in plane.inflight:
            return
        t = plane.inflight[request_id]
        plane.finish(request_id, now, ok=ok, cause=cause, learn=False)
        if ok:
            self.learner.landed(t.src, t.dst, now, pull)
            self.metrics.pd_bytes.inc(nbytes)
        elif cause != ABORTED:
            plane.fallback(cause)
        self.metrics.pd_inflight.set(len(plane.inflight))

    def links(self) -> list[dict[str, object]]:
        """The plane's link estimates (``/health``'s ``pd_links``): configured, probed or learned."""
        return self.learner.links()
