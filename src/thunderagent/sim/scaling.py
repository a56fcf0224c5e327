"""The simulator with the scaling planner acting: workers start cold after a start-up delay and
leave drained, on the planner's word (``control/planner.py``, the same object the live fleet runs).

Three ways to size a fleet, on the same trace (``bench/planner_ramp.py`` shows them side by side):

- ``fixed``: ``initial`` workers the whole run;
- ``all``: add-all-at-once: the planner's first +1 starts every worker up to ``max_workers``; its -1
  steps then drain one worker at a time, as in ``step``;
- ``step``: step-wise: each +1 starts one worker, each -1 drains one.

With a ``scheduler`` config, arrivals go through its holding queue (and program pacing) as in ``serve``,
dispatched to the routable workers only; the time a request is held counts in its TTFT.

All ``max_workers`` engines exist from the start (the driver sizes its event state once), but only
routable workers (:attr:`Simulator.routable`) get requests. A worker is **paid** from the moment the
planner asked for it (its start-up included) until it has drained (its last request finished) or
the run ended; a started worker is a fresh engine (empty cache) whose index entries were cleared.

The planner looks every ``planner.interval_s`` of virtual time. The driver has no timer events, so
looks ride on marker arrivals every ``tick_s`` (:data:`TICK`) that :meth:`ScalingSim._dispatch`
turns into a look instead of a request (they are not requests: no track, no result line, no session).
In closed loop (agent programs: each session's next request after its previous one and its think time)
the markers stay open loop, at their times, up to the run's horizon, which such a run needs: when its
last request ends is not known beforehand.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

from thunderagent.config import NodeConfig, PlannerConfig, Policy, RoutingConfig, SchedulerConfig
from thunderagent.control.planner import WORKER_TTFT_BUCKETS, Planner, WorkerSample
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.observe.decision_log import DecisionLog
from thunderagent.sim.driver import SimOutcome, Simulator
from thunderagent.sim.results import Dist
from thunderagent.sim.summary import Track
from thunderagent.sim.traces import TraceRequest

__all__ = ["Mode", "ScalingResult", "ScalingSim", "TICK"]

Mode = Literal["fixed", "all", "step"]
TICK = "\x00tick:"  # request id prefix of the look markers (no trace id starts with a NUL)


@dataclass(slots=True)
class _Worker:
    index: int
    state: str = "off"  # off / starting / up / draining
    paid_from: float = 0.0
    ready_at: float = 0.0
    routed: int = 0
    hits: int = 0
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_hist: list[int] = field(default_factory=lambda: [0] * len(WORKER_TTFT_BUCKETS))  # per bucket, not cumulative


@dataclass(slots=True)
class ScalingResult:
    mode: str
    requests: int
    ttft_ms: Dist
    worker_minutes: float
    hit_rate: float  # requests that ended with cached prompt tokens / requests ended (whole run)
    scale_up_hit_rate: float  # the same, requests that arrived during the scale-up phase
    scale_up_reuse: float  # prompt tokens served from cache / prompt tokens, same requests
    reuse: float  # prompt tokens served from cache / prompt tokens, whole run
    join_hit_rate: float  # the request hit rate of requests arriving in the ``join_window_s`` after a worker joined
    peak_workers: int
    steps: list[tuple[float, int, int]] = field(default_factory=list)  # (time, delta, workers up after)
    reasons: list[tuple[str, ...]] = field(default_factory=list)  # each step's reasons
    duration_s: float = 0.0
    outcome: SimOutcome | None = None


class ScalingSim(Simulator):
    def __init__(self, node: NodeConfig, routing: RoutingConfig, policy: Policy, *, mode: Mode, initial: int,
                 max_workers: int, planner: PlannerConfig | None = None, startup_s: float = 60.0,
                 tick_s: float = 1.0, seed: int = 0, scheduler: SchedulerConfig | None = None,
                 decision_log: DecisionLog | None = None, run_label: str | None = None) -> None:
        if not 1 <= initial <= max_workers:
            raise ValueError(f"need 1 <= initial ({initial}) <= max_workers ({max_workers})")
        if mode != "fixed" and (planner is None or not planner.enabled):
            raise ValueError(f"mode {mode} needs an enabled planner config")
        if startup_s < 0 or tick_s <= 0:
            raise ValueError("startup_s >= 0 and tick_s > 0 are needed")
        # with a scheduler, requests wait in its holding queue (and paced programs by their pacer) and go to
        # the routable workers only; their time held counts in the TTFT the planner reads, as in ``serve``
        super().__init__(node, routing, max_workers, policy, seed=seed, scheduler=scheduler, decision_log=decision_log,
                         run_label=run_label)
        self.mode = mode
        self.planner = Planner(planner) if planner is not None and mode != "fixed" else None
        self.look_every = planner.interval_s if planner is not None else math.inf
        self.startup_s, self.tick_s = startup_s, tick_s
        self.workers = [_Worker(i) for i in range(max_workers)]
        self.routable = []
        for w in self.workers[:initial]:
            w.state = "up"
            self.routable.append(self._states[w.index])
        self._next_look = 0.0
        self._open: list[list[object]] = []  # [track, first counted] of requests not finished at the last look
        self._all: list[Track] = []
        self._paid: list[tuple[float, float]] = []  # (from, to) of workers already off
        self.peak = initial  # most workers paid at once
        self.steps: list[tuple[float, int, int]] = []
        self.reasons: list[tuple[str, ...]] = []
        self.joins: list[float] = []  # when started workers joined routing

    def _dispatch(self, tr: TraceRequest, now: float, tracks: dict[str, Track]) -> int:
        if tr.request_id.startswith(TICK):
            self._look(now)
            return -1  # nothing placed
        i = super()._dispatch(tr, now, tracks)
        track = tracks[tr.request_id]
        self._open.append([track, False])
        self._all.append(track)
        return i

    # -- the planner's look --------------------------------------------------------------------
    def _look(self, now: float) -> None:
        self._harvest()
        for w in self.workers:
            if w.state == "starting" and w.ready_at <= now:
                self._join(w, now)
            elif w.state == "draining":
                ld = self._states[w.index].load
                if ld.running == 0 and ld.waiting == 0:
                    w.state = "off"
                    self._paid.append((w.paid_from, now))
                    self.feed.remove_worker(self.engines[w.index].worker_id)
        if self.planner is None or now < self._next_look:
            return
        self._next_look = now + self.look_every
        self.planner.observe(now, [self._sample(w) for w in self.workers if w.state == "up"])
        rec = self.planner.recommend(now).get("both")
        if rec is None or not rec.fresh:
            return
        if rec.delta > 0:
            off = [w for w in self.workers if w.state == "off"]
            for w in off if self.mode == "all" else off[:1]:
                w.state, w.paid_from, w.ready_at = "starting", now, now + self.startup_s
        elif rec.delta < 0:
            up = [w for w in self.workers if w.state == "up"]
            if len(up) > 1:
                # the least loaded goes (ties: the newest), so the fewest requests finish on a leaver
                loads = self._states
                w = min(reversed(up), key=lambda w: loads[w.index].load.running + loads[w.index].load.waiting)
                w.state = "draining"
                self.routable.remove(self._states[w.index])
        self.steps.append((now, rec.delta, sum(1 for w in self.workers if w.state == "up")))
        self.reasons.append(rec.reasons)
        self.peak = max(self.peak, sum(1 for w in self.workers if w.state != "off"))

    def _join(self, w: _Worker, now: float) -> None:
        """A started worker joins routing cold: a fresh engine, no index entries."""
        old = self.engines[w.index]
        engine = SimulatedEngine(old.worker_id, self.node, preempt=self.preempt, accounting=self.accounts[w.index])
        self.engines[w.index] = engine
        engine.watch_load(self.load_due, w.index)
        self.feed.remove_worker(old.worker_id)
        self.feed.add_worker(old.worker_id, live=True)
        st = self._states[w.index]
        self._states.set_load(w.index, engine.load(now))
        w.state = "up"
        self.joins.append(now)
        w.routed = w.hits = w.ttft_count = 0
        w.ttft_sum = 0.0
        w.ttft_hist = [0] * len(WORKER_TTFT_BUCKETS)
        self.routable.append(st)

    def _sample(self, w: _Worker) -> WorkerSample:
        ld = self._states[w.index].load
        # cumulative, as the live server's Prometheus histogram reads (the same bounds)
        return WorkerSample(self.engines[w.index].worker_id, "both", ld.waiting, ld.running, ld.kv_usage, w.routed,
                            w.hits, w.ttft_count, w.ttft_sum, tuple(zip(WORKER_TTFT_BUCKETS, accumulate(w.ttft_hist))))

    def _harvest(self) -> None:
        """Fold first tokens and finished requests since the last look into their workers' counters."""
        keep = []
        for item in self._open:
            tr: Track = item[0]  # type: ignore[assignment]
            if tr.worker < 0:
                keep.append(item)
                continue
            w = self.workers[tr.worker]
            if not item[1] and tr.first >= 0:
                item[1] = True
                w.ttft_count += 1
                ttft = tr.first - tr.arrival
                w.ttft_sum += ttft
                k = bisect_left(WORKER_TTFT_BUCKETS, ttft)  # the first bound >= it (le); past the last: +Inf only
                if k < len(w.ttft_hist):
                    w.ttft_hist[k] += 1
            if tr.done:
                w.routed += 1
                w.hits += tr.cached > 0
            else:
                keep.append(item)
        self._open = keep

    # -- a whole run ---------------------------------------------------------------------------
    def replay(self, requests: Sequence[TraceRequest], scale_up_end_s: float, speedup: float = 1.0,
               join_window_s: float = 120.0, *, closed_loop: bool = False,
               horizon_s: float | None = None) -> ScalingResult:
        """Run ``requests`` (open loop, arrivals divided by ``speedup``; ``closed_loop``: each session's requests
        one after another, as :meth:`Simulator.run`) with looks every ``tick_s`` until a minute after the last
        arrival, or until ``horizon_s`` (virtual seconds: the run stops there; needed in closed loop);
        ``scale_up_end_s``: the requests arriving before it (virtual seconds) make the scale-up hit rate.
        ``result.extra["scaling"]`` gets the fleet's story."""
        if closed_loop and horizon_s is None:
            raise ValueError("a closed-loop run with the planner needs horizon_s: its looks go on until then")
        end = horizon_s if horizon_s is not None else max((r.arrival_s for r in requests), default=0.0) / speedup + 60

        bs = requests[0].trace_block_size if requests else 64
        ticks = [TraceRequest(f"{TICK}{k}", k * self.tick_s * speedup, 0, 0, [], bs)
                 for k in range(int(end / self.tick_s) + 1)]
        out = self.run([*requests, *ticks], speedup, closed_loop=closed_loop, horizon_s=horizon_s)
        duration = float(out.result.extra["duration_s"])  # type: ignore[arg-type]
        spans = self._paid + [(w.paid_from, math.inf) for w in self.workers if w.state != "off"]
        paid = sum(max(0.0, min(b, duration) - a) for a, b in spans)  # the run ends at its last output
        done = [t for t in self._all if t.done]
        early = [t for t in done if t.arrival < scale_up_end_s]
        joined = [t for t in done if any(j <= t.arrival < j + join_window_s for j in self.joins)]
        out.result.extra["scaling"] = {"mode": self.mode, "worker_minutes": paid / 60.0, "peak_workers": self.peak,
                                       "steps": [list(x) for x in self.steps]}
        return ScalingResult(self.mode, len(done), out.result.ttft_ms, paid / 60.0, _hit(done), _hit(early),
                             _reuse(early), _reuse(done), _hit(joined), self.peak, list(self.steps),
                             list(self.reasons), duration, out)


def _hit(tracks: list[Track]) -> float:
    return sum(1 for t in tracks if t.cached > 0) / len(tracks) if tracks else math.nan


def _reuse(tracks: list[Track]) -> float:
    prompt = sum(t.input_length for t in tracks)
    return sum(t.cached for t in tracks) / prompt if prompt else math.nan
