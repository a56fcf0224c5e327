"""A real engine server (vLLM; SGLang through :mod:`thunderagent.execution.sglang`) as a worker.

One :class:`EngineWorker` per server, composing three parts, one per connection:

- **requests** (:mod:`~thunderagent.execution.engine_requests`): completions streamed over HTTP, and
  the in-flight accounting that makes the worker's load count a request from the moment it is
  dispatched;
- **KV events** (:mod:`~thunderagent.execution.kv_pump`): the engine's ZMQ PUB and replay ROUTER
  endpoints, through a :class:`~thunderagent.execution.kv_stream.KvEventStream`, out as our events;
- **load and health** (:mod:`~thunderagent.execution.engine_poll`): the engine's ``/metrics`` polled
  every heartbeat interval, keepalives, and the refusals that keep the worker out of routing
  (unreachable, block-size mismatch).

The HTTP calls go through an :class:`~thunderagent.execution.http_transport.HttpTransport` (aiohttp
unless one is given). Needs the ``engines`` extra (pyzmq) for KV events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from thunderagent.config import Config, EndpointConfig, NodeConfig
from thunderagent.config.auth import server_api_key
from thunderagent.execution.engine_metrics import VLLM, EngineFlavor
from thunderagent.execution.engine_poll import REASON_BLOCK_SIZE, REASON_UNREACHABLE, EnginePoller
from thunderagent.execution.engine_requests import RequestStreamer, request_body
from thunderagent.execution.server_admin import adapter_server, call_server, pause_server, reset_server, sleep_effect
from thunderagent.execution.handle import (
    AdminResult,
    OutputQueue,
    WorkerCallbacks,
    WorkerFactory,
    WorkerHandle,
    cancel_and_wait,
)
from thunderagent.execution.http_transport import AiohttpTransport, HttpTransport, TransportError
from thunderagent.execution.kv_pump import KvPump, require_pyzmq
from thunderagent.execution.kv_stream import KvEventStream, StreamStats, StreamStep
from thunderagent.execution.openai_relay import Relay
from thunderagent.types import EngineRequest, LoadReport

__all__ = ["REASON_BLOCK_SIZE", "REASON_UNREACHABLE", "EngineWorker", "engine_factory"]

log = logging.getLogger(__name__)


class EngineWorker:
    """:class:`~thunderagent.execution.handle.WorkerHandle` of one vLLM / SGLang server.

    ``transport`` replaces the aiohttp transport (whose session opens in :meth:`start`); the caller
    keeps ownership of a transport it passes.
    """

    def __init__(
        self,
        worker_id: str,
        node: NodeConfig,
        endpoint: EndpointConfig,
        callbacks: WorkerCallbacks,
        *,
        heartbeat_interval: float,
        flavor: EngineFlavor = VLLM,
        replay_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        transport: HttpTransport | None = None,
        double_hash: bool = True,
        lease: float | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.node = node
        self.endpoint = endpoint
        self.flavor = flavor
        self.url = endpoint.url.rstrip("/")
        self.stream = KvEventStream(worker_id, node.block_size, can_replay=endpoint.kv_replay is not None,
                                    checks=double_hash)  # events carry check hashes for the guard (kv.check)
        self._cb = callbacks
        self._own_transport: AiohttpTransport | None = None
        if transport is None:  # (the server's API key is read now: a missing one stops the start, naming it)
            key = server_api_key(endpoint.api_key_env, endpoint.api_key_file, endpoint.url)
            transport = self._own_transport = AiohttpTransport(connect_timeout, key, endpoint.data_parallel_rank)
        self._transport = transport
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health = EnginePoller(
            worker_id, self.url, node.block_size, flavor, self._transport, callbacks,
            interval=heartbeat_interval, connect_timeout=connect_timeout, load=self.load,
            on_restart=self._on_engine_restart, in_flight=lambda: self._requests.queues(), lease=lease,
            engine=None if endpoint.data_parallel_rank is None else str(endpoint.data_parallel_rank),
        )
        self._requests = RequestStreamer(
            worker_id, self.url, flavor, self._transport, clock=callbacks.clock, loop_time=self._loop_time,
            served_model=self._health.served_model, on_lost=self._health.lost, on_change=self._push_load,
            send_priority=node.scheduling_policy == "priority",
        )
        if node.relay != "off":  # requests relayed with the client's body (all, or those the token path lacks)
            self._requests.relay = Relay(self._requests, rewrite=True)
        self._pump = None
        if endpoint.kv_events:
            self._pump = KvPump(worker_id, endpoint.kv_events, endpoint.kv_replay, self.stream, self._publish,
                                replay_timeout=replay_timeout)

    @property
    def refused(self) -> str | None:
        """Reason code while this worker keeps itself out of routing (None: routable)."""
        return self._health.refused

    @property
    def _reachable(self) -> bool | None:
        return self._health.reachable  # None: not polled yet

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._own_transport is not None:
            self._own_transport.open()
        self._tasks = [
            asyncio.create_task(self._supervise(self._health.poll_loop), name=f"poll-{self.worker_id}"),
            asyncio.create_task(self._supervise(self._health.keepalive_loop), name=f"keepalive-{self.worker_id}"),
        ]
        if self._pump is not None:
            require_pyzmq()
            self._tasks.append(
                asyncio.create_task(self._supervise(self._pump.events_loop), name=f"kv-events-{self.worker_id}")
            )
        else:
            log.info("%s: no kv_events endpoint: the index knows only the router's predictions", self.worker_id)

    async def _supervise(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop forever: a bug in one pass is logged and the loop restarts, so a
        worker never goes silently deaf (its heartbeats or events would stop for good)."""
        while True:
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: %s failed; restarting it", self.worker_id, loop.__name__)
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self._requests.abort_all()
        if self._own_transport is not None:
            await self._own_transport.close()

    # -- WorkerHandle ------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> OutputQueue:
        hit = self.stream.leading_cached(req.block_hashes) * self.node.block_size
        return self._requests.submit(req, min(hit, len(req.prompt_tokens)))

    def abort(self, request_id: str) -> None:
        self._requests.abort(request_id)

    async def reset_prefix_cache(self, running: bool, external: bool) -> AdminResult:
        # (with KV events, vLLM's AllBlocksCleared follows: with its engine's next step, when it steps)
        return await reset_server(self._transport, self.url, self.flavor.name, running, external)

    async def set_paused(self, paused: bool, mode: str, clear_cache: bool) -> AdminResult:
        r = await pause_server(self._transport, self.url, self.flavor.name, paused, mode, clear_cache)
        if r.success:
            self._health.marks_changed()  # (a poll already under way may read the state before it)
        return r

    def marks_changed(self) -> None:
        """Its server was paused, resumed, put to sleep or woken through another worker (a data-parallel rank's):
        a poll begun before that is stale about it."""
        self._health.marks_changed()

    async def server_call(self, path: str, query: str = "", body: bytes = b"") -> AdminResult:
        r = await call_server(self._transport, self.url, self.flavor.name, path, query, body)
        if r.success and sleep_effect(path, query, r.answer)[0] is not None:
            self._health.marks_changed()  # (a poll already under way may read the state before it)
        return r

    async def set_adapter(self, name: str, path: str | None, inplace: bool) -> AdminResult:
        r = await adapter_server(self._transport, self.url, self.flavor.name, name, path, inplace)
        if r.success:  # its model list read now: routing sends the adapter's requests here (or no more) at once
            try:
                await self._health.fetch_model()
            except (TransportError, ValueError, KeyError) as e:  # (the next polls read it)
                log.warning("%s: model list not read after the adapter change: %r", self.worker_id, e)
        return r

    def load(self) -> LoadReport:
        s = self._health.stats
        reqs = self._requests
        # The engine's counts include requests of other clients but lag by up to one poll; ours are
        # exact for what we sent. max() keeps both without counting a request twice.
        running = max(s.running, reqs.n_started)
        waiting = max(s.waiting, len(reqs) - running)
        total = s.num_blocks or self.node.kv_blocks
        assert self._loop is not None, "start() was not called"
        return LoadReport(
            self.worker_id, self._loop.time(), running, waiting, reqs.queued_tokens, reqs.decode_tokens,
            round(s.kv_usage * total), len(self.stream.translator), total,
        )

    def snapshot(self) -> tuple[list[int], int, list[int] | None] | None:
        return self.stream.snapshot()

    def kv_stream_stats(self) -> StreamStats:
        """How its engine's KV-event stream went (batches, gaps replayed, catch-ups, resyncs...)."""
        return self.stream.stats

    # -- glue between the parts --------------------------------------------------------------
    def _body(self, req: EngineRequest, model: str) -> dict[str, Any]:
        return request_body(req, model, self.flavor, send_priority=self._requests.send_priority)

    def _loop_time(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0

    def _push_load(self) -> None:
        # Called on every submission, first output and end of a request (three times per request).
        # With ``on_load_stale`` the report is built once, when the registry is next read (a routing
        # decision, the health tick): that read sees load() at that moment, every field current,
        # never older than the report an eager push here would have left.
        if self.refused is None:
            stale = self._cb.on_load_stale
            if stale is not None:
                stale(self.worker_id, self.load)
            else:
                self._cb.on_load(self.worker_id, self.load())

    def _publish(self, step: StreamStep) -> None:
        if step.events:
            self._cb.on_events(self.worker_id, step.events)
        if self.stream.mismatch is not None:
            self._health.block_size_mismatch(self.stream.mismatch[0])

    def _on_engine_restart(self) -> None:
        self._publish(self.stream.engine_restarted())


def engine_factory(cfg: Config, flavor: EngineFlavor = VLLM) -> WorkerFactory:
    """The factory the fleet uses for nodes whose ``engine`` is ``flavor.name``."""

    def make(node: NodeConfig, worker_id: str, k: int, callbacks: WorkerCallbacks) -> WorkerHandle:
        return EngineWorker(worker_id, node, node.endpoints[k], callbacks,
                            heartbeat_interval=cfg.control_plane.heartbeat_interval, flavor=flavor,
                            lease=cfg.control_plane.heartbeat_interval * cfg.control_plane.heartbeat_misses,
                            double_hash=cfg.routing.double_hash)

    return make
