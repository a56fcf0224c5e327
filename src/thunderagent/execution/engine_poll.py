"""Load polling and health of one engine server (vLLM, SGLang).

The engine's Prometheus ``/metrics`` (running, waiting, KV usage, and vLLM's ``cache_config_info``:
block size, number of KV blocks, prefix caching) is polled every heartbeat interval; every answered
poll is a heartbeat, and while the polls answer the requests in flight are kept alive (touched).
With each poll vLLM's sleep gauge is read, and its ``/is_paused`` while the server answers it (dev mode):
a sleep or a pause sent to the server directly, or from before ThunderAgent started, is noticed; and its NIXL
connector's KV pulls so far (a decode server's), which teach the transfer plane its links (``control/pd_plane.py``).

A server that cannot be reached stops heartbeating and leaves routing once the registry's timeout
expires; one that refused a connection is kept out of routing (:data:`REASON_UNREACHABLE`) until
it answers a poll again. A block-size mismatch (from ``cache_config_info`` or from an event) keeps
the worker out of routing (:data:`REASON_BLOCK_SIZE`) until the engine restarts, with an error log
line naming the setting to change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from thunderagent.execution.engine_metrics import EngineFlavor, EngineStats, engine_stats
from thunderagent.execution.handle import KEEPALIVE_S, STALL_TIMEOUT_S, OutputQueue, WorkerCallbacks
from thunderagent.execution.http_transport import (HttpTransport, TransportConnectionError, TransportError,
                                                   TransportStatusError)
from thunderagent.types import LoadReport

log = logging.getLogger(__name__)

#: reasons a worker keeps itself out of routing (the metric's label)
REASON_UNREACHABLE = "unreachable"
REASON_BLOCK_SIZE = "block_size_mismatch"
#: how long one poll may take to answer (half the stall bound: a poll answered in time still leaves
#: the keepalive a round to touch the requests in flight before the fleet cuts them), lease allowing
POLL_TIMEOUT_S = STALL_TIMEOUT_S / 2
#: the model list (/v1/models: LoRA adapters loaded or unloaded at runtime) is read again every this many polls
MODELS_EVERY = 10


class EnginePoller:
    """Polls one engine server and decides whether its worker is routable (:attr:`refused`).

    ``load`` builds the worker's report for heartbeats, ``on_restart`` is called when the engine is
    a new process (its cache is empty), ``in_flight`` lists the queues of the requests to keep alive;
    ``lease`` is the fleet's heartbeat timeout (None: no lease, as under a test's recorder).
    """

    def __init__(
        self,
        worker_id: str,
        url: str,
        block_size: int,
        flavor: EngineFlavor,
        transport: HttpTransport,
        callbacks: WorkerCallbacks,
        *,
        interval: float,
        connect_timeout: float,
        load: Callable[[], LoadReport],
        on_restart: Callable[[], None],
        in_flight: Callable[[], Iterable[OutputQueue]],
        lease: float | None = None,
        engine: str | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.engine = engine  # one data-parallel rank's samples of the metrics (their ``engine`` label); None: all
        self.url = url
        self.block_size = block_size
        self.flavor = flavor
        self._transport = transport
        self._cb = callbacks
        self._interval = interval
        self._connect_timeout = connect_timeout
        self._load = load
        self._on_restart = on_restart
        self._in_flight = in_flight
        # A poll answered late still proves the server alive, and only answered polls let the
        # keepalive vouch for requests that stream nothing yet (queued, or in a long prefill). A
        # loaded server has taken 13 s to answer /metrics: abandoning a poll after two heartbeat
        # intervals would let the fleet cut a live server's requests after STALL_TIMEOUT_S. So a
        # poll waits up to half that bound, but no longer than the lease leaves (answers spaced
        # past the lease would flap the worker in and out of routing, each expiry cutting its
        # requests). A hung server is caught either way: leases and the stall check count time.
        wait = POLL_TIMEOUT_S if lease is None else min(POLL_TIMEOUT_S, lease - interval)
        self.poll_timeout = max(wait, 2 * interval, 1.0)  # as before: at least 1 s, two intervals
        self.stats = EngineStats()
        self.model: str | None = None
        self.max_model_len: int | None = None  # from /v1/models, when the server says
        self.adapters: tuple[str, ...] = ()  # names it serves (from /v1/models): its LoRA adapters, or every model
        self._polls = 0
        # model-list reads are numbered: one that started before another already applied is stale (a poll's read
        # in flight while an adapter is loaded must not put the old list back after the load's own read)
        self._reads = self._applied = 0
        self.reachable: bool | None = None  # None: not polled yet
        self.last_poll_ok: float | None = None  # control-plane time of the last answered poll
        #: reason code while this worker keeps itself out of routing (None: routable)
        self.refused: str | None = None
        self._warned_prefix = False
        self._no_metrics = False  # a server without /metrics (flavor.metrics_optional): /v1/models answers polls
        # bumped when a call through ThunderAgent changed the server's sleep or pause state (``marks_changed``): a poll
        # begun before it may carry the old state and must not undo the mark the call's answer set
        self._marks_epoch = 0
        # the server answers ``flavor.pause_state`` (vLLM in dev mode); False after a 404 until it restarts (without
        # dev mode nothing can pause it over HTTP, and asking every poll would only fill its access log)
        self.reads_pause = flavor.pause_state is not None

    # -- the served model --------------------------------------------------------------------
    async def served_model(self) -> str:
        return self.model or await self.fetch_model()

    async def fetch_model(self) -> str:
        """The served model name (vLLM: ``--served-model-name``, by default the model path)."""
        self._reads += 1
        mine = self._reads
        body = await self._transport.get_json(f"{self.url}/v1/models", self._connect_timeout)
        if mine < self._applied and self.model is not None:
            return self.model  # a read older than one applied already
        self._applied = mine
        cards = body["data"]
        # vLLM lists the base model, then each LoRA adapter with its base as ``parent``
        card = next((c for c in cards if not c.get("parent")), cards[0])
        self.model = str(card["id"])
        if self.flavor.lists_models:  # every model listed (an OpenAI-compatible server may serve several)
            adapters = tuple(sorted({str(c["id"]) for c in cards}))
        else:
            adapters = tuple(sorted(str(c["id"]) for c in cards if c.get("parent") and c is not card))
        if adapters != self.adapters:
            log.info("%s: %s serves %s %s", self.worker_id, self.url,
                     "models" if self.flavor.lists_models else "LoRA adapters", list(adapters) or "none")
            self.adapters = adapters
            if self._cb.on_adapters is not None:
                self._cb.on_adapters(self.worker_id, adapters)
        limit = card.get("max_model_len")  # vLLM's and SGLang's model cards carry it; OpenAI's has none
        if self.flavor.states_limits and type(limit) is int and limit > 0 and limit != self.max_model_len:
            log.info("%s: %s serves sequences of up to %d tokens (max_model_len)", self.worker_id, self.url, limit)
            self.max_model_len = limit
            if self._cb.on_limits is not None:
                self._cb.on_limits(self.worker_id, limit, 0)
        return self.model

    # -- loops -------------------------------------------------------------------------------
    async def poll_loop(self) -> None:
        timeout = self.poll_timeout
        while True:
            epoch = self._marks_epoch
            try:
                text = await self._metrics_text(timeout)
                self._polls += 1
                if self.model is None or self._polls % MODELS_EVERY == 0:  # adapters load and unload at runtime
                    await self.fetch_model()
            except TimeoutError as exc:  # a busy engine answers late: skip this heartbeat
                log.debug("%s: metrics poll timed out: %r", self.worker_id, exc)
            except TransportConnectionError as exc:  # refused, reset: the server is gone
                self.lost(f"{self.url} unreachable: {exc!r}")
            except (TransportError, ValueError, KeyError) as exc:
                # slow or odd answer: no heartbeat this time (the registry counts the misses)
                log.debug("%s: metrics poll failed: %r", self.worker_id, exc)
            else:
                self.last_poll_ok = self._cb.clock()
                self.on_stats(engine_stats(text, self.flavor, self.engine), epoch)
                if self.reads_pause:  # (after the heartbeat: a slow or failing answer here costs no liveness)
                    try:
                        self.pause_seen(await self._paused(timeout), epoch)
                    except Exception:  # a bug here must not stop the polls (the worker's liveness)
                        log.exception("%s: reading %s failed: not read again", self.worker_id, self.flavor.pause_state)
                        self.reads_pause = False
            await asyncio.sleep(self._interval)

    async def _paused(self, timeout: float) -> bool | None:
        """Whether the server's generation is paused (vLLM's ``GET /is_paused``); None: not said (a server that has no
        such path is not asked again until it restarts)."""
        path = self.flavor.pause_state
        try:
            got = await self._transport.get_json(f"{self.url}{path}", timeout)
        except TransportStatusError as exc:  # (a 2xx page that is not JSON comes here too: aiohttp's type check)
            if 400 <= exc.status and exc.status not in (404, 405):
                log.debug("%s: %s answered %d", self.worker_id, path, exc.status)
                return None
            got = None
        except (TimeoutError, TransportError) as exc:  # (the next poll asks again)
            log.debug("%s: %s not read: %r", self.worker_id, path, exc)
            return None
        except ValueError:  # not JSON
            got = None
        paused = got.get("is_paused") if isinstance(got, dict) else None
        if not isinstance(paused, bool):  # no such path, or not vLLM's
            log.info("%s: %s has no %s of vLLM's (it serves it with VLLM_SERVER_DEV_MODE=1): a pause is noticed only "
                     "when sent through ThunderAgent", self.worker_id, self.url, path)
            self.reads_pause = False
            return None
        return paused

    async def _metrics_text(self, timeout: float) -> str:
        if self._no_metrics:
            await self._transport.get_json(f"{self.url}/v1/models", timeout)  # liveness only
            return ""
        try:
            return await self._transport.get_text(f"{self.url}/metrics", timeout)
        except TransportStatusError as exc:
            if exc.status != 404 or not self.flavor.metrics_optional:
                raise
        log.info("%s: %s has no /metrics: load comes from the requests in flight only", self.worker_id, self.url)
        self._no_metrics = True
        return await self._metrics_text(timeout)

    async def keepalive_loop(self) -> None:
        """Vouch for the requests in flight while the engine answers its metrics polls: a hung
        engine (stopped, deadlocked) stops answering, its requests stop being touched, and the
        fleet's stall check ends them."""
        fresh = max(KEEPALIVE_S, 2 * self._interval)
        while True:
            await asyncio.sleep(KEEPALIVE_S / 2)
            now = self._cb.clock()
            if self.last_poll_ok is not None and now - self.last_poll_ok <= fresh:
                for queue in self._in_flight():
                    queue.touch(now)

    # -- health ------------------------------------------------------------------------------
    def lost(self, why: str) -> None:
        if self.reachable is not False:
            log.warning("%s: %s; out of routing until it answers again", self.worker_id, why)
        self.reachable = False
        self._refuse(REASON_UNREACHABLE)

    def marks_changed(self) -> None:
        """A sleep, wake-up, pause or resume through ThunderAgent was answered: polls begun before it are stale about
        both."""
        self._marks_epoch += 1

    def on_stats(self, s: EngineStats, epoch: int | None = None) -> None:
        """A poll's figures, the poll begun at marks ``epoch`` (None: whatever it is now)."""
        old = self.stats
        if old.start_time is not None and s.start_time is not None and s.start_time != old.start_time:
            log.warning("%s: engine restarted (new process): its cache is empty", self.worker_id)
            self._on_restart()
            self.model = None
            self.reads_pause = self.flavor.pause_state is not None  # (the new process may serve it)
            if self.refused == REASON_BLOCK_SIZE:
                self._accept()
        if self.reachable is False:
            log.info("%s: %s answers again", self.worker_id, self.url)
        self.reachable = True
        self.stats = s
        # (every poll: a mark set through ThunderAgent and then changed behind its back between two polls is seen;
        # not a poll begun before a sleep or wake-up asked through ThunderAgent: it may carry the old state)
        if s.asleep is not None and self._cb.on_asleep is not None and epoch in (None, self._marks_epoch):
            self._cb.on_asleep(self.worker_id, s.asleep)
        if s.kv_pulls is not None and self._cb.on_kv_pulls is not None:  # (a decode server's NIXL reads)
            self._cb.on_kv_pulls(self.worker_id, *s.kv_pulls)
        if s.prefill is not None and self._cb.on_prefill is not None:  # (its measured prefill rate)
            self._cb.on_prefill(self.worker_id, *s.prefill)
        if s.prefix_caching is False and not self._warned_prefix:
            self._warned_prefix = True
            log.error("%s: the engine runs without prefix caching: no cache to route to (start it with "
                      "--enable-prefix-caching)", self.worker_id)
        if s.block_size is not None and s.block_size != self.block_size:
            self.block_size_mismatch(s.block_size)
        if self.refused == REASON_UNREACHABLE:
            self._accept()
        if self.refused is None:
            self._cb.on_heartbeat(self.worker_id, self._load())

    def pause_seen(self, paused: bool | None, epoch: int | None = None) -> None:
        """A poll begun at marks ``epoch`` read the server's ``/is_paused`` (None: not said). A sleeping vLLM server
        says it is paused too (its sleep pauses its scheduling and a whole wake-up resumes it), so the pause mark
        follows the answer only while the server is awake."""
        if (paused is not None and self.stats.asleep is not True and self._cb.on_paused is not None
                and epoch in (None, self._marks_epoch)):
            self._cb.on_paused(self.worker_id, paused)

    def block_size_mismatch(self, engine_bs: int) -> None:
        if self.refused != REASON_BLOCK_SIZE:
            log.error(
                "%s: engine KV block size %d differs from the configured block_size %d: not routing to it "
                "(set execution_group.nodes[].block_size / --block-size to %d, or start the engine with "
                "--block-size %d)", self.worker_id, engine_bs, self.block_size, engine_bs,
                self.block_size,
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
