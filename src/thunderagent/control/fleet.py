"""The control-plane core: registry + index + dispatch path in front of a set of worker handles.

One :class:`Fleet` runs in every frontend. *Which* workers it has is its :class:`Membership`'s business (from the
config: ``control.membership``; over NATS: ``control.nats_membership``). Everything else is here, for every worker:
- worker reports (``WorkerCallbacks``): KV events through the KvFeed (a gap asks the membership for a resync),
  heartbeats renew the lease, load reports refresh the registry, "unavailable" takes a worker out of routing until
  its next heartbeat; a worker whose lease expires leaves routing, its entries purged, its requests ended (``ERROR``
  once accepted, else ``UNAVAILABLE``: routed again), as are a request whose queue heard nothing for
  ``stall_timeout`` and one past its deadline (``control/deadline.py``);
- requests: :meth:`start_generation` runs the one dispatch path (``scheduler/dispatch.py``) over the routable workers
  (healthy, not cordoned or skipped; asleep or paused ones last) and submits; :meth:`outputs` streams the outputs,
  routing a request again when its worker could not take it; aborts it when the consumer stops early. Clock injected."""

from __future__ import annotations

import asyncio
import secrets
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Protocol

from thunderagent.config import Config, Policy, program_caps
from thunderagent.control import migration
from thunderagent.control.deadline import Deadlines
from thunderagent.control.decision_hook import DecisionHook
from thunderagent.control.disagg_flow import DisaggFlow
from thunderagent.control.health_view import health_summary
from thunderagent.control.liveness import LoopLag
from thunderagent.control.metrics import Metrics
from thunderagent.control.outliers import OutlierWatch
from thunderagent.control.generation import Generation, HeldCall, abort_held
from thunderagent.control.autotune_hook import AutotuneHook
from thunderagent.control.planner_hook import PlannerHook
from thunderagent.control.registry import Health, WorkerRegistry
from thunderagent.control.transfer_parts import transfer_parts
from thunderagent.execution.handle import STALL_TIMEOUT_S, WorkerCallbacks, WorkerHandle, cancel_and_wait
from thunderagent.kv.feed import KvFeed
from thunderagent.kv.index import KvIndex
from thunderagent.router.errors import HeldRefused
from thunderagent.router.router import KvRouter, NoWorkerAvailable
from thunderagent.scheduler.disagg import make_disaggregator
from thunderagent.scheduler.dispatch import Dispatch, Dispatcher
from thunderagent.scheduler.queue import QueueFull
from thunderagent.types import (EngineRequest, FinishReason, KvEvent, LoadReport, Passthrough, PromptLimit, Sampling,
                                TokenOutput, WorkerInfo, WorkerState)

log = logging.getLogger(__name__)
__all__ = ["Fleet", "Generation", "Membership", "NoWorkerAvailable", "QueueFull"]


class Membership(Protocol):
    """How a fleet's workers join and leave (all that differs between deployments): ``start`` brings them in
    (``fleet.join``) before serving; ``stop`` stops them or leaves the bus; ``resync``: reload a worker's cache into
    the index (``fleet.feed``'s sync); ``lease_expired``: one left routing, forget or wait; ``summary``: for /health."""

    async def start(self, fleet: Fleet) -> None: ...
    async def stop(self) -> None: ...
    def resync(self, worker_id: str) -> None: ...
    def lease_expired(self, worker_id: str) -> None: ...
    def summary(self) -> dict[str, object]: ...


class Fleet:
    def __init__(self, cfg: Config, membership: Membership, *, policy: Policy | None = None,
                 clock: Callable[[], float] | None = None, stall_timeout: float = STALL_TIMEOUT_S) -> None:
        self.cfg = cfg
        self.model_name = cfg.model_name
        self.membership = membership
        self.metrics = Metrics(cfg.metrics.window_s, cfg.metrics.max_route_keys)
        self.index = KvIndex(prediction_ttl=cfg.routing.prediction_ttl, double_hash=cfg.routing.double_hash)
        self.feed = KvFeed(self.index)
        self.router = KvRouter(cfg.routing, self.index, random.Random(cfg.routing.seed), policy)
        self.block_size = cfg.execution_group.nodes[0].block_size
        cp = cfg.control_plane
        self.dispatcher = Dispatcher(self.router, self.block_size, cfg.scheduler, make_disaggregator(cfg),
                                     program_caps(cp.tenant_limits))  # at most this many programs per tenant
        self.decisions = DecisionHook(cp.decision_log)  # DEBUG lines, the decision log
        self.registry = WorkerRegistry(cp.heartbeat_interval, cp.heartbeat_misses, cfg.routing)
        self.outliers = OutlierWatch(cp.outlier, self.metrics)  # slow or failing live workers skipped a while
        self.planner = PlannerHook(cfg.planner, self.metrics.registry, self.routable, self.registry)  # scaling advice
        self.autotune = AutotuneHook(cfg.routing, self.router, self.metrics.registry)  # self-tuning weights
        self.stall_timeout = stall_timeout
        self.deadlines = Deadlines(cp.request_timeout_s, self.cut, self.metrics.registry)  # request_timeout_s
        self.loop_lag = LoopLag(2 * max(self.registry.timeout, stall_timeout))  # our loop's lateness (liveness.py)
        #: longest sequence any worker can hold (simulated workers: their KV pool); None = unknown
        self.max_context_tokens: int | None = None
        #: longest prompt a worker takes (over NATS: one message's max_payload; without chunked prefill: a pass)
        self.prompt_limit: PromptLimit | None = None
        self.remote_lookup: Callable[[EngineRequest, float], Awaitable[None]] | None = None
        self.held_peers: Callable[[list[str] | None], Awaitable[int]] | None = None  # NATS: other frontends' aborts
        self.workers: dict[str, WorkerHandle] = {}
        #: workers that reported they cannot serve (reason); back in routing with their next heartbeat
        self.unavailable: dict[str, str] = {}
        self.cordoned: set[str] = set()  # out of routing until uncordoned (an operator: control/worker_admin.py)
        self.asleep: set[str] = set()  # servers put to sleep (vLLM's /sleep): routed to only while no other can take it
        self.paused: set[str] = set()  # servers paused through us (vLLM's /pause): likewise (control/marks.py)
        self._clock = clock
        self._inflight: dict[str, Generation] = {}
        self._held: dict[str, HeldCall] = {}  # requests waiting in the scheduler, by id
        self.programs = self.dispatcher.programs  # agent programs (the pacer pauses and resumes them)
        self._pump_due = False
        self._wake_at: float | None = None  # when the armed grouping timer fires
        self._health_task: asyncio.Task[None] | None = None
        self.disagg = DisaggFlow(self.workers, self.metrics, self.now, self.loop_lag, stall_timeout=stall_timeout)
        self.transfers = transfer_parts(cfg, self.dispatcher.disagg, self.disagg, self.metrics, self.registry,
                                        self.workers, self.index, self.block_size, self.now,
                                        Policy(self.router.policy.name))
        self.cache_migration = self.transfers.migration  # routing.migration (None when off)

    # -- lifecycle ---------------------------------------------------------------------------
    def now(self) -> float:
        if self._clock is None:
            self._clock = asyncio.get_running_loop().time
        return self._clock()

    def callbacks(self) -> WorkerCallbacks:
        """What a handle reports to (its membership passes these when it builds the handle)."""
        return WorkerCallbacks(self.on_events, self.on_heartbeat, self.on_load, self.on_unavailable, self.now,
                               self.on_load_stale)

    async def start(self) -> None:
        self.now()  # bind the loop's clock while a loop runs
        await self.membership.start(self)
        if self.cfg.control_plane.health_check_enabled:
            self._health_task = asyncio.create_task(self._health_loop(), name="health")
        log.info("fleet up: %d workers, policy %s", len(self.workers), self.router.policy.name)

    async def stop(self) -> None:
        await cancel_and_wait([t for t in (self._health_task,) if t is not None])
        await self.transfers.stop()
        await self.membership.stop()
        self.decisions.close()

    # -- membership ----------------------------------------------------------------------------
    def join(self, handle: WorkerHandle, info: WorkerInfo, *, synced: bool) -> None:
        """Add a worker: registered, in the index (``synced``: its cache is known; else its events
        wait for the membership's resync), routable at once."""
        wid = info.worker_id
        self.registry.register(info, self.now())
        self.feed.add_worker(wid, live=synced)
        self.workers[wid] = handle
        self.metrics.healthy.labels(wid).set(1)

    def leave(self, worker_id: str, reason: str, *, drain: bool = False) -> None:
        """Remove a worker (registry, index, routing, breaker); ``drain``: its requests finish, else they end."""
        handle = self.workers.pop(worker_id, None)
        if handle is None:
            return
        self.registry.deregister(worker_id)
        self.outliers.forget(worker_id)  # else its breaker stays in the ejection cap's base for good
        self.unavailable.pop(worker_id, None)
        for marks in (self.cordoned, self.asleep, self.paused):
            marks.discard(worker_id)
        purged, gens = self._out_of_routing(worker_id, handle, None if drain else f"worker {worker_id} left")
        log.warning("worker %s left: %s; %d index entries purged, %d requests in flight%s", worker_id, reason,
                    purged, len(gens), " (draining)" if drain and gens else "")

    def _out_of_routing(self, worker_id: str, handle: WorkerHandle | None,
                        cut: str | None) -> tuple[int, list[Generation]]:
        """Purge a worker's index entries and mark it unhealthy; with ``cut`` (the reason), end its
        requests in flight. Returns the entries purged and its requests."""
        purged = self.feed.remove_worker(worker_id)
        self.metrics.index_purged.labels(worker_id).inc(purged)
        self.metrics.healthy.labels(worker_id).set(0)
        gens = self.generations_on(handle) if handle is not None else []
        if cut is not None:
            for gen in gens:
                self.cut(gen, cut)
        return purged, gens

    # -- worker reports ------------------------------------------------------------------------
    def on_events(self, worker_id: str, events: list[KvEvent]) -> None:
        if self.feed.events(worker_id, events, self.now()):
            log.warning("KV event gap from %s at seq %d: resyncing its index entries", worker_id, events[-1].seq)
            self.resync_worker(worker_id, "gap")
        if self.dispatcher.kv_stored(worker_id):  # followers whose prefix is now stored there
            self._schedule_pump()

    def resync_worker(self, worker_id: str, cause: str) -> None:  # counted by cause, then the membership reloads it
        self.metrics.kv_resyncs.labels(worker_id, cause).inc()
        self.membership.resync(worker_id)

    def on_heartbeat(self, worker_id: str, load: LoadReport) -> None:
        reason = self.unavailable.pop(worker_id, None)
        if reason is not None:
            log.info("worker %s serves again (was %s): back in routing", worker_id, reason)
            self.metrics.out_of_routing.labels(worker_id, reason).set(0)
        if load.kv_seq >= 0 and self.feed.heartbeat(worker_id, load.kv_seq):  # the stream's tail was lost
            self.resync_worker(worker_id, "tail_lost")
        self.registry.heartbeat(worker_id, load, self.now())
        self.metrics.observe_load(load, self.registry.health(worker_id) is Health.healthy)
        self.wake()

    def on_load(self, worker_id: str, load: LoadReport) -> None:
        self.registry.update_load(worker_id, load)
        self.wake()  # capacity may have freed up

    def on_load_stale(self, worker_id: str, read: Callable[[], LoadReport]) -> None:  # on_load, read lazily
        self.registry.stale(worker_id, read)
        self.wake()

    def on_unavailable(self, worker_id: str, reason: str) -> None:
        old = self.unavailable.get(worker_id)
        if old == reason:
            return
        if old is not None:
            self.metrics.out_of_routing.labels(worker_id, old).set(0)
        self.unavailable[worker_id] = reason
        self.metrics.out_of_routing.labels(worker_id, reason).set(1)
        log.warning("worker %s out of routing: %s", worker_id, reason)

    def routable(self, pin: str | None = None) -> Sequence[WorkerState]:
        out, ws, off = self.unavailable, self.registry.routable(), self.cordoned  # ws: the FleetView (kept whole)
        skip = self.outliers.skipping(ws)
        # (a sleeping or paused vLLM server holds new requests until it wakes or resumes: the others first, if any;
        # not one pinned to it, which nothing else can serve: a read or cancel of a response it stores, its thread)
        held = (self.asleep | self.paused) - {pin} if self.asleep or self.paused else None
        awake = self.registry.routable(skip.union(out, off, held)) if held else ()
        return awake or (self.registry.routable(skip.union(out, off)) if skip or out or off else ws)

    # -- health ------------------------------------------------------------------------------
    def check_health(self) -> None:
        now = self.now()
        silent_for = self.loop_lag.silent_for
        for change in self.registry.check(now, silent_for):
            wid = change.worker_id
            if change.health is Health.unhealthy:
                self.metrics.lease_expired.labels(wid).inc()
                purged, _ = self._out_of_routing(wid, self.workers.get(wid), f"worker {wid} lease expired")
                log.warning("worker %s unhealthy (%s): out of routing, %d index entries purged",
                            wid, change.reason, purged)
                self.membership.lease_expired(wid)
            else:
                self.feed.add_worker(wid)
                self.resync_worker(wid, "rejoined")
                log.info("worker %s healthy again (%s): back in routing", wid, change.reason)
                self.metrics.healthy.labels(wid).set(1)
        self.outliers.tick([w.worker_id for w in self.registry.routable()], now)
        self.dispatcher.tick(self.routable(), now)  # pacing; grouping's bounds (``_wake`` runs them on time)
        if self.transfers.ticking:  # cache migration's copies; prefill/decode links' warm-ups
            self.transfers.tick(self.routable(), now)
        self.decisions.tick()  # buffered decision-log lines reach the file
        self.metrics.observe_fleet(self.registry.loads().values(), now)
        self.planner.tick(now)
        self.metrics.observe_scheduler(self.dispatcher, now)
        if self.dispatcher.pacer is not None:
            self._observe_programs()
        if self._held:
            self._pump()  # requests past max_wait_s (or of resumed programs) go even when no worker has room
        if self.programs.expire(now):
            self._observe_programs()
        for gen in list(self._inflight.values()):
            if silent_for(gen.queue.last_heard, now) > self.stall_timeout:
                log.warning("request %s on %s: nothing heard for %.1fs", gen.request_id, gen.worker.worker_id,
                            now - gen.queue.last_heard)
                self.cut(gen, "stalled")

    def generations_on(self, handle: WorkerHandle, prefill: bool = False) -> list[Generation]:
        """Ours running there (disaggregated: on its decode worker; ``prefill``: or prefilling there)."""
        return [g for g in self._inflight.values() if getattr(g.worker, "decode", g.worker) is handle
                or (prefill and getattr(g.worker, "prefill", None) is handle)]

    def wake(self) -> None:  # routing changed (a worker back or added): held requests may go now
        if self._held:
            self._schedule_pump()

    def cut(self, gen: Generation, why: str) -> None:
        """End a request its worker can no longer serve: aborted there, and finished here with ``ERROR`` if the
        worker had accepted it (the consumer migrates it), else ``UNAVAILABLE`` (the consumer routes it again)."""
        self._inflight.pop(gen.request_id, None)
        gen.lost = why
        gen.worker.abort(gen.request_id)
        reason = FinishReason.ERROR if gen.queue.accepted or gen.queue.produced or gen.timed_out \
            else FinishReason.UNAVAILABLE
        log.debug("request %s ended (%s): %s", gen.request_id, why, reason.value)
        now = self.now()
        gen.queue.put_output(TokenOutput(gen.request_id, [], now, gen.prompt_tokens, 0, True, reason), now)

    async def _health_loop(self) -> None:
        period = self.cfg.control_plane.heartbeat_interval / 2
        while True:
            expected = self.now() + period
            await asyncio.sleep(period)
            self.metrics.observe_loop_lag(self.loop_lag.tick(expected, self.now()), self.loop_lag.max_lag)
            self.check_health()

    # -- requests ----------------------------------------------------------------------------
    async def start_generation(
        self, prompt_ids: list[int], max_tokens: int, *, cache_salt: str | None = None, lora_name: str | None = None,
        priority: int = 0, ignore_eos: bool = False, sampling: Sampling | None = None, route_key: str = "",
        program_id: str | None = None, tenant: str | None = None,  # (the program's key, and whose it is)
        passthrough: Passthrough | None = None, pin: str | None = None, headers: tuple[tuple[str, str], ...] = (),
    ) -> Generation:
        """Hash once, then route and submit now (to ``pin`` while routable, if given), or hold the request until a
        worker can start it. Raises NoWorkerAvailable, or QueueFull when the scheduler's queue is full. A caller
        cancelled while its request is held leaves the queue."""
        received = self.now()
        t0 = time.perf_counter()
        rid = secrets.token_hex(12)  # unguessable: ids appear in responses and abort paths
        req = self.dispatcher.prepare(rid, prompt_ids, max_tokens, cache_salt=cache_salt, lora_name=lora_name,
                                      priority=priority, ignore_eos=ignore_eos, sampling=sampling, arrival=received)
        req.passthrough, req.headers = passthrough, headers  # relayed: the client's body; its trace headers
        if self.remote_lookup is not None:  # a sharded index (control/index_shards.py): ask the other frontends
            await self.remote_lookup(req, received)
        try:
            d = self.dispatcher.submit(req, route_key, self.routable(pin), received, program_id, tenant, pin)
        except QueueFull as exc:
            self.metrics.queue_refused(exc.code, tenant)
            raise
        if program_id is not None:
            self._observe_programs()
        if self.dispatcher.ready():  # the submission's pacing tick resumed programs
            self._schedule_pump()
        if d is not None:
            return self._launch(d, time.perf_counter() - t0, program_id)
        call = HeldCall(asyncio.get_running_loop().create_future(), program_id,
                        next((v for k, v in headers if k == "x-request-id"), None))
        self._held[rid] = call
        self._observe_queue()
        self._schedule_pump()  # (it arms the grouping timer)
        async with self.deadlines.held(received, self.now()):  # (past it: DeadlineExceeded, after the cleanup)
            try:
                return await call.fut
            except asyncio.CancelledError:
                self._held.pop(rid, None)
                if self.dispatcher.cancel(rid):
                    self.metrics.scheduler_cancelled.inc()
                    self._observe_queue()
                elif call.fut.done() and not call.fut.cancelled():  # dispatched just as the caller left
                    gen = call.fut.result()
                    self._inflight.pop(rid, None)
                    gen.worker.abort(rid)
                if program_id is not None:  # its outputs were never read: the step ends here
                    self.dispatcher.finished(program_id, 0, self.now(), completed=False)
                raise

    def _launch(self, d: Dispatch, route_s: float, program_id: str | None) -> Generation:
        """Submit a routed request to its worker."""
        req = d.request
        self.dispatcher.settle(self.now())
        self.metrics.observe_route(d, route_s, self.now())
        self.decisions.record(self, d, program_id)
        self.outliers.launched(d)
        self.transfers.observe(d, self.now())
        worker, received = self.workers[d.decision.worker_id], req.arrival  # before submit: sim engines reset it
        gen = Generation(req.request_id, d, *self.disagg.submit(d, worker), received, program_id=program_id,
                         latency=self.metrics.seed.latency(worker.worker_id, d.route_key))
        self._inflight[req.request_id] = gen
        self.deadlines.arm(gen, self.now())
        return gen

    def _schedule_pump(self) -> None:
        # Deferred to the loop: reports arrive from inside a worker's submit, and the pump submits.
        if not self._pump_due:
            self._pump_due = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _arm(self) -> None:  # wake at the dispatcher's next grouping deadline (windows, follower bounds)
        t = self.dispatcher.next_wakeup() if self.dispatcher.grouper is not None else math.inf
        if t != math.inf and (self._wake_at is None or t < self._wake_at):
            self._wake_at = t
            asyncio.get_running_loop().call_later(max(0.0, t - self.now()), self._wake)

    def _wake(self) -> None:
        self._wake_at = None
        self.dispatcher.tick(self.routable(), self.now())
        self._pump()  # then re-armed while requests are held

    def _pump(self) -> None:
        """Dispatch held requests one at a time (each submission pushes its worker's load first)."""
        self._pump_due = False
        while self._held:
            now = self.now()
            t0 = time.perf_counter()
            try:
                d = self.dispatcher.pump(self.routable(), now, self.routable)
            except HeldRefused as e:  # it could not be routed for good, or after max_wait_s: its caller gets 503
                refused = self._held.pop(e.request_id, None)
                if refused is not None and not refused.fut.done():
                    refused.fut.set_exception(e)
                continue
            except NoWorkerAvailable:
                break
            if d is None:
                break
            self.metrics.scheduler_wait.observe(d.queue_wait)
            if d.affinity:
                self.metrics.scheduler_affinity.inc()
            call = self._held.pop(d.request.request_id, None)
            if call is None or call.fut.done():  # its caller was cancelled, its cleanup not run yet: no submit
                self.dispatcher.retract(d)
                continue
            call.fut.set_result(self._launch(d, time.perf_counter() - t0, call.program_id))
        self._observe_queue()
        if self._held:
            self._arm()

    def _observe_programs(self) -> None:
        self.metrics.observe_programs(self.programs.by_state(), self.programs.take_evictions())

    def release_program(self, program_id: str) -> bool:
        """A client ended the program (over NATS, through any frontend): forgotten, counted; its held requests go."""
        if not self.dispatcher.release(program_id):
            return False
        self.metrics.programs_released.inc()
        if self.dispatcher.ready():
            self._schedule_pump()
        self._observe_programs()
        return True

    def abort_held(self, ids: Collection[str] | None) -> int:  # /abort_requests: held ones (generation.py), how many
        ended = abort_held(self._held, self.dispatcher, ids, self.now())
        self._observe_queue()
        self._observe_programs()
        return ended

    def _observe_queue(self) -> None:
        if self.dispatcher.queue is not None:
            self.metrics.observe_queue(self.dispatcher.queue.by_tier())

    def resubmit(self, gen: Generation, d: Dispatch, tried: tuple[str, ...]) -> None:
        """Submit ``gen`` as routed again (``d``), after the workers in ``tried``."""
        d.route_key = gen.dispatch.route_key
        gen.dispatch, gen.tried = d, tried
        gen.latency = self.metrics.seed.latency(d.decision.worker_id, d.route_key)
        self.outliers.launched(d)
        self.decisions.record(self, d, gen.program_id, tried)
        gen.worker, gen.queue = self.disagg.submit(d, self.workers[d.decision.worker_id])
        self._inflight[gen.request_id] = gen

    async def outputs(self, gen: Generation) -> AsyncIterator[TokenOutput]:
        """A request's outputs, the last one finished. A request its worker could not take is routed
        again; one its worker lost continues on another (``control.migration``) in this stream. The
        request is aborted if the consumer stops early (client gone, stop string); metrics recorded."""
        cached = completion = 0
        first_t = last_t = reason = None
        finished = False
        try:
            while True:
                out = await gen.queue.get()
                now = self.now()
                if out.finished and not gen.timed_out:  # (one past its deadline goes nowhere else)
                    if out.finish_reason == FinishReason.UNAVAILABLE or migration.is_lost(gen, out):
                        self.outliers.failed(gen.worker, now)
                    if (out.finish_reason == FinishReason.UNAVAILABLE and not out.token_ids
                            and not gen.queue.produced and migration.route_again(self, gen)):
                        continue
                    if migration.is_lost(gen, out) and migration.migrate(self, gen):
                        continue
                out = migration.settle(gen, out) if gen.origin is not None or out.finished else out
                gen.produced += out.token_ids
                # real engines report cached tokens with their last output, simulated ones with the first
                cached = max(cached, out.cached_tokens)
                if last_t is None:
                    first_t = now
                    if out.token_ids or out.finished:
                        self.metrics.observe_ttft(gen.latency, now - gen.received)
                        if out.token_ids:  # the admission bound's service time (a rejection is none)
                            self.dispatcher.first_token(now - gen.received - gen.dispatch.queue_wait)
                        if self.dispatcher.progressed(gen.request_id, ok=bool(out.token_ids)):
                            self._schedule_pump()  # a leader's followers go
                else:
                    self.metrics.observe_itl(gen.latency, now - last_t)
                last_t = now
                finished = out.finished
                completion += len(out.token_ids)
                reason = out.finish_reason
                yield out
                if finished:
                    return
        finally:
            self._inflight.pop(gen.request_id, None)
            self.deadlines.disarm(gen)
            if self.dispatcher.progressed(gen.request_id, ok=False):  # a leader gone before its first token
                self._schedule_pump()
            ran = finished and reason in (FinishReason.STOP, FinishReason.LENGTH)  # (a pooling answer has no tokens)
            if last_t is not None:
                self.metrics.observe_prefill(gen.dispatch, gen.prompt_tokens, cached, self.now())
                self.autotune.finished(gen.received, first_t, gen.prompt_tokens, cached,
                                       gen.dispatch.best_known_tokens, self.now())
                if ran:
                    self.outliers.served(gen, first_t, last_t, completion)
            if not gen.produced and not ran:  # never ran there: the blocks predicted on its worker are not there
                self.metrics.observe_correction(self.dispatcher.retract(gen.dispatch))
            if not finished:
                gen.worker.abort(gen.request_id)
            if gen.program_id is not None:
                self.dispatcher.finished(gen.program_id, gen.prompt_tokens + completion, self.now(), completed=ran)
                self._observe_programs()

    def health_summary(self) -> dict[str, object]:
        return health_summary(self.registry, self.index, self.unavailable, (self.cordoned, self.asleep, self.paused),
                              self.dispatcher.queue, self.now(), self.membership.summary(), self.outliers.breakers) \
            | self.autotune.health() | self.transfers.health()
