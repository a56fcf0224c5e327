"""Discrete-event simulator: the server's router, index and simulated engines on a virtual clock.

Nothing here re-implements a policy or an engine: the :class:`KvRouter`, :class:`KvIndex` and
:class:`SimulatedEngine` objects are the ones ``thunderagent serve`` runs; this module only decides
*when* to call them. Events are request arrivals (trace time / speedup) and engine pass ends
(``Engine.next_wakeup``). KV events reach the index synchronously at pass end, as in Dynamo's
offline replay.

Ordering rules (the engine's contract): at an instant ``t``, arrivals are processed before the pass
that starts at ``t`` is fixed, so an arrival exactly at a pass boundary joins that pass. This holds
in closed loop too: a request issued at the very instant its predecessor finished (zero think time)
joins the passes starting then.

Arrivals come from an arrival source (:mod:`thunderagent.sim.arrivals`): open loop (trace times,
the default) or closed loop (``run(..., closed_loop=True)``: a session's next request is issued once
the previous one finished, plus its think time).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from thunderagent.config import DisaggConfig, KvTransferConfig, NodeConfig, Policy, Role, RoutingConfig, SchedulerConfig
from thunderagent.engine.accounting import TokenAccounting
from thunderagent.engine.preemption import knobs_from
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.engine.timing import make_timing
from thunderagent.kv.feed import KvFeed
from thunderagent.kv.index import KvIndex
from thunderagent.observe.decision_log import DecisionLog
from thunderagent.router.autotune import WeightTuner, feed
from thunderagent.router.errors import HeldRefused
from thunderagent.router.router import KvRouter, NoWorkerAvailable
from thunderagent.scheduler.disagg import Disaggregator
from thunderagent.scheduler.dispatch import Dispatch, Dispatcher
from thunderagent.sim.arrivals import ClosedLoop, OpenLoop, session_stats
from thunderagent.sim.migrate import sim_migration
from thunderagent.sim.pd import PdFaults, PdSim
from thunderagent.sim.replay_config import replay_routing
from thunderagent.sim.results import Dist, RunResult
from thunderagent.sim.summary import Track, summarize
from thunderagent.sim.traces import TraceRequest
from thunderagent.router.candidates import FleetView
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import WorkerState


@dataclass(slots=True, frozen=True)
class PdSetup:
    """A disaggregated fleet: ``prefill`` prefill workers then ``decode`` decode workers, of the
    simulator's node shape (the prefill workers of ``prefill_node``'s when given: a group's own batch
    limits)."""

    prefill: int
    decode: int
    disagg: DisaggConfig
    transfer: KvTransferConfig
    faults: PdFaults = PdFaults()
    prefill_node: NodeConfig | None = None


@dataclass(slots=True)
class SimOutcome:
    """A run's summary plus the raw series the plots need."""

    result: RunResult
    ttft_ms: list[float]
    load_times: list[float] = field(default_factory=list)  # virtual seconds
    load_samples: list[list[int]] = field(default_factory=list)  # per sample: running+waiting per worker
    requests_per_worker: list[int] = field(default_factory=list)
    ttft_by_id: dict[str, float] = field(default_factory=dict)  # ms, per request id
    #: per request id: (arrival, finish) in virtual seconds; finish -1.0 if it never finished
    times_by_id: dict[str, tuple[float, float]] = field(default_factory=dict)


class _Run:
    """One replay's mutable state: per-request tracks, the engines' wake-up heap, load samples."""

    __slots__ = ("sim", "out", "src", "tracks", "heap", "wake", "next_sample", "last")

    def __init__(self, sim: Simulator, out: SimOutcome, src: OpenLoop | ClosedLoop) -> None:
        self.sim = sim
        self.out = out
        self.src = src
        self.tracks: dict[str, Track] = {}
        self.heap: list[tuple[float, int]] = []
        self.wake: list[float | None] = [None] * len(sim.engines)
        self.next_sample = 0.0
        self.last = 0.0  # the latest instant processed (virtual seconds)

    def collect(self, i: int, now: float) -> None:
        """Engine ``i``'s outputs up to ``now`` into the tracks; its KV events into the index. The
        engines run in accounting mode: outputs are first tokens and finishes, the tokens between
        them and their latencies are counted by the engine (``engine/accounting.py``)."""
        tracks, pd = self.tracks, self.sim.pd
        finals = self.sim.accounts[i].finals
        for o in self.sim.engines[i].advance(now):
            if pd is not None and o.request_id in pd.jobs:  # a prefill job (sim/pd.py): not a client's request
                finals.pop(o.request_id, None)
                pd.job_output(o, now)
                continue
            tr = tracks[o.request_id]
            if o.token_ids and tr.first < 0:
                tr.first = tr.last = o.time
                tr.tokens = 1
                self.sim.dispatcher.first_token(o.time - tr.arrival - tr.queue_wait)  # as the live fleet does
                self.sim.dispatcher.progressed(o.request_id, ok=True)  # a leader's followers go
            if o.finished:
                if tr.first < 0:  # ended without a token (rejected): its followers go on their own
                    self.sim.dispatcher.progressed(o.request_id, ok=False)
                fin = finals.pop(o.request_id, None)
                if fin is not None and fin[0]:
                    tr.tokens, tr.last = fin
                tr.done = True
                tr.cached = o.cached_tokens
                tr.end = o.time
                if self.sim.tuner is not None and tr.first >= 0:  # routing.autotune: the tuner learns from it
                    feed(self.sim.tuner, self.sim.dispatcher.router, tr.arrival, tr.first - tr.arrival,
                         tr.input_length, tr.cached, tr.best_known, o.time)
                if tr.program is not None:
                    self.sim.dispatcher.finished(tr.program, tr.input_length + tr.tokens, o.time, completed=True)
                self.src.finished(o.request_id, o.time, now)
        self.sim.apply_events(i, now)
        if pd is not None and pd.touched:  # requests a prefill job's end sent to decode engines
            self.land(pd.take_touched(), now)

    def land(self, engines: list[int], now: float) -> None:
        for j in engines:
            self.schedule(j)
            self.sim._states.set_load(j, self.sim.engines[j].load(now))

    def schedule(self, i: int) -> None:
        w = self.sim.engines[i].next_wakeup()
        if w is not None and w != self.wake[i]:
            heapq.heappush(self.heap, (w, i))
        self.wake[i] = w

    def passes_ending_at(self, now: float) -> list[int]:
        """Collect the passes ending exactly at ``now``: their tokens and KV events first (the index
        must see them before routing), but their successors are fixed only after the arrivals joined."""
        heap, wake, sim = self.heap, self.wake, self.sim
        due: list[int] = []
        while heap and heap[0][0] == now:
            tw, i = heapq.heappop(heap)
            if wake[i] == tw:
                wake[i] = None
                self.collect(i, now)
                sim._states.set_load(i, sim.engines[i].load(now))
                due.append(i)
        return due

    def refresh_loads(self, now: float) -> None:
        """Every engine's load as of ``now``, before anything reads the fleet's state: an engine
        in a plain decode stretch is not woken at each pass end (engine/stretch.py), so the report
        taken at its last wake-up may be behind. ``load(now)`` runs the passes ending by ``now``
        (none of them has an output) and gives what the per-pass refresh gave. Only engines whose
        report may have changed are refreshed: each engine pushes onto ``Simulator.load_due`` when
        that can happen next (its pass's end, or at once when something else touched it:
        ``SimulatedEngine.watch_load``). With a large fleet most engines sit in a pass that outlasts
        many arrivals; scanning them all cost O(fleet) per arrival."""
        sim = self.sim
        states, engines, due = sim._states, sim.engines, sim.load_due
        t = round(now * 1e9)  # the engines' clock (ns)
        while due and due[0][0] <= t:
            i = heapq.heappop(due)[1]
            e = engines[i]
            if not e.load_unchanged(now):  # (else a stale entry: reported since)
                states.set_load(i, e.load(now))  # the view re-sorts only a worker whose load changed

    def sample(self, now: float) -> None:
        if now >= self.next_sample:
            self.out.load_times.append(now)
            self.out.load_samples.append([s.load.running + s.load.waiting for s in self.sim._states])
            self.next_sample = now + self.sim.sample_interval


class Simulator:
    def __init__(
        self,
        node: NodeConfig,
        routing: RoutingConfig,
        num_workers: int,
        policy: Policy,
        *,
        seed: int = 0,
        sample_interval: float = 1.0,
        scheduler: SchedulerConfig | None = None,
        decision_log: DecisionLog | None = None,
        run_label: str | None = None,
        pd: PdSetup | None = None,
    ) -> None:
        """``decision_log``: every decision placed is written there (virtual time), its lines
        tagged ``run: run_label``; the caller closes it. ``routing``'s double-hash guard runs only when
        it sets ``double_hash`` itself (:func:`~thunderagent.sim.replay_config.replay_routing`)."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        routing = replay_routing(routing)
        self.node = node
        self.policy = policy
        self.preempt = knobs_from(routing)
        if pd is not None:
            num_workers = pd.prefill + pd.decode
        nodes = [node] * num_workers
        if pd is not None and pd.prefill_node is not None:
            nodes[:pd.prefill] = [pd.prefill_node] * pd.prefill
        self.accounts = [TokenAccounting() for _ in range(num_workers)]
        self.engines = [SimulatedEngine(f"worker-{i}", n, preempt=self.preempt, accounting=a)
                        for i, (n, a) in enumerate(zip(nodes, self.accounts))]
        roles = [Role.both.value] * num_workers if pd is None else \
            [Role.prefill.value] * pd.prefill + [Role.decode.value] * pd.decode
        self.index = KvIndex(prediction_ttl=routing.prediction_ttl, double_hash=routing.double_hash)
        self.feed = KvFeed(self.index)
        for e in self.engines:
            self.feed.add_worker(e.worker_id, live=True)
        if scheduler is not None:  # a replay refuses nothing: only the count bounds act (as before the time bound)
            scheduler = scheduler.model_copy(update={"max_queue_delay_s": None, "admit_ttft_factor": None})
        strict = not routing.fallback_to_local  # strict disaggregation: a decode worker never prefills
        if strict and (pd is None or pd.disagg.mode != "always"):
            raise ValueError("routing.fallback_to_local: false (strict disaggregation) needs prefill/decode workers "
                             "(--pd P:D) in mode always")
        disagg = None if pd is None else Disaggregator(pd.disagg, TransferPlane(pd.transfer), make_timing(node.timing),
                                                       node.block_size, strict=strict)
        self.dispatcher = Dispatcher(KvRouter(routing, self.index, random.Random(seed), policy), node.block_size,
                                     scheduler, disagg)
        # a maintained view (router/candidates.py): every load change below goes through set_load
        self._states = FleetView(routing, (
            WorkerState(e.worker_id, node.block_size, nodes[i].max_num_batched_tokens, nodes[i].queue_depth_threshold,
                        e.load(0.0), roles[i], nodes[i].max_batch_size, *nodes[i].sequence_limits())
            for i, e in enumerate(self.engines)
        ))
        self._pos = {e.worker_id: i for i, e in enumerate(self.engines)}
        #: the workers routing sees (all by default; ``sim/scaling.py`` starts and drains engines by editing it)
        self.routable: list[WorkerState] = self._states
        self.pd = None if disagg is None or pd is None else PdSim(self.engines, self._pos, disagg, pd.faults)
        #: requests the router refused (strict disaggregation without room or a prefill worker; fallback
        #: reject with every worker busy): they end at once without a token, as a 503 does live
        self.refused = 0
        self._run: _Run | None = None
        self._tried: dict[str, tuple[str, ...]] = {}  # strict: the workers each rerouted request was blamed on
        if self.pd is not None:
            self.pd.reroute = self._reroute
        for e in self.engines:  # transfers move on the virtual clock: blocks stay pinned until PdSim ends them
            e.pin_transfers = self.pd is not None
        self.mig = sim_migration(routing, node, self.engines, self._pos, self.index, self.pd, self.apply_events,
                                 1.0 if pd is None else pd.faults.slow_link, policy)
        self.sample_interval = sample_interval
        self.load_due: list[tuple[int, int]] = []  # (ns, engine): its report may be out of date from then on
        for i, e in enumerate(self.engines):
            e.watch_load(self.load_due, i)  # (``_Run.refresh_loads``)
        self.resyncs = 0
        self.kv_event_blocks = 0  # blocks of the KV events the index took (stored + removed)
        self._decision_ns: list[int] = []  # wall time of each routing decision of the current run
        self.decision_log = decision_log
        self.run_label = run_label
        self.tuner = WeightTuner(routing.autotune, routing.weights) if routing.autotune.enabled else None

    def run(
        self,
        requests: Sequence[TraceRequest],
        speedup: float = 1.0,
        progress: Callable[[int], None] | None = None,
        *,
        closed_loop: bool = False,
        horizon_s: float | None = None,
    ) -> SimOutcome:
        """Replay ``requests``: open loop (each at ``arrival_s / speedup``) or, with ``closed_loop``,
        each session's requests one after another (:class:`~thunderagent.sim.arrivals.ClosedLoop`);
        a closed-loop run adds the figures of :func:`~thunderagent.sim.arrivals.session_stats` and
        ``unissued_requests`` to ``result.extra``. With ``horizon_s`` the run stops at that virtual
        time: what finished by then counts, and the closed-loop rates are per the horizon."""
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        if horizon_s is not None and horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        wall0 = time.perf_counter()
        for a in self.accounts:  # a second run counts afresh
            a.itl.clear()
            a.finals.clear()
        self._decision_ns = []
        self.kv_event_blocks = 0
        self.refused = 0
        self._tried.clear()
        src = ClosedLoop(requests, speedup) if closed_loop else OpenLoop(requests, speedup)
        run = _Run(self, SimOutcome(RunResult("thunderagent", self.policy.value, 0, *([Dist.of([])] * 3), 0, 0, 0, 0),
                                    []), src)
        self._run = run
        self._replay(run, progress, math.inf if horizon_s is None else horizon_s)
        self._run = None
        out = run.out
        out.result = summarize(self, run.tracks, time.perf_counter() - wall0, self._decision_ns)
        out.ttft_by_id = {rid: (t.first - t.arrival) * 1e3 for rid, t in run.tracks.items() if t.first >= 0}
        out.ttft_ms = list(out.ttft_by_id.values())
        out.times_by_id = {rid: (t.arrival, t.end) for rid, t in run.tracks.items()}
        counts = [0] * len(self.engines)
        for t in run.tracks.values():
            if t.worker >= 0:
                counts[t.worker] += 1
        out.requests_per_worker = counts
        if horizon_s is not None:
            out.result.extra["horizon_s"] = horizon_s
        if closed_loop:
            extra = out.result.extra
            span = horizon_s if horizon_s is not None else float(extra["duration_s"])  # type: ignore[arg-type]
            extra.update(session_stats(requests, out.times_by_id, span))
            extra["unissued_requests"] = src.unissued
        return out

    def _replay(self, run: _Run, progress: Callable[[int], None] | None, horizon: float) -> None:
        """The event loop: engine pass ends and arrivals, in time order, up to ``horizon``."""
        engines, states, heap, wake, src = self.engines, self._states, run.heap, run.wake, run.src
        held: list[int] = []  # engines whose pass ended at an instant a closed-loop request arrives
        # An engine's report is refreshed when it is woken, scheduled or given a request, and every
        # engine's before the fleet's state is read (``refresh_loads``): an engine in a plain decode
        # stretch is woken only at its end, and its load grows meanwhile.
        dispatcher = self.dispatcher
        pumping = dispatcher.queue is not None or dispatcher.pacer is not None or dispatcher.grouper is not None
        pd, mg = self.pd, self.mig
        while True:
            ta = src.t
            tick = dispatcher.next_wakeup()
            tx = pd.next_time() if pd is not None else math.inf
            tm = mg.next_time() if mg is not None else math.inf  # cache migrations' copies ending
            if ta == tm == math.inf and not heap and tx == math.inf and (tick == math.inf or not dispatcher.held()):
                break  # (requests the holding queue alone still holds stay: ``held_at_end``)
            if min(ta, heap[0][0] if heap else math.inf, tick, tx, tm) > horizon:
                break
            if mg is not None and tm <= min(ta, tick, tx) and (not heap or tm <= heap[0][0]):
                now = run.last = max(tm, run.last)  # copies land (after that instant's pass ends)
                run.land(run.passes_ending_at(now) + mg.step(now, self.routable, look=False), now)
                continue
            if pd is not None and tx <= ta and tx <= tick and (not heap or tx <= heap[0][0]):
                # transfers ending: their requests reach the decode engines (after that instant's pass ends)
                now = run.last = max(tx, run.last)
                run.land(run.passes_ending_at(now) + pd.complete(now), now)
                if pumping:
                    run.land(self._pump(now, run.tracks), now)
                continue
            if tick < ta and (not heap or tick < heap[0][0]):
                # a tick with nothing else due before it (pacing; grouping's windows and waiting
                # bounds): the requests it releases go now
                tt = max(tick, run.last)
                run.refresh_loads(tt)
                if dispatcher.tick(self.routable, tt):
                    for j in self._pump(tt, run.tracks):
                        run.schedule(j)
                continue
            if heap and heap[0][0] < ta:
                tw, i = heapq.heappop(heap)
                if wake[i] != tw:
                    continue  # superseded entry
                wake[i] = None
                run.collect(i, tw)
                if src.t == tw:  # closed loop, a successor issued right now: it joins the next pass
                    states.set_load(i, engines[i].load(tw))
                    held.append(i)
                    continue
                run.schedule(i)
                states.set_load(i, engines[i].load(tw))
                run.last = tw
                if pumping:
                    run.refresh_loads(tw)
                    for j in self._pump(tw, run.tracks):
                        run.schedule(j)
                continue
            now = run.last = ta
            due = run.passes_ending_at(now)
            if held:
                due += held
                held.clear()
            run.refresh_loads(now)
            run.sample(now)
            if mg is not None:  # the migrator looks at arrivals (at most every interval_s)
                due += mg.step(now, self.routable, look=True)
            while src.t == now:
                i = self._dispatch(src.pop(), now, run.tracks)
                if i >= 0:
                    due.append(i)
                if progress is not None:
                    progress(1)
            if pumping:
                due.extend(self._pump(now, run.tracks))
            self.dispatcher.settle(now)
            for i in due:
                run.schedule(i)
                states.set_load(i, engines[i].load(now))

    def apply_events(self, i: int, now: float) -> None:
        """KV events of engine ``i`` into the index, as the live fleet applies them: a gap resyncs
        the worker from its cache snapshot (the simulated engine can always dump)."""
        e = self.engines[i]
        events = e.drain_events()
        for ev in events:
            self.kv_event_blocks += len(getattr(ev, "block_hashes", ()))
        if events and self.feed.events(e.worker_id, events, now):
            self.resyncs += 1
            self.feed.begin_sync(e.worker_id)
            self.feed.apply_dump(e.worker_id, e.cache_snapshot(), events[-1].seq, now, e.cache_checks())
        if events:
            self.dispatcher.kv_stored(e.worker_id)  # followers whose prefix is now stored there go

    def _dispatch(self, tr: TraceRequest, now: float, tracks: dict[str, Track]) -> int:
        """An arrival: routed and placed now (its engine's index), or held in the scheduler (-1)."""
        dispatcher = self.dispatcher
        tokens = tr.tokens()  # the synthetic prompt: made here, not part of the decision's time
        program = tr.session if dispatcher.pacer is not None else None
        tracks[tr.request_id] = Track(now, tr.input_length, 0, -1, tr.priority, program=program)
        t0 = time.perf_counter_ns()
        req = dispatcher.prepare(tr.request_id, tokens, tr.output_length, ignore_eos=True,  # type: ignore[arg-type]
                                 priority=tr.priority, arrival=now)
        try:
            d = dispatcher.submit(req, tr.session or "", self.routable, now, program=program)
        except NoWorkerAvailable:  # (submit already ended the program's step)
            self._refuse(tr.request_id, now)
            return -1
        finally:
            self._decision_ns.append(time.perf_counter_ns() - t0)
        return -1 if d is None else self._place(d, now, tracks)

    def _refuse(self, request_id: str, now: float) -> None:
        """The router refused the request: it ends now without a token (a closed-loop session goes on)."""
        assert self._run is not None
        tr = self._run.tracks[request_id]
        tr.done, tr.end = True, now
        self.refused += 1
        self._run.src.finished(request_id, now, now)

    def _reroute(self, first: Dispatch, blamed: str, now: float) -> int:
        """Strict disaggregation (``sim/pd.py``): a failed prefill or transfer routed again without the worker at
        fault, as the live fleet does (``control/migration.route_again``: the blocks predicted on the first
        decode worker are retracted, they never arrived; every worker blamed so far is left out, so a request
        is routed again at most once per worker). The engine given work, or -1 when refused."""
        assert self._run is not None
        self.dispatcher.retract(first)
        req = first.request
        tried = self._tried[req.request_id] = (*self._tried.get(req.request_id, ()), blamed)
        try:
            d = self.dispatcher.dispatch(req, self.routable, now, exclude=tried)
        except NoWorkerAvailable:
            tr = self._run.tracks[req.request_id]
            self.dispatcher.progressed(req.request_id, ok=False)  # a leader's followers go on their own
            if tr.program is not None:
                self.dispatcher.finished(tr.program, tr.input_length, now, completed=False)
            self._refuse(req.request_id, now)
            return -1
        return self._place(d, now, self._run.tracks)

    def _pump(self, now: float, tracks: dict[str, Track]) -> list[int]:
        """Held requests that can go now, placed one at a time (each placement updates its engine's
        load before the next decision, as in the live fleet). Returns the engines given work."""
        placed = []
        while True:
            t0 = time.perf_counter_ns()
            try:
                d = self.dispatcher.pump(self.routable, now)
            except HeldRefused as e:  # it could not go for good, or after max_wait_s: refused, as live (503)
                self._refuse(e.request_id, now)
                continue
            except NoWorkerAvailable:  # strict, no room yet: it stays first in line, as live
                return placed
            if d is None:
                return placed
            self._decision_ns.append(time.perf_counter_ns() - t0)
            i = self._place(d, now, tracks)
            tracks[d.request.request_id].queue_wait = d.queue_wait
            placed.append(i)

    def _place(self, d: Dispatch, now: float, tracks: dict[str, Track]) -> int:
        i = self._pos[d.decision.worker_id]
        tr = tracks[d.request.request_id]
        tr.worker, tr.best_known = i, d.best_known_tokens
        if self.mig is not None:  # demand for the request's known prefix
            self.mig.migrator.observe(d.request.block_hashes, d.decision.best_overlap_blocks, now,
                                         d.request.check_hashes)
        if self.decision_log is not None:
            self.decision_log.record(d, now, program=tr.program, run=self.run_label)
        if d.pd is not None and self.pd is not None:  # prefill elsewhere first; decoded on i once the KV moved
            j = self.pd.place(d, now)
            self._states.set_load(j, self.engines[j].load(now))
            return j
        self.engines[i].add_request(d.request, now)
        self._states.set_load(i, self.engines[i].load(now))
        return i
