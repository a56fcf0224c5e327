"""In-process worker: drives a pure engine on the wall clock (scaled by ``speedup``).

The engine never reads a clock; this driver maps wall time to engine time
(``engine_now = (loop.time() - t0) * speedup``), calls ``advance`` when the pass in progress ends or
when a request arrives, hands token outputs to per-request queues, and reports KV events, load
(after every engine step, submission and abort) and heartbeats through the worker callbacks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import replace

from thunderagent.engine.base import Engine
from thunderagent.execution.handle import KEEPALIVE_S, AdminResult, OutputQueue, WorkerCallbacks, cancel_and_wait
from thunderagent.types import EngineRequest, FinishReason, LoadReport, TokenOutput

log = logging.getLogger(__name__)

#: reason a failed engine gives when it takes itself out of routing
REASON_ENGINE_FAILED = "engine_failed"


class ScaledClock:
    """Engine time from the event loop's monotonic clock, ``speedup`` engine seconds per wall second."""

    def __init__(self, speedup: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.loop = loop or asyncio.get_running_loop()
        self.speedup = speedup
        self.t0 = self.loop.time()

    def now(self) -> float:
        return (self.loop.time() - self.t0) * self.speedup

    def wall_delay(self, engine_time: float) -> float:
        return max(0.0, (engine_time - self.now()) / self.speedup)


class LocalWorker:
    def __init__(self, engine: Engine, clock: ScaledClock, callbacks: WorkerCallbacks,
                 heartbeat_interval: float) -> None:
        self.engine = engine
        self.worker_id = engine.worker_id
        self.clock = clock
        self._cb = callbacks
        self._hb_interval = heartbeat_interval
        self._streams: dict[str, OutputQueue] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.last_seq = -1
        self._report: LoadReport = engine.load(clock.now())
        #: fault injection (tests, chaos runs): a hung worker, as the fleet sees it: no heartbeats,
        #: no keepalives, while its engine keeps running
        self.heartbeats_paused = False
        #: set when the engine raised: the worker leaves routing, stops heartbeating, and every
        #: request it held ends (``ERROR`` if it had produced output, else ``UNAVAILABLE``: routed again)
        self.failed = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name=f"engine-{self.worker_id}"),
            asyncio.create_task(self._heartbeat(), name=f"heartbeat-{self.worker_id}"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        for rid, q in self._streams.items():
            q.put_output(self._final(rid, 0, FinishReason.ABORT), self._cb.clock())
        self._streams.clear()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> OutputQueue:
        q = OutputQueue(self._cb.clock())
        if self.failed:
            q.put_output(self._final(req.request_id, len(req.prompt_tokens), FinishReason.UNAVAILABLE), q.last_heard)
            return q
        q.accepted = True
        self._streams[req.request_id] = q
        now = self.clock.now()
        # add_request runs the engine up to ``now``; next_wakeup fixes the pass that starts now (an
        # idle engine admits the request at once), as the engine loop would next. The report then
        # shows the request where it really is, so the next routing decision of a burst sees it.
        self.engine.add_request(req, now)
        self.engine.next_wakeup()
        self._push_load(self.engine.load(now))
        self._wake.set()
        return q

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone, stop sequence hit); its blocks are released."""
        if self._streams.pop(request_id, None) is not None:
            now = self.clock.now()
            self.engine.abort(request_id, now)
            self._push_load(self.engine.load(now))
            self._wake.set()

    async def reset_prefix_cache(self, running: bool, external: bool) -> AdminResult:
        """Forget every cached block (``AllBlocksCleared``); running requests keep theirs, unannounced.
        (A simulated engine has no external cache: ``external`` asks nothing more.)"""
        if running:
            return AdminResult(False, error="a simulated worker does not preempt its running requests for a reset "
                                           "(without reset_running_requests their blocks stay, unannounced)")
        self._flush_events()  # (the events before the clear go out first, in sequence)
        self.engine.reset()
        self._flush_events()
        self._push_load(self.engine.load(self.clock.now()))
        return AdminResult(True)

    async def set_paused(self, paused: bool, mode: str, clear_cache: bool) -> AdminResult:
        return AdminResult(False, "a simulated worker has no pause (cordon it to take it out of routing)")

    async def server_call(self, path: str, query: str = "", body: bytes = b"") -> AdminResult:
        return AdminResult(False, f"a simulated worker has no server to call {path[:80]} on")

    async def set_adapter(self, name: str, path: str | None, inplace: bool) -> AdminResult:
        return AdminResult(False, "a simulated worker serves no LoRA adapters")

    def snapshot(self) -> tuple[list[int], int, list[int] | None] | None:
        """The engine's cached hashes, the last event seq they include and their check hashes
        (index resync)."""
        self._flush_events()
        return self.engine.cache_snapshot(), self.last_seq, self.engine.cache_checks()

    # -- loops -------------------------------------------------------------------------------
    def _push_load(self, report: LoadReport) -> None:
        self._report = report
        self._cb.on_load(self.worker_id, report)

    def _flush_events(self) -> None:
        events = self.engine.drain_events()
        if events:
            self.last_seq = events[-1].seq
            self._cb.on_events(self.worker_id, events)

    async def _run(self) -> None:
        while True:
            now = self.clock.now()
            try:
                outs = self.engine.advance(now)
                report = self.engine.load(now)
            except Exception:  # an engine bug must not strand requests or keep drawing traffic
                log.exception("engine %s failed in advance(): worker taken out of service", self.worker_id)
                self._fail()
                return
            wall = self._cb.clock()
            for out in outs:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_output(out, wall)
                    if out.finished:
                        del self._streams[out.request_id]
            self._flush_events()
            self._push_load(report)
            wake = self.engine.next_wakeup()
            self._wake.clear()
            if wake is None:
                await self._wake.wait()
            else:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
                # lands as the timeout fires, and stop() would then wait forever
                try:
                    async with asyncio.timeout(self.clock.wall_delay(wake)):
                        await self._wake.wait()
                except TimeoutError:
                    pass

    def _fail(self) -> None:
        self.failed = True
        self._cb.on_unavailable(self.worker_id, REASON_ENGINE_FAILED)
        wall = self._cb.clock()
        for rid, q in self._streams.items():
            # nothing out yet: the fleet routes it again; otherwise the stream breaks off
            reason = FinishReason.ERROR if q.produced else FinishReason.UNAVAILABLE
            q.put_output(self._final(rid, 0, reason), wall)
        self._streams.clear()

    def _final(self, request_id: str, prompt_tokens: int, reason: FinishReason) -> TokenOutput:
        return TokenOutput(request_id, [], self.clock.now(), prompt_tokens, 0, True, reason)

    async def _heartbeat(self) -> None:
        # One loop ticks at least every KEEPALIVE_S (keepalives) and heartbeats every heartbeat
        # interval, i.e. every ``every`` ticks.
        period = min(self._hb_interval, KEEPALIVE_S)
        every = max(1, round(self._hb_interval / period))
        for tick in itertools.count():
            if not self.heartbeats_paused and not self.failed:
                wall = self._cb.clock()
                if tick % every == 0:
                    self._cb.on_heartbeat(self.worker_id, replace(self._report, kv_seq=self.last_seq))
                for q in self._streams.values():
                    q.touch(wall)
            await asyncio.sleep(period)
