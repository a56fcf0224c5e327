"""A real engine server (vLLM; SGLang through :mod:`engine.sglang`) as a worker.

One :class:`EngineWorker` per server, three connections:

- **requests**: ``POST {url}/v1/completions`` with the prompt as *token ids* (tokenized by our
  frontend with the model's tokenizer and chat template, so our block hashes describe exactly the
  tokens the engine caches), streamed back (SSE) with the engine's text, token ids and, at the end,
  ``usage.prompt_tokens_details.cached_tokens`` (vLLM: only with ``--enable-prompt-tokens-details``);
- **KV events**: a ZMQ SUB socket on the engine's PUB endpoint, and a DEALER socket on its replay
  ROUTER endpoint; frames go through :class:`~thunderagent.execution.kv_events.KvEventStream` (gaps,
  duplicates, replay, restarts) and come out as our events;
- **load**: the engine's Prometheus ``/metrics`` (running, waiting, KV usage, and vLLM's
  ``cache_config_info``: block size, number of KV blocks, prefix caching), polled every heartbeat
  interval and merged with our own in-flight accounting, which counts a request from the moment it
  is dispatched (the engine's numbers are up to one interval old).

Every successful poll is a heartbeat. A server that cannot be reached stops heartbeating and leaves
routing once the registry's timeout expires; a request it refused to accept before any output
(connection refused, 5xx) ends with ``finish_reason="unavailable"``, which the fleet routes again to
another worker, and the worker is kept out of routing until it heartbeats again. A block-size
mismatch (from ``cache_config_info`` or from an event) keeps the worker out of routing for good,
with an error log line naming the setting to change.

Needs the ``engines`` extra (pyzmq) for KV events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from thunderagent.config import Config, EndpointConfig, NodeConfig
from thunderagent.execution.engine_metrics import VLLM, EngineFlavor, EngineStats, engine_stats
from thunderagent.execution.kv_events import KvEventStream, StreamStep
from thunderagent.execution.handle import (
    KEEPALIVE_S,
    OutputQueue,
    WorkerCallbacks,
    WorkerFactory,
    WorkerHandle,
    cancel_and_wait,
)
from thunderagent.types import EngineRequest, FinishReason, LoadReport, TokenOutput

log = logging.getLogger(__name__)

#: reasons a worker keeps itself out of routing (the metric's label)
REASON_UNREACHABLE = "unreachable"
REASON_BLOCK_SIZE = "block_size_mismatch"


# ---------------------------------------------------------------------------------------------
# The worker handle
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True, eq=False)
class _Inflight:
    req: EngineRequest
    queue: OutputQueue
    expected_hit_tokens: int  # prompt tokens the engine holds per its events, at dispatch
    started: bool = False  # first output seen (prefill done)
    generated: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


_json = msgspec.json.Decoder()
#: finish reasons an engine may report that we pass on as they are (others count as "stop")
_REASONS = frozenset(r.value for r in FinishReason)


class EngineWorker:
    """:class:`~thunderagent.execution.handle.WorkerHandle` of one vLLM / SGLang server."""

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
    ) -> None:
        self.worker_id = worker_id
        self.node = node
        self.endpoint = endpoint
        self.flavor = flavor
        self.url = endpoint.url.rstrip("/")
        self.stream = KvEventStream(worker_id, node.block_size, can_replay=endpoint.kv_replay is not None)
        self._cb = callbacks
        self._interval = heartbeat_interval
        self._replay_timeout = replay_timeout
        self._connect_timeout = connect_timeout
        self._reqs: dict[str, _Inflight] = {}
        # In-flight totals kept incrementally: load() runs for every worker on every routing decision.
        self._n_started = 0
        self._queued_tokens = 0  # prompt tokens of requests not started, less their expected hits
        self._decode_tokens = 0  # sequence lengths of started requests
        self._stats = EngineStats()
        self._model: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reachable: bool | None = None  # None: not polled yet
        self._last_poll_ok: float | None = None  # control-plane time of the last answered poll
        #: reason code while this worker keeps itself out of routing (None: routable)
        self.refused: str | None = None
        self._warned_prefix = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # limit=0: one connection per streaming request, no cap (the router bounds the load). No read
        # timeout on the session: a request may wait in the engine's queue for long; a hung engine is
        # caught by the liveness rule instead (no keepalives once its metrics stop answering).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout),
        )
        self._tasks = [asyncio.create_task(self._supervise(self._poll_loop), name=f"poll-{self.worker_id}"),
                       asyncio.create_task(self._supervise(self._keepalive_loop), name=f"keepalive-{self.worker_id}")]
        if self.endpoint.kv_events:
            try:
                import zmq.asyncio  # noqa: F401
            except ImportError as exc:  # pragma: no cover - depends on the install
                raise RuntimeError("KV events need pyzmq: pip install -e '.[engines]'") from exc
            self._tasks.append(
                asyncio.create_task(self._supervise(self._events_loop), name=f"kv-events-{self.worker_id}")
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
        pending = []
        for rid in list(self._reqs):
            r = self._drop(rid)
            assert r is not None
            if r.task is not None:
                r.task.cancel()
                pending.append(r.task)
            r.queue.put_output(self._final(r, [], None, FinishReason.ABORT, 0), self._cb.clock())
        await asyncio.gather(*pending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # -- WorkerHandle ------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> OutputQueue:
        q = OutputQueue(self._cb.clock())
        hit = self.stream.leading_cached(req.block_hashes) * self.node.block_size
        r = _Inflight(req, q, min(hit, len(req.prompt_tokens)))
        self._reqs[req.request_id] = r
        self._queued_tokens += len(req.prompt_tokens) - r.expected_hit_tokens
        r.task = asyncio.create_task(self._generate(r), name=f"req-{req.request_id}")
        self._push_load()
        return q

    def abort(self, request_id: str) -> None:
        r = self._drop(request_id)
        if r is not None and r.task is not None:
            r.task.cancel()  # closes the HTTP stream: the engine aborts the request

    def _push_load(self) -> None:
        if self.refused is None:
            self._cb.on_load(self.worker_id, self.load())

    def load(self) -> LoadReport:
        s = self._stats
        # The engine's counts include requests of other clients but lag by up to one poll; ours are
        # exact for what we sent. max() keeps both without counting a request twice.
        running = max(s.running, self._n_started)
        waiting = max(s.waiting, len(self._reqs) - running)
        total = s.num_blocks or self.node.kv_blocks
        assert self._loop is not None, "start() was not called"
        return LoadReport(
            self.worker_id, self._loop.time(), running, waiting, self._queued_tokens, self._decode_tokens,
            round(s.kv_usage * total), len(self.stream.translator), total,
        )

    # -- in-flight accounting ----------------------------------------------------------------
    def _progress(self, r: _Inflight, n_tokens: int) -> None:
        """``r`` produced ``n_tokens`` (its first output moves it from queued to decoding)."""
        if not r.started:
            r.started = True
            if self._reqs.get(r.req.request_id) is r:
                self._n_started += 1
                self._queued_tokens -= len(r.req.prompt_tokens) - r.expected_hit_tokens
                self._decode_tokens += len(r.req.prompt_tokens)
                self._push_load()
        r.generated += n_tokens
        if self._reqs.get(r.req.request_id) is r:
            self._decode_tokens += n_tokens

    def _drop(self, request_id: str) -> _Inflight | None:
        r = self._reqs.pop(request_id, None)
        if r is not None:
            if r.started:
                self._n_started -= 1
                self._decode_tokens -= len(r.req.prompt_tokens) + r.generated
            else:
                self._queued_tokens -= len(r.req.prompt_tokens) - r.expected_hit_tokens
            self._push_load()
        return r

    def snapshot(self) -> tuple[list[int], int] | None:
        return self.stream.snapshot()

    # -- requests ----------------------------------------------------------------------------
    def _body(self, req: EngineRequest, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": req.lora_name or model,
            "prompt": req.prompt_tokens,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.flavor.return_token_ids:
            body["return_token_ids"] = True
        if req.ignore_eos:
            body["ignore_eos"] = True
        if req.cache_salt:
            body["cache_salt"] = req.cache_salt
        if req.sampling is not None:  # only what the client set: vLLM's defaults otherwise
            for key in ("temperature", "top_p", "seed"):
                value = getattr(req.sampling, key)
                if value is not None:
                    body[key] = value
        return body

    async def _generate(self, r: _Inflight) -> None:
        req = r.req
        assert self._session is not None
        try:
            model = self._model or await self._fetch_model()
            async with self._session.post(f"{self.url}/v1/completions", json=self._body(req, model)) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:300]
                    log.warning("%s refused request %s: HTTP %d %s", self.worker_id, req.request_id,
                                resp.status, detail)
                    self._end(r, FinishReason.UNAVAILABLE if resp.status >= 500 else FinishReason.ERROR)
                    return
                r.queue.accepted = True
                await self._read_stream(resp, r)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            if r.started:
                log.warning("%s: request %s broke off: %r", self.worker_id, req.request_id, exc)
                self._end(r, FinishReason.ERROR)
            else:
                if isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(exc, TimeoutError):
                    # refused, reset, server gone
                    self._lost(f"request {req.request_id} failed: {exc!r}")
                else:
                    log.warning("%s: request %s failed: %r", self.worker_id, req.request_id, exc)
                self._end(r, FinishReason.UNAVAILABLE)
        finally:
            if self._reqs.get(req.request_id) is r:
                self._drop(req.request_id)

    async def _read_stream(self, resp: aiohttp.ClientResponse, r: _Inflight) -> None:
        loop = self._loop
        assert loop is not None
        clock = self._cb.clock
        rid = r.req.request_id
        n_prompt = len(r.req.prompt_tokens)
        final: tuple[list[int], str, str] | None = None
        cached = 0
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = _json.decode(data)
            if "error" in chunk:
                log.warning("%s: request %s failed in the engine: %s", self.worker_id, rid, chunk["error"])
                self._end(r, FinishReason.ERROR)
                return
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in chunk.get("choices") or ():
                text = choice.get("text") or ""
                ids = choice.get("token_ids")
                if ids is None:  # engine without token ids in the stream: one token per chunk
                    ids = [-1] if text else []
                reason = choice.get("finish_reason")
                if reason is not None:
                    final = (ids, text, FinishReason(reason) if reason in _REASONS else FinishReason.STOP)
                elif ids or text:
                    self._progress(r, len(ids))
                    r.queue.put_output(TokenOutput(rid, ids, loop.time(), n_prompt, 0, text=text), clock())
        if final is None:
            log.warning("%s: stream of request %s ended without a finish reason", self.worker_id, rid)
            self._end(r, FinishReason.ERROR if r.started else FinishReason.UNAVAILABLE)
            return
        self._progress(r, len(final[0]))
        r.queue.put_output(self._final(r, final[0], final[1], final[2], cached), clock())

    def _final(self, r: _Inflight, ids: list[int], text: str | None, reason: FinishReason,
               cached: int) -> TokenOutput:
        loop_time = self._loop.time() if self._loop is not None else 0.0
        return TokenOutput(r.req.request_id, ids, loop_time, len(r.req.prompt_tokens), cached, True, reason,
                           text=text)

    def _end(self, r: _Inflight, reason: FinishReason) -> None:
        r.queue.put_output(self._final(r, [], "", reason, 0), self._cb.clock())

    async def _fetch_model(self) -> str:
        """The served model name (vLLM: ``--served-model-name``, by default the model path)."""
        assert self._session is not None
        async with self._session.get(f"{self.url}/v1/models",
                                     timeout=aiohttp.ClientTimeout(total=self._connect_timeout)) as resp:
            resp.raise_for_status()
            body = await resp.json()
        self._model = str(body["data"][0]["id"])
        return self._model

    # -- load and health ---------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=max(1.0, 2 * self._interval))
        while True:
            try:
                async with self._session.get(f"{self.url}/metrics", timeout=timeout) as resp:
                    resp.raise_for_status()
                    text = await resp.text()
                if self._model is None:
                    await self._fetch_model()
            except TimeoutError as exc:  # a busy engine answers late: skip this heartbeat
                log.debug("%s: metrics poll timed out: %r", self.worker_id, exc)
            except aiohttp.ClientConnectionError as exc:  # refused, reset: the server is gone
                self._lost(f"{self.url} unreachable: {exc!r}")
            except (aiohttp.ClientError, ValueError, KeyError) as exc:
                # slow or odd answer: no heartbeat this time (the registry counts the misses)
                log.debug("%s: metrics poll failed: %r", self.worker_id, exc)
            else:
                self._last_poll_ok = self._cb.clock()
                self._on_stats(engine_stats(text, self.flavor))
            await asyncio.sleep(self._interval)

    async def _keepalive_loop(self) -> None:
        """Vouch for the requests in flight while the engine answers its metrics polls: a hung
        engine (stopped, deadlocked) stops answering, its requests stop being touched, and the
        fleet's stall check ends them."""
        fresh = max(KEEPALIVE_S, 2 * self._interval)
        while True:
            await asyncio.sleep(KEEPALIVE_S / 2)
            now = self._cb.clock()
            if self._last_poll_ok is not None and now - self._last_poll_ok <= fresh:
                for r in self._reqs.values():
                    r.queue.touch(now)

    def _lost(self, why: str) -> None:
        if self._reachable is not False:
            log.warning("%s: %s; out of routing until it answers again", self.worker_id, why)
        self._reachable = False
        self._refuse(REASON_UNREACHABLE)

    def _on_stats(self, s: EngineStats) -> None:
        old = self._stats
        if old.start_time is not None and s.start_time is not None and s.start_time != old.start_time:
            log.warning("%s: engine restarted (new process): its cache is empty", self.worker_id)
            self._publish(self.stream.engine_restarted())
            self._model = None
            if self.refused == REASON_BLOCK_SIZE:
                self._accept()
        if self._reachable is False:
            log.info("%s: %s answers again", self.worker_id, self.url)
        self._reachable = True
        self._stats = s
        if s.prefix_caching is False and not self._warned_prefix:
            self._warned_prefix = True
            log.error("%s: the engine runs without prefix caching: no cache to route to (start it with "
                      "--enable-prefix-caching)", self.worker_id)
        if s.block_size is not None and s.block_size != self.node.block_size:
            self._block_size_mismatch(s.block_size)
        if self.refused == REASON_UNREACHABLE:
            self._accept()
        if self.refused is None:
            self._cb.on_heartbeat(self.worker_id, self.load())

    def _block_size_mismatch(self, engine_bs: int) -> None:
        if self.refused != REASON_BLOCK_SIZE:
            log.error(
                "%s: engine KV block size %d differs from the configured block_size %d: not routing to it "
                "(set execution_group.nodes[].block_size / --block-size to %d, or start the engine with "
                "--block-size %d)", self.worker_id, engine_bs, self.node.block_size, engine_bs,
                self.node.block_size,
            )
        self._refuse(REASON_BLOCK_SIZE)

    def _refuse(self, reason: str) -> None:
        if self.refused == REASON_BLOCK_SIZE and reason != REASON_BLOCK_SIZE:
            return  # a configuration error outranks a transient one
        if self.refused != reason:
            self.refused = reason
            self._cb.on_unavailable(self.worker_id, reason)

    def _accept(self) -> None:
        self.refused = None  # the next heartbeat puts it back into routing

    # -- KV events ---------------------------------------------------------------------------
    def _publish(self, step: StreamStep) -> None:
        if step.events:
            self._cb.on_events(self.worker_id, step.events)
        if self.stream.mismatch is not None:
            self._block_size_mismatch(self.stream.mismatch[0])

    async def _events_loop(self) -> None:
        import zmq
        import zmq.asyncio

        assert self._loop is not None and self.endpoint.kv_events
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint.kv_events)
        dealer = None
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        if self.endpoint.kv_replay:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.endpoint.kv_replay)
            poller.register(dealer, zmq.POLLIN)
        deadline: float | None = None  # replay answer expected by then
        loop = self._loop

        def handle(step: StreamStep) -> None:
            nonlocal deadline
            self._publish(step)
            if step.replay_from is not None and dealer is not None:
                dealer.send_multipart([b"", step.replay_from.to_bytes(8, "big")])
                deadline = loop.time() + self._replay_timeout
            elif not self.stream.replaying:
                deadline = None

        try:
            while True:
                timeout_ms = None if deadline is None else max(0, int((deadline - loop.time()) * 1000))
                ready = dict(await poller.poll(timeout_ms))
                # Bounded drains (1000 batches) so a burst cannot starve request handling.
                if dealer is not None and dealer in ready:
                    for _ in range(1000):
                        try:
                            frames = await dealer.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if self.stream.replaying:
                            deadline = loop.time() + self._replay_timeout  # still answering
                        handle(self.stream.on_replay(frames))
                if sub in ready:
                    for _ in range(1000):
                        try:
                            frames = await sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        handle(self.stream.on_live(frames))
                if deadline is not None and loop.time() >= deadline and self.stream.replaying:
                    log.warning("%s: replay endpoint %s did not answer within %.1fs: resyncing", self.worker_id,
                                self.endpoint.kv_replay, self._replay_timeout)
                    handle(self.stream.replay_failed())
                    deadline = None
        finally:
            ctx.destroy(linger=0)


def engine_factory(cfg: Config, flavor: EngineFlavor = VLLM) -> WorkerFactory:
    """The factory the fleet uses for nodes whose ``engine`` is ``flavor.name``."""

    def make(node: NodeConfig, worker_id: str, k: int, callbacks: WorkerCallbacks) -> WorkerHandle:
        return EngineWorker(worker_id, node, node.endpoints[k], callbacks,
                            heartbeat_interval=cfg.control_plane.heartbeat_interval, flavor=flavor)

    return make
