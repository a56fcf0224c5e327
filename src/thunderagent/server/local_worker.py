"""In-process worker: drives a pure engine on the wall clock (scaled by ``speedup``).

The engine never reads a clock; this driver maps wall time to engine time
(``engine_now = (loop.time() - t0) * speedup``), calls ``advance`` when the pass in progress ends or
when a request arrives, hands token outputs to per-request queues, and forwards KV events and load
reports to the control plane through callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from thunderagent.engine.base import Engine
from thunderagent.server.worker_handle import cancel_and_wait
from thunderagent.types import EngineRequest, KvEvent, LoadReport, TokenOutput

log = logging.getLogger(__name__)


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
    def __init__(
        self,
        engine: Engine,
        clock: ScaledClock,
        on_events: Callable[[str, list[KvEvent]], None],
        on_heartbeat: Callable[[str, LoadReport], None],
        heartbeat_interval: float,
    ) -> None:
        self.engine = engine
        self.worker_id = engine.worker_id
        self.clock = clock
        self._on_events = on_events
        self._on_heartbeat = on_heartbeat
        self._hb_interval = heartbeat_interval
        self._streams: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.last_seq = -1
        #: when True the worker stops heartbeating (a hung worker, as health checks see it)
        self.heartbeats_paused = False
        #: set when the engine raised: the worker stops heartbeating (health checks take it out of
        #: routing) and every request it held or gets ends with finish_reason "error"
        self.failed = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name=f"engine-{self.worker_id}"),
            asyncio.create_task(self._heartbeat(), name=f"heartbeat-{self.worker_id}"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> asyncio.Queue[TokenOutput]:
        q: asyncio.Queue[TokenOutput] = asyncio.Queue()
        if self.failed:
            q.put_nowait(self._error_output(req.request_id, len(req.prompt_tokens)))
            return q
        self._streams[req.request_id] = q
        self.engine.add_request(req, self.clock.now())
        self._wake.set()
        return q

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone, stop sequence hit); its blocks are released."""
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort(request_id, self.clock.now())
            self._wake.set()

    def load(self) -> LoadReport:
        return self.engine.load(self.clock.now())

    def snapshot(self) -> tuple[list[int], int] | None:
        """The engine's cached hashes and the last event seq they include (index resync)."""
        self._flush_events()
        return self.engine.cache_snapshot(), self.last_seq

    # -- loops -------------------------------------------------------------------------------
    def _flush_events(self) -> None:
        events = self.engine.drain_events()
        if events:
            self.last_seq = events[-1].seq
            self._on_events(self.worker_id, events)

    async def _run(self) -> None:
        while True:
            try:
                outs = self.engine.advance(self.clock.now())
            except Exception:  # an engine bug must not strand requests or keep drawing traffic
                log.exception("engine %s failed in advance(): worker taken out of service", self.worker_id)
                self.failed = True
                for rid, q in self._streams.items():
                    q.put_nowait(self._error_output(rid, 0))
                self._streams.clear()
                return
            for out in outs:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
                    if out.finished:
                        del self._streams[out.request_id]
            self._flush_events()
            wake = self.engine.next_wakeup()
            self._wake.clear()
            if wake is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.clock.wall_delay(wake))

    def _error_output(self, request_id: str, prompt_tokens: int) -> TokenOutput:
        return TokenOutput(request_id, [], self.clock.now(), prompt_tokens, 0, True, "error")

    async def _heartbeat(self) -> None:
        while True:
            if not self.heartbeats_paused and not self.failed:
                self._on_heartbeat(self.worker_id, self.load())
            await asyncio.sleep(self._hb_interval)
