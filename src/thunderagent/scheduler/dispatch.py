"""The one dispatch path: a request in, a decision and an engine request out.

Pure and synchronous (``now`` is passed in). Both drivers call it: the live fleet
(:mod:`thunderagent.control.fleet`) and the simulator (:mod:`thunderagent.sim.driver`), so what the
simulator measures is what serves traffic. The path, once per request:

1. **hash once** (:meth:`Dispatcher.prepare`): the prompt's chained block hashes, with the tenant
   salt and LoRA name in the seed; reused by the router, the index and the engine;
2. **scheduler**: with the holding queue on (``scheduler.enabled``), a request no worker can start
   now waits in :class:`~thunderagent.scheduler.queue.HoldingQueue`; :meth:`Dispatcher.pump` routes
   the next one whenever a worker frees up. Off, every request is routed at once;
3. **route**: index match + cost + policy over the routable workers (``KvRouter.route``, called
   from here and nowhere else);
4. **predict**: the router records the request's blocks on the winner (done inside ``route``);
5. the driver **submits** the returned :class:`EngineRequest` to the chosen worker.

With program pacing on (``scheduler.pacing``), a request of a paused agent program waits in the
:class:`~thunderagent.scheduler.pacing.ProgramPacer` instead; the driver calls :meth:`Dispatcher.tick`
every ``tick_s`` and :meth:`Dispatcher.pump` releases the resumed programs' requests to the worker
each was placed on (before the holding queue's).

With prefix grouping (``scheduler.grouping``), a request sharing a prefix with one in flight whose
blocks are not stored yet waits in the :class:`~thunderagent.scheduler.grouping.Grouper` as a
follower; the driver calls :meth:`Dispatcher.kv_stored` after applying a worker's KV events,
:meth:`Dispatcher.progressed` on a request's first token and at its end, and :meth:`Dispatcher.tick`
at :meth:`Dispatcher.next_wakeup` (windows and waiting bounds); released followers go through the
same ready path, pinned to their leader's worker.

After the requests of one instant are dispatched the driver calls :meth:`Dispatcher.settle`
(bounded sweep of expired predictions), so the index's bookkeeping is the same in both drivers.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from thunderagent.config import SchedulerConfig
from thunderagent.kv.hashing import block_hash_pairs, block_hashes, hash_seed
from thunderagent.router.cost import is_busy
from thunderagent.router.errors import HeldRefused
from thunderagent.router.router import KvRouter, NoWorkerAvailable
from thunderagent.scheduler import affinity
from thunderagent.scheduler.disagg import Disaggregator, split_pools
from thunderagent.scheduler.grouping import Grouper
from thunderagent.scheduler.pacing import ProgramPacer
from thunderagent.scheduler.prefill_gate import PrefillGate
from thunderagent.scheduler.programs import ProgramTable
from thunderagent.scheduler.queue import Held, HoldingQueue, QueueFull
from thunderagent.types import Decision, EngineRequest, PdPlan, RouteRequest, Sampling, WorkerState

log = logging.getLogger(__name__)

__all__ = ["Dispatch", "Dispatcher", "QueueFull"]

#: expired predictions swept per settle (bounded work per instant; ``predict`` sweeps too)
EXPIRE_PER_SETTLE = 64


@dataclass(slots=True)
class Dispatch:
    """A routed request: what to submit, where, and what the index knew when it was decided."""

    request: EngineRequest
    decision: Decision
    #: most prompt tokens any worker held per the index at routing time (the engine recomputes
    #: the last prompt token, so at most ``(len - 1) // block_size`` blocks can hit)
    best_known_tokens: int
    #: prompt tokens the chosen worker is believed to hold
    predicted_tokens: int
    #: seconds the request waited in the holding queue
    queue_wait: float = 0.0
    #: prefill/decode disaggregation: prefill elsewhere and move the KV (None: prefill locally)
    pd: PdPlan | None = None
    #: the request's route key (tenant / business line: ``routing.route_key``)
    route_key: str = ""
    #: a follower released to its group leader's worker (``scheduler.grouping``)
    grouped: bool = False
    #: dispatched ahead of the queue's next for its cache on a worker that could start it (``scheduler/affinity.py``)
    affinity: bool = False


def _has_slot(w: WorkerState, depth: int) -> bool:
    # Slots known: a request sent now starts at the engine's next pass unless every sequence slot is
    # taken, and then it would wait in the engine for one, unseen by the scheduler's admission bound
    # (its wait is the time until some running request ends): only ``depth`` may. Unknown: the
    # engine queue's length is all there is to go by, and at least one may wait there.
    if w.max_num_seqs:
        return w.load.running + w.load.waiting < w.max_num_seqs + depth
    return w.load.waiting < max(1, depth)


class Dispatcher:
    def __init__(self, router: KvRouter, block_size: int, scheduler: SchedulerConfig | None = None,
                 disagg: Disaggregator | None = None,
                 program_caps: tuple[Mapping[str, int | None], int | None] = ({}, None)) -> None:
        """``disagg``: prefill/decode disaggregation (``scheduler.disagg.make_disaggregator``); without it
        role prefill workers get nothing (roles act either way: they never serve end to end).
        ``program_caps``: agent programs per tenant at most (``config.tenants.program_caps``)."""
        self.router = router
        self.disagg = disagg
        self.index = router.index
        self.block_size = block_size
        cfg = scheduler if scheduler is not None else SchedulerConfig(enabled=False)  # none: route at once
        self.scheduler = cfg if cfg.enabled else None
        self.queue = HoldingQueue(cfg) if cfg.enabled else None
        self.programs = ProgramTable(cfg.program_idle_ttl_s, cfg.max_programs, program_caps)
        self.pacer = (ProgramPacer(cfg.pacing, self.programs, self.index, block_size)
                      if cfg.pacing.enabled else None)
        # with scheduler.tracked_prefill_passes or prefills_in_flight: uncached prompt tokens and
        # requests sent per worker and not prefilled yet (no first token), and each such request's
        # (worker, tokens)
        self._track = self.scheduler is not None and (cfg.tracked_prefill_passes is not None
                                                      or cfg.prefills_in_flight is not None
                                                      or cfg.overload_prefills_in_flight is not None)
        # the latency gate in effect (prefills_in_flight, or overload_prefills_in_flight until
        # overload_hold_s after the last refusal for the wait): set on each submit and pump
        self._gate: int | None = cfg.prefills_in_flight if self.scheduler is not None else None
        self._overloaded_at = -math.inf
        self._sent: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._unprefilled: dict[str, tuple[str, int]] = {}
        self.affinity_dispatches = 0  # held requests sent ahead of the queue's next for their cache (affinity.py)
        self._ready: deque[Held] = deque()  # released requests (resumed programs, followers), to dispatch first
        #: called with each request about to be routed (a sharded index re-enters other frontends' answers)
        self.before_route: Callable[[EngineRequest, float], None] | None = None
        # disaggregation always: the prefill tier's gate (scheduler/prefill_gate.py)
        self.prefill_gate = (PrefillGate(cfg.engine_backlog_passes) if self.scheduler is not None
                             and disagg is not None and disagg.cfg.mode == "always" else None)
        self.grouper = (Grouper(cfg.grouping, self.index, block_size, self._ready, cfg.max_queued)
                        if cfg.grouping.active else None)

    def prepare(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        ignore_eos: bool = False,
        sampling: Sampling | None = None,
        arrival: float = 0.0,
    ) -> EngineRequest:
        """Hash the prompt once; the engine request carries the hashes from here on."""
        seed = hash_seed(cache_salt, lora_name)
        checks: list[int] | None = None
        if self.index.checks is None:
            hashes = block_hashes(prompt, self.block_size, seed)
        else:  # the double-hash guard (kv.check): both chains in one pass over the packed prompt
            hashes, checks = block_hash_pairs(prompt, self.block_size, seed)
        return EngineRequest(request_id, prompt, hashes, seed, max_tokens, ignore_eos=ignore_eos, priority=priority,
                             arrival=arrival, cache_salt=cache_salt, lora_name=lora_name, sampling=sampling,
                             check_hashes=checks)

    def submit(self, req: EngineRequest, key: str, workers: Sequence[WorkerState], now: float,
               program: str | None = None, tenant: str | None = None, pin: str | None = None) -> Dispatch | None:
        """A new request (of agent ``program``, if any; ``tenant``: whose program, API keys on; ``pin``: the
        worker it must go to while routable, e.g. the one holding its stored conversation): routed
        now (returned) when nothing is held and a worker can start it, else held (None) until
        :meth:`pump` routes it. Raises :class:`QueueFull` past the queue's bounds and
        :class:`~thunderagent.router.router.NoWorkerAvailable` when no worker is there at all."""
        queue, pacer = self.queue, self.pacer
        if queue is not None and not workers:
            raise NoWorkerAvailable("no healthy worker is registered")
        self._gate_at(now)
        if program is not None:
            # only the pacer reads a program's blocks: without it an idle program keeps no prompt alive
            blocks = req.block_hashes if pacer is not None else ()
            prog = self.programs.request_started(program, now, blocks, len(req.prompt_tokens), tenant)
            if pacer is not None:
                if now >= pacer.next_tick and workers:
                    self.tick(workers, now)
                if pacer.must_hold(prog, len(req.prompt_tokens), now):
                    pacer.hold(program, Held(req, key, req.priority, now, 0, program, pin))
                    return None
        avoid: tuple[str, ...] = ()
        if self.grouper is not None and pin is None:
            offered = self.grouper.offer(Held(req, key, req.priority, now, 0, program), workers, now)
            if offered is None:
                return None
            avoid = offered
        try:
            if queue is None or not len(queue):
                pool = workers if queue is None else self._gated(workers)
                # gated, the pool's decode workers are exactly those that can start it now, and they
                # may all be ones a sibling should not wait on: then it is held like the rest
                if queue is None or ((self.can_start(workers) if pool is workers else
                                      any(w.role != "prefill" and w.worker_id not in avoid for w in pool))
                                     and self._prefill_room(workers, req.priority)):
                    d = self.dispatch(req, pool, now, exclude=avoid, program=program, pin=pin)
                    d.route_key = key
                    return d
            uncached, holders = affinity.estimate(req, self.index, self.block_size, now)
            queue.push(Held(req, key, req.priority, now, uncached, program, pin,
                            admitted=program is not None and prog.admitted, holders=holders), now)
        except (QueueFull, NoWorkerAvailable) as e:
            if program is not None:  # refused: not a step of the program
                self.programs.request_finished(program, 0, now, completed=False)
            if isinstance(e, QueueFull) and e.wait:
                self._overloaded_at = now
                self._gate_at(now)
            raise
        return None

    def tick(self, workers: Sequence[WorkerState], now: float) -> int:
        """Periodic decisions: grouping's windows and waiting bounds that are due, and program
        pacing's pauses and resumes (every ``tick_s``). Returns how many held requests were released
        (:meth:`pump` dispatches them)."""
        n = self.grouper.expire(now) if self.grouper is not None else 0
        pacer = self.pacer
        if pacer is None or not workers or now < pacer.next_tick:
            return n
        for pid in pacer.tick(workers, now):
            for held in pacer.take_held(pid):
                self._ready.append(held)
                n += 1
        return n

    def next_wakeup(self) -> float:
        """When :meth:`tick` next has work: the next pacing tick or grouping deadline (inf: none)."""
        t = self.grouper.next_deadline if self.grouper is not None else math.inf
        return min(t, self.pacer.next_tick) if self.pacer is not None else t

    def kv_stored(self, worker_id: str) -> int:
        """The driver applied ``worker_id``'s KV events: followers whose prefix is now confirmed
        there are released (cheap when none wait on it). Returns how many."""
        return self.grouper.stored(worker_id) if self.grouper is not None else 0

    def first_token(self, service_s: float) -> None:
        """A dispatched request produced its first token ``service_s`` after it was dispatched (its
        holding-queue wait left out): the service time ``scheduler.admit_ttft_factor`` bounds against."""
        if self.queue is not None:
            self.queue.observe_service(service_s)

    def progressed(self, request_id: str, *, ok: bool) -> int:
        """A dispatched request produced its first token or ended (``ok``: without an error): if it
        leads a group, its followers are released. Returns how many, plus 1 when a gate that counts what
        we sent (``scheduler.tracked_prefill_passes``; the prefill tier's, for the tiers above the default)
        may have opened while requests are held: non-zero means the driver should pump."""
        gate = self.prefill_gate
        counted = self._prefilled(request_id) | (gate is not None and gate.done(request_id))  # both forget: |
        freed = counted and self.queue is not None and len(self.queue) > 0
        return (self.grouper.progressed(request_id, ok) if self.grouper is not None else 0) + freed

    def _prefilled(self, request_id: str) -> bool:
        """Forget what ``request_id`` was sent with (tracked gate); True if it was counted."""
        sent = self._unprefilled.pop(request_id, None)
        if sent is not None:
            # A worker's two entries go together, when its last request goes: its token total may reach 0 first
            # (a request that sent none, one of vLLM's paths that generate nothing, outlives the others).
            wid = sent[0]
            n = self._pending[wid] - 1
            if n:
                self._pending[wid] = n
                self._sent[wid] -= sent[1]
            else:
                del self._pending[wid], self._sent[wid]
        return sent is not None

    def release(self, program: str) -> bool:
        """The client ended ``program`` (TERMINATED): forgotten; requests of it still held go now.
        False if unknown."""
        if self.pacer is not None:
            self._ready.extend(self.pacer.take_held(program))
        return self.programs.release(program)

    def ready(self) -> int:
        """Released requests waiting for :meth:`pump`."""
        return len(self._ready)

    def finished(self, program: str, context_tokens: int, now: float, *, completed: bool) -> None:
        """A request of ``program`` ended (``completed``: it produced its response)."""
        self.programs.request_finished(program, context_tokens, now, completed=completed)

    def held(self) -> int:
        """Requests waiting here: in the holding queue, or of paused programs."""
        n = len(self._ready) + (len(self.queue) if self.queue is not None else 0)
        n += self.grouper.held_count() if self.grouper is not None else 0
        return n + (self.pacer.held_count() if self.pacer is not None else 0)

    def pump(self, workers: Sequence[WorkerState], now: float,
             pinned: Callable[[str], Sequence[WorkerState]] | None = None) -> Dispatch | None:
        """The next held request, routed, once a worker can start it (or it waited ``max_wait_s``:
        then it goes anyway). None when nothing can go now. The driver submits it and calls again.
        Routing it may raise: :class:`HeldRefused` when it can never go, or still cannot once it waited
        ``max_wait_s`` (it left the scheduler: the driver ends it refused); else ``NoWorkerAvailable``
        (it stays first in line: the driver stops pumping until something changes). ``pinned``: the workers a
        request pinned to a worker may go to (the driver's: its pin routable though marked asleep or paused)."""
        if self._ready and workers:
            held = self._ready[0]
            try:
                d = self.dispatch(held.req, pinned(held.pin) if pinned and held.pin else workers, now,
                                  program=held.program, pin=held.pin, backlog=self._backlog() - 1)
            except NoWorkerAvailable as e:
                if not (e.lasting or self._overdue(held, now)):
                    raise  # it stays first in line: room may come (a prefill worker back, the plane freed...)
                self._ready.popleft()
                raise self._refused(held, e, now) from e
            self._ready.popleft()  # routed: not before (a request that could not be routed stays first in line)
            d.queue_wait, d.route_key, d.grouped = now - held.enqueued, held.key, held.pin is not None
            return d
        queue = self.queue
        if queue is None or not workers:
            return None
        self._gate_at(now)
        held = queue.next(now)
        if held is None:
            return None
        assert self.scheduler is not None
        forced = queue.forced(held, now)
        if not forced and not (self.can_start(workers) and self._prefill_room(workers, held.req.priority)):
            return None
        head = held
        if not forced and held.pin is None and self.before_route is None:  # (sharded index: matches are local only)
            queued = None if self._gate is not None else affinity.holder_queue(self._sent, self.router.cfg)
            held, workers = affinity.choose(queue, held, workers, self._startable, self.scheduler, self.index,
                                            self.block_size, now, queued)
        if pinned is not None and held.pin is not None:
            workers = pinned(held.pin)
        try:  # (a pin: a stored response's read or continuation, held here like any request)
            d = self.dispatch(held.req, workers if forced else self._gated(workers), now, program=held.program,
                              pin=held.pin, backlog=self._backlog() - 1)
        except NoWorkerAvailable as e:
            if not (e.lasting or forced):
                raise  # it stays first in line, as above
            queue.cancel(held.req.request_id)
            raise self._refused(held, e, now) from e
        queue.take(held, now, borrow=held.key != head.key)
        d.queue_wait, d.route_key, d.affinity = now - held.enqueued, held.key, held is not head
        self.affinity_dispatches += d.affinity
        return d

    def _refused(self, held: Held, e: NoWorkerAvailable, now: float) -> HeldRefused:
        """``held`` left the scheduler unrouted (no wait would help, or it waited ``max_wait_s``): the error
        its driver ends it with. A program's request is no step of it."""
        if held.program is not None:
            self.programs.request_finished(held.program, 0, now, completed=False)
        return HeldRefused(held.req.request_id, f"{e} (held {now - held.enqueued:.1f}s)", e.retry_after)

    def _overdue(self, held: Held, now: float) -> bool:
        return self.scheduler is not None and now - held.enqueued >= self.scheduler.max_wait_s

    def cancel(self, request_id: str) -> bool:
        """Drop a held request (client gone): True if it was held."""
        if self.grouper is not None and self.grouper.cancel(request_id):
            return True
        if self.queue is not None and self.queue.cancel(request_id):
            return True
        for k, held in enumerate(self._ready):
            if held.req.request_id == request_id:
                del self._ready[k]
                return True
        return self.pacer is not None and self.pacer.cancel(request_id)

    def _backlog(self) -> int:
        """Requests held here that wait for the fleet's capacity (released and queued ones)."""
        return len(self._ready) + (len(self.queue) if self.queue is not None else 0)

    def _gate_at(self, now: float) -> None:
        sched = self.scheduler
        if sched is None or sched.prefills_in_flight is not None or sched.overload_prefills_in_flight is None:
            return
        gate = sched.overload_prefills_in_flight if now - self._overloaded_at < sched.overload_hold_s else None
        if gate != self._gate:
            log.info("latency gate %s: %s", "engaged (a request was refused for its wait)" if gate is not None
                     else f"released ({sched.overload_hold_s:g}s without a refusal for the wait)",
                     f"at most {gate} request(s) before their first token per worker" if gate is not None
                     else "workers take requests into any free slot")
            self._gate = gate

    def gate(self) -> int | None:
        """The latency gate in effect: requests before their first token a worker may have (None: off)."""
        return self._gate

    def can_start(self, workers: Sequence[WorkerState]) -> bool:
        """Some worker can start a request now (:meth:`_startable`)."""
        return any(self._startable(w) for w in workers)

    def _startable(self, w: WorkerState) -> bool:
        """``w`` can start a request now: it is not busy and, with ``tracked_prefill_passes``, the
        uncached prompt tokens we sent it that have no first token yet are at most that many passes
        (the router's own count: exact at once, where an engine's report lags its requests); else it
        has a free sequence slot (or fewer than ``engine_queue_depth`` would wait in its engine for
        one) and its reported prefill backlog would be done within ``engine_backlog_passes`` passes.
        With the latency gate in effect (:meth:`gate`), also fewer than that many requests we sent it
        are before their first token."""
        sched = self.scheduler
        assert sched is not None
        if w.role == "prefill" or is_busy(w, self.router.cfg):
            return False
        wid = w.worker_id
        if self._gate is not None and self._pending.get(wid, 0) >= self._gate:
            return False
        if sched.tracked_prefill_passes is not None:  # what we sent, not what the engines reported
            return self._sent.get(wid, 0) <= sched.tracked_prefill_passes * w.max_num_batched_tokens
        return (_has_slot(w, sched.engine_queue_depth)
                and w.load.queued_prefill_tokens < sched.engine_backlog_passes * w.max_num_batched_tokens)

    def _prefill_room(self, workers: Sequence[WorkerState], priority: int) -> bool:
        """With disaggregation ``always``, a prefill worker can take a request of ``priority`` now
        (:class:`~thunderagent.scheduler.prefill_gate.PrefillGate`)."""
        gate = self.prefill_gate
        return gate is None or gate.room(workers, priority, self.router.cfg)

    def _gated(self, workers: Sequence[WorkerState]) -> Sequence[WorkerState]:
        """With the latency gate in effect, the request goes only to a worker that can start it now
        (the gate is about where it lands: a worker mid-prefill would make it wait for that prefill);
        prefill-role workers stay (the disaggregation plan's pool)."""
        if self._gate is None:
            return workers
        return [w for w in workers if w.role == "prefill" or self._startable(w)]

    def dispatch(self, req: EngineRequest, workers: Sequence[WorkerState], now: float,
                 exclude: tuple[str, ...] = (), program: str | None = None, pin: str | None = None,
                 backlog: int = 0) -> Dispatch:
        """Route ``req`` among ``workers`` less ``exclude`` (could not take it, or a sibling should not wait on
        them); a program the pacer pinned, or ``pin`` (a follower released to its leader's), goes there while
        routable. ``backlog``: requests held here; the contention charge counts each worker's share (``RouteRequest
        .held``): overload in our queue still saturates and keeps cache hits. Raises :class:`NoWorkerAvailable`."""
        if self.before_route is not None:
            self.before_route(req, now)
        workers, prefill_pool = split_pools(_eligible(workers, exclude, req.lora_name))
        if not workers:
            raise NoWorkerAvailable("no decode (or both) worker is routable; role prefill workers only prefill")
        if not prefill_pool and self.disagg is not None and self.disagg.strict:
            raise NoWorkerAvailable("no prefill worker is routable and routing.fallback_to_local is false (decode "
                                    "workers never prefill)")
        prog = self.programs.get(program) if program is not None else None
        if prog is not None and prog.pinned is not None:
            pin = prog.pinned
        n = len(req.prompt_tokens)
        if pin is not None:  # unless the pinned worker cannot hold what the program's context grew to
            workers = [w for w in workers if w.worker_id == pin and w.holds(n, n + req.max_tokens)] or workers
        held = -(-backlog // len(workers)) if backlog > 0 else 0  # per routable worker, rounded up
        rreq = RouteRequest(req.request_id, n, req.block_hashes, req.priority, req.check_hashes, held, req.max_tokens)

        def route(pool: Sequence[WorkerState], predict: bool = True) -> Decision:  # the decode pool, the prefill pool
            return self.router.route(rreq, pool, now, predict=predict)

        decision = route(workers)
        plan = None
        if self.disagg is not None and prefill_pool:
            decode = next(w for w in workers if w.worker_id == decision.worker_id)
            try:
                plan, why = self.disagg.plan(self.router, rreq, decision, decode, prefill_pool,
                                             lambda: route(prefill_pool, False), now)
            except NoWorkerAvailable:  # strict: no prefill worker or no room; the decode route never happened
                self.index.report_missing(decision.worker_id, req.block_hashes, predicted_only=True)
                raise
            decision = replace(decision, pd=plan, why=decision.why_plus(why))
            if plan is not None and req.priority > 0 and self.prefill_gate is not None:
                self.prefill_gate.sent(req.request_id, plan.prefill_worker, req.priority, plan.transfer_tokens)
        bs = self.block_size
        best = decision.best_overlap_blocks  # not from candidates: those may be built lazily
        hittable = max(0, n - 1) // bs  # an engine recomputes the last token (n 0: a relayed request of no prompt)
        best_known = min(best, hittable) * bs
        predicted = min(decision.overlap_blocks, hittable) * bs
        if prog is not None:  # (a resumed program's pin holds for the turn it was resumed for, unless sticky)
            self.programs.request_placed(prog.program_id, decision.worker_id,
                                         unpin=self.pacer is not None and not self.pacer.cfg.sticky)
        if self.grouper is not None:
            self.grouper.placed(req.request_id, req.block_hashes, decision.worker_id, now)
        if self._track:
            self._prefilled(req.request_id)  # (a retried request is counted once)
            # a migrated stream's continuation is not counted: its stream had its first token already,
            # so no first token of it is reported again and it would count as pending until it ends
            if not req.resumed:
                wid = decision.worker_id
                self._unprefilled[req.request_id] = (wid, n - predicted)
                self._sent[wid] = self._sent.get(wid, 0) + n - predicted
                self._pending[wid] = self._pending.get(wid, 0) + 1
        return Dispatch(req, decision, best_known, predicted, pd=plan)

    def retract(self, d: Dispatch) -> int:
        """``d``'s worker could not take the request (nothing ran): forget the blocks the router
        predicted there, so the next request is not drawn to a cache that was never filled.
        Returns how many index entries were dropped."""
        self._prefilled(d.request.request_id)
        if self.prefill_gate is not None:
            self.prefill_gate.done(d.request.request_id)
        return self.index.report_missing(d.decision.worker_id, d.request.block_hashes, predicted_only=True)

    def settle(self, now: float) -> None:
        """End of an instant's dispatches: sweep a bounded number of expired predictions."""
        self.index.expire(now, EXPIRE_PER_SETTLE)


def _eligible(workers: Sequence[WorkerState], exclude: tuple[str, ...], lora: str | None) -> Sequence[WorkerState]:
    """``workers`` less ``exclude``; for a LoRA adapter some of them list by name, only those (one no routable
    worker lists goes as asked: a simulated fleet's ``lora_name``, or the server says it does not have it)."""
    if exclude:
        workers = [w for w in workers if w.worker_id not in exclude]
    if lora is not None and (serving := [w for w in workers if lora in w.adapters]):
        return serving
    return workers
