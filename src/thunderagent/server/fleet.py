"""The in-process control plane: registry + index + router in front of local workers.

This is the object graph ``thunderagent serve`` runs: it builds one :class:`WorkerHandle` per
configured worker (through the factory registered for the node's ``engine`` kind; the simulated
engine's is built in), feeds their KV events into the :class:`KvIndex` and their heartbeats into the
:class:`WorkerRegistry`, runs the health check, and turns a tokenized prompt into a routed, streaming
generation. The HTTP layer (``server.app``) only parses and formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from thunderagent.config import Config, NodeConfig, Policy, Role
from thunderagent.control.registry import Health, WorkerInfo, WorkerRegistry
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.kv.hashing import block_hashes, hash_seed
from thunderagent.kv.index import EventResult, KvIndex
from thunderagent.router.router import KvRouter, NoWorkerAvailable
from thunderagent.server.local_worker import LocalWorker, ScaledClock
from thunderagent.server.worker_handle import UNAVAILABLE, WorkerCallbacks, WorkerFactory, WorkerHandle
from thunderagent.server.metrics import Metrics
from thunderagent.server.stops import StopMatcher
from thunderagent.server.tokenizer import ByteTokenizer, Tokenizer
from thunderagent.types import (
    Decision,
    EngineRequest,
    KvEvent,
    LoadReport,
    RouteRequest,
    Sampling,
    TokenOutput,
    WorkerState,
)

log = logging.getLogger(__name__)

__all__ = ["Fleet", "Generation", "NoWorkerAvailable", "TextChunk"]


@dataclass(slots=True)
class Generation:
    request_id: str
    decision: Decision
    worker: WorkerHandle
    queue: asyncio.Queue[TokenOutput]
    prompt_tokens: int
    best_known_tokens: int  # most prompt tokens any worker held per the index at routing time
    received: float  # loop time the request arrived
    request: EngineRequest | None = None  # what was submitted (routed again if its worker cannot take it)
    tried: tuple[str, ...] = ()  # workers that could not take it


@dataclass(slots=True)
class TextChunk:
    text: str
    finish_reason: str | None
    completion_tokens: int
    cached_tokens: int


class Fleet:
    def __init__(self, cfg: Config, *, policy: Policy | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.model_name = cfg.model_name
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.metrics = Metrics()
        self.index = KvIndex(prediction_ttl=cfg.routing.prediction_ttl)
        self.router = KvRouter(cfg.routing, self.index, random.Random(cfg.routing.seed), policy)
        cp = cfg.control_plane
        self.registry = WorkerRegistry(cp.heartbeat_interval, cp.heartbeat_misses)
        self.block_size = cfg.execution_group.nodes[0].block_size
        #: longest sequence any worker can hold (simulated workers: their KV pool); None = unknown
        self.max_context_tokens: int | None = (
            max(n.kv_blocks * n.block_size for n in cfg.execution_group.nodes)
            if all(n.engine == "simulated" for n in cfg.execution_group.nodes) else None
        )
        self.workers: dict[str, WorkerHandle] = {}
        self.factories: dict[str, WorkerFactory] = {"simulated": self._simulated_worker}
        self._clock: ScaledClock | None = None
        self._ids = itertools.count()
        self._health_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: workers that reported they cannot serve (reason); back in routing with their next heartbeat
        self._unavailable: dict[str, str] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def _simulated_worker(self, node: NodeConfig, wid: str, k: int, cb: WorkerCallbacks) -> WorkerHandle:
        if self._clock is None:
            self._clock = ScaledClock(self.cfg.simulation.speedup, self._loop)
        engine = SimulatedEngine(wid, node, eos_token_id=self.tokenizer.eos_token_id)
        return LocalWorker(engine, self._clock, cb.on_events, cb.on_heartbeat, self.cfg.control_plane.heartbeat_interval)

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        callbacks = WorkerCallbacks(self._on_events, self._on_heartbeat, self._on_unavailable)
        n = 0
        for node in self.cfg.execution_group.nodes:
            if node.role is not Role.both:
                log.warning(
                    "role %s: prefill/decode disaggregation is not implemented yet; "
                    "these workers serve requests end to end", node.role.value,
                )
            factory = self.factories.get(node.engine)
            if factory is None:
                raise ValueError(f"no worker factory for engine kind {node.engine!r}")
            for k in range(node.count):
                wid = f"worker-{n}"
                n += 1
                worker = factory(node, wid, k, callbacks)
                info = WorkerInfo(
                    wid, node.role.value, node.block_size, node.max_num_batched_tokens,
                    node.queue_depth_threshold, node.kv_blocks,
                )
                self.registry.register(info, loop.time())
                self.index.add_worker(wid)
                self.workers[wid] = worker
                worker.start()
        if self.cfg.control_plane.health_check_enabled:
            self._health_task = asyncio.create_task(self._health_loop(), name="health")
        log.info("fleet up: %d workers, policy %s", n, self.router.policy.name)

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for w in self.workers.values():
            await w.stop()

    def now(self) -> float:
        assert self._loop is not None, "Fleet.start() was not awaited"
        return self._loop.time()

    # -- control plane inputs ----------------------------------------------------------------
    def _on_events(self, worker_id: str, events: list[KvEvent]) -> None:
        now = self.now()
        for ev in events:
            if self.index.apply_event(ev, now) is EventResult.GAP:
                log.warning("KV event gap from %s at seq %d: resyncing its index entries", worker_id, ev.seq)
                self._resync(worker_id)

    def _resync(self, worker_id: str) -> None:
        snap = self.workers[worker_id].snapshot()
        if snap is not None:
            self.index.resync(worker_id, *snap)

    def _on_heartbeat(self, worker_id: str, load: LoadReport) -> None:
        reason = self._unavailable.pop(worker_id, None)
        if reason is not None:
            log.info("worker %s serves again (was %s): back in routing", worker_id, reason)
            self.metrics.out_of_routing.labels(worker_id, reason).set(0)
        self.registry.heartbeat(worker_id, load, self.now())
        self.metrics.observe_load(load, self.registry.health(worker_id) is Health.healthy)

    def _on_unavailable(self, worker_id: str, reason: str) -> None:
        old = self._unavailable.get(worker_id)
        if old == reason:
            return
        if old is not None:
            self.metrics.out_of_routing.labels(worker_id, old).set(0)
        self._unavailable[worker_id] = reason
        self.metrics.out_of_routing.labels(worker_id, reason).set(1)
        log.warning("worker %s out of routing: %s", worker_id, reason)

    def _routable(self, exclude: tuple[str, ...] = ()) -> list[WorkerState]:
        out = self._unavailable
        return [w for w in self.registry.routable() if w.worker_id not in out and w.worker_id not in exclude]

    def check_health(self) -> None:
        for change in self.registry.check(self.now()):
            wid = change.worker_id
            if change.health is Health.unhealthy:
                purged = self.index.remove_worker(wid)
                log.warning("worker %s unhealthy (%s): out of routing, %d index entries purged",
                            wid, change.reason, purged)
            else:
                self.index.add_worker(wid)
                self._resync(wid)
                log.info("worker %s healthy again (%s): back in routing", wid, change.reason)
            self.metrics.healthy.labels(wid).set(1 if change.health is Health.healthy else 0)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.control_plane.heartbeat_interval / 2)
            self.check_health()

    # -- requests ----------------------------------------------------------------------------
    def start_generation(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        ignore_eos: bool = False,
        sampling: Sampling | None = None,
    ) -> Generation:
        """Hash once, route, submit. Raises NoWorkerAvailable."""
        received = self.now()
        t0 = time.perf_counter()
        rid = f"{next(self._ids):08x}-{random.getrandbits(32):08x}"
        seed = hash_seed(cache_salt, lora_name)
        hashes = block_hashes(prompt_ids, self.block_size, seed)
        for wid, w in self.workers.items():  # in-process: read load synchronously, fresher than heartbeats
            self.registry.update_load(wid, w.load())
        decision = self.router.route(RouteRequest(rid, len(prompt_ids), hashes, priority), self._routable(), received)
        elapsed = time.perf_counter() - t0
        best = max((c.overlap_blocks for c in decision.candidates), default=0)
        best_tokens = min(best, (len(prompt_ids) - 1) // self.block_size) * self.block_size  # last token recomputed
        predicted = min(decision.overlap_blocks * self.block_size, len(prompt_ids))
        self.metrics.observe_route(decision.worker_id, len(prompt_ids), predicted, elapsed)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s -> %s (%s): %s", rid, decision.worker_id, decision.reason, decision.explain())
        worker = self.workers[decision.worker_id]
        req = EngineRequest(rid, prompt_ids, hashes, seed, max_tokens, ignore_eos=ignore_eos, priority=priority,
                            cache_salt=cache_salt, lora_name=lora_name, sampling=sampling)
        queue = worker.submit(req)
        return Generation(rid, decision, worker, queue, len(prompt_ids), best_tokens, received, req)

    def _route_again(self, gen: Generation) -> bool:
        """Submit ``gen``'s request to another worker after its worker could not take it (nothing
        was streamed yet). False when no other worker is left."""
        req = gen.request
        if req is None:
            return False
        tried = (*gen.tried, gen.worker.worker_id)
        try:
            decision = self.router.route(
                RouteRequest(req.request_id, len(req.prompt_tokens), req.block_hashes, req.priority),
                self._routable(tried), self.now(),
            )
        except NoWorkerAvailable:
            return False
        log.info("request %s: %s could not take it, routed again to %s", req.request_id, gen.worker.worker_id,
                 decision.worker_id)
        self.metrics.rerouted.inc()
        worker = self.workers[decision.worker_id]
        gen.decision, gen.worker, gen.tried = decision, worker, tried
        gen.queue = worker.submit(req)
        return True

    async def stream_text(self, gen: Generation, stops: list[str]) -> AsyncIterator[TextChunk]:
        """Detokenized text of a generation, with stop sequences applied. The engine request is
        aborted if the consumer stops early (client gone) or a stop sequence matches."""
        decoder = self.tokenizer.decoder()
        matcher = StopMatcher(stops)
        completion = 0
        cached = 0
        last_t: float | None = None
        finished = False
        try:
            while True:
                out = await gen.queue.get()
                now = self.now()
                if (last_t is None and out.finished and out.finish_reason == UNAVAILABLE and not out.token_ids
                        and self._route_again(gen)):
                    continue
                # real engines report cached tokens with their last output, simulated ones with the first
                cached = max(cached, out.cached_tokens)
                if last_t is None:
                    if out.token_ids or out.finished:
                        self.metrics.ttft.observe(now - gen.received)
                else:
                    self.metrics.itl.observe(now - last_t)
                last_t = now
                completion += len(out.token_ids)
                text = matcher.feed(out.text if out.text is not None else decoder.feed(out.token_ids))
                if matcher.stopped:
                    finished = True
                    yield TextChunk(text, "stop", completion, cached)
                    return
                if out.finished:
                    finished = True
                    text += matcher.feed(decoder.flush())
                    if matcher.stopped:
                        yield TextChunk(text, "stop", completion, cached)
                        return
                    text += matcher.flush()
                    yield TextChunk(text, out.finish_reason or "stop", completion, cached)
                    return
                if text:
                    yield TextChunk(text, None, completion, cached)
        finally:
            if last_t is not None:
                self.metrics.observe_prefill(cached, gen.best_known_tokens)
            if not finished or matcher.stopped:
                gen.worker.abort(gen.request_id)

    def health_summary(self) -> dict[str, object]:
        loads = self.registry.loads()
        workers = [
            {
                "id": wid,
                "health": self.registry.health(wid).value,
                "running": loads[wid].running,
                "waiting": loads[wid].waiting,
                "kv_usage": round(loads[wid].kv_usage, 4),
                "indexed_blocks": self.index.num_blocks(wid),
                "out_of_routing": self._unavailable.get(wid),  # reason a worker gave (unreachable, ...)
            }
            for wid in self.registry.worker_ids()
        ]
        healthy = sum(1 for w in workers if w["health"] == Health.healthy.value and not w["out_of_routing"])
        return {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy, "workers": workers}
