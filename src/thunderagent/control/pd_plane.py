"""The live flow's transfers (``control/disagg_flow.py``) on the transfer plane (``transfer/plane.py``).

A plan reserves its transfer's slot and bytes on the plane when it starts (its prefill half first:
the KV is held from the prefill's end until the decode worker has it) and frees them when the decode
worker's first output shows the KV arrived, or when it failed. A plan that finds the plane at its
in-flight cap prefills on its decode worker instead (backpressure, counted ``plane_full``; strict
disaggregation: it waits for room, and nothing is counted until it gives up). A plan's own duration
never teaches its link: it includes the prefill itself, so it would teach a wrong bandwidth. What
teaches the links (``TransferPlane.learn``):

- a decode worker that moved the bytes itself (simulated workers, ``execution/kv_bytes.py``) reports its
  pull's own duration;
- a vLLM decode server reports its NIXL connector's reads on its ``/metrics`` (bytes and seconds summed
  over its transfers, and their count: the transfer alone, from its post to its completion), read with
  each load poll. The growth between two readings is one sample for the links into that server from the
  prefill workers whose plans landed there in the last :data:`LANDED_WINDOW_S` (a server's metrics do
  not name the source: with several, each of their links learns the server's mean rate).
"""

from __future__ import annotations

from thunderagent.control.metrics import Metrics
from thunderagent.control.registry import WorkerRegistry
from thunderagent.scheduler.disagg import Disaggregator
from thunderagent.types import KvPull, PdPlan

ABORTED = "aborted"
#: a plan that landed on a decode worker this recently (seconds) counts as a source of its server's next pulls
LANDED_WINDOW_S = 60.0
#: every this many server readings, those of workers that left are dropped
PRUNE_EVERY = 256


class PlaneObserver:
    def __init__(self, disagg: Disaggregator, metrics: Metrics, registry: WorkerRegistry) -> None:
        self.plane = disagg.plane
        self.strict = disagg.strict
        self.metrics = metrics
        self.registry = registry
        self._landed: dict[str, dict[str, float]] = {}  # decode worker -> prefill worker -> when a plan last landed
        self._pulls: dict[str, tuple[float, float, float]] = {}  # decode worker -> its server's pulls at last reading
        self._readings = 0

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
        self.metrics.pd_inflight.set(len(plane.inflight))
        return True

    def on_transfer_end(self, request_id: str, plan: PdPlan, ok: bool, cause: str, nbytes: int, seconds: float,
                        now: float, pull: KvPull | None = None) -> None:
        plane = self.plane
        if request_id not in plane.inflight:
            return
        t = plane.inflight[request_id]
        plane.finish(request_id, now, ok=ok, cause=cause, learn=False)
        if ok and pull is not None and pull.cause == "ok":
            plane.learn(t.src, t.dst, pull.nbytes, pull.seconds)
            self.metrics.pd_links_learned.labels("pull").inc()
        elif ok:  # (a server moved the bytes: its own metrics will say how fast, ``on_server_pulls``)
            self._landed.setdefault(t.dst, {})[t.src] = now
        if ok:
            self.metrics.pd_bytes.inc(nbytes)
        elif cause != ABORTED:
            plane.fallback(cause)
        self.metrics.pd_inflight.set(len(plane.inflight))

    def on_server_pulls(self, dst: str, nbytes: float, seconds: float, transfers: float, now: float) -> None:
        """Decode worker ``dst``'s server read ``nbytes`` of KV in ``transfers`` transfers taking ``seconds`` in all,
        so far (cumulative: its NIXL metrics). What grew since the last reading teaches the links into ``dst`` from
        the prefill workers whose plans landed there within :data:`LANDED_WINDOW_S`; a reading below the last (the
        server restarted) is only the new baseline."""
        last = self._pulls.get(dst)
        self._pulls[dst] = (nbytes, seconds, transfers)
        self._readings += 1
        if self._readings % PRUNE_EVERY == 0:
            self._forget_departed()
        if last is None or nbytes < last[0] or seconds < last[1] or transfers < last[2]:
            return
        db, ds, dn = nbytes - last[0], seconds - last[1], transfers - last[2]
        if dn < 1 or ds <= 0 or db <= 0:
            return
        landed = self._landed.get(dst, {})
        for src in [s for s, t in landed.items() if now - t > LANDED_WINDOW_S]:
            del landed[src]
        for src in landed:
            self.plane.learn(src, dst, int(db), ds, transfers=int(dn))
            self.metrics.pd_links_learned.labels("server").inc()

    def _forget_departed(self) -> None:
        """Readings and landings of workers no longer registered go (one that comes back under its id starts
        again)."""
        here = set(self.registry.worker_ids())
        for w in [w for w in self._pulls if w not in here]:
            del self._pulls[w]
        for w in [w for w in self._landed if w not in here]:
            del self._landed[w]
        for landed in self._landed.values():
            for w in [w for w in landed if w not in here]:
                del landed[w]

    def links(self) -> list[dict[str, object]]:
        """The plane's link estimates (``/health``'s ``pd_links``): configured, probed or learned."""
        return [{"src": src, "dst": dst, "bandwidth_gbps": round(ln.bandwidth_bps * 8 / 1e9, 6),
                 "latency_s": ln.latency_s, "samples": ln.samples} for (src, dst), ln in self.plane.links.items()]
