"""A reference worker handle: the smallest thing that keeps the whole worker contract.

It answers each request with ``max_tokens`` tokens (letters), one output per step, caches the
prompt's full blocks (reporting ``cached_tokens`` on a repeat and ``BlockStored`` events with the
router's hashes), pushes its load at submit / finish, heartbeats, and touches its requests while
alive; a prefix-cache reset empties the cache (``AllBlocksCleared``), refused while a request runs.
``unavailable=True`` makes it refuse every request (``UNAVAILABLE``, and out of routing).
It passes ``tests/engines/test_conformance.py`` like the real handles, so fleet tests can trust it.
"""

from __future__ import annotations

import asyncio

from thunderagent.execution.handle import KEEPALIVE_S, AdminResult, OutputQueue, WorkerCallbacks, cancel_and_wait
from thunderagent.types import AllBlocksCleared, BlockStored, EngineRequest, FinishReason, LoadReport, TokenOutput


class FakeWorker:
    def __init__(self, worker_id: str, callbacks: WorkerCallbacks, *, block_size: int = 16, step: float = 0.002,
                 heartbeat_interval: float = 0.05, unavailable: bool = False, kv_blocks: int = 1000) -> None:
        self.worker_id = worker_id
        self.cb = callbacks
        self.block_size = block_size
        self.step = step
        self.heartbeat_interval = heartbeat_interval
        self.unavailable = unavailable
        self.kv_blocks = kv_blocks
        self.cache: list[int] = []  # block hashes, in the order stored
        self.seq = -1
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self._reqs: dict[str, tuple[EngineRequest, OutputQueue, asyncio.Task[None]]] = {}
        self._started: dict[str, int] = {}  # request id -> tokens generated
        self._tasks: list[asyncio.Task[None]] = []

    # -- WorkerHandle ------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._heartbeats(), name=f"fake-hb-{self.worker_id}")]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        for rid in list(self._reqs):
            req, q, task = self._reqs.pop(rid)
            task.cancel()
            q.put_output(TokenOutput(rid, [], 0.0, len(req.prompt_tokens), 0, True, FinishReason.ABORT), self.cb.clock())

    def submit(self, req: EngineRequest) -> OutputQueue:
        self.submitted.append(req.request_id)
        q = OutputQueue(self.cb.clock())
        n = len(req.prompt_tokens)
        if self.unavailable:
            self.cb.on_unavailable(self.worker_id, "unreachable")
            q.put_output(TokenOutput(req.request_id, [], 0.0, n, 0, True, FinishReason.UNAVAILABLE, text=""),
                         self.cb.clock())
            return q
        q.accepted = True
        task = asyncio.create_task(self._generate(req, q), name=f"fake-{req.request_id}")
        self._reqs[req.request_id] = (req, q, task)
        self.cb.on_load(self.worker_id, self.load())
        return q

    def abort(self, request_id: str) -> None:
        entry = self._reqs.pop(request_id, None)
        if entry is not None:
            self.aborted.append(request_id)
            self._started.pop(request_id, None)
            entry[2].cancel()
            self.cb.on_load(self.worker_id, self.load())

    def snapshot(self) -> tuple[list[int], int] | None:
        return list(self.cache), self.seq

    async def reset_prefix_cache(self, running: bool, external: bool) -> AdminResult:
        """As vLLM: refused while a request runs (unless ``running``), else the cache emptied and announced."""
        if self._reqs and not running:
            return AdminResult(False, error="blocks are still in use")
        self.cache.clear()
        self.seq += 1
        self.cb.on_events(self.worker_id, [AllBlocksCleared(self.worker_id, self.seq)])
        return AdminResult(True)

    async def set_paused(self, paused: bool, mode: str, clear_cache: bool) -> AdminResult:
        return AdminResult(False, "the fake worker has no pause")

    async def server_call(self, path: str, query: str = "", body: bytes = b"") -> AdminResult:
        return AdminResult(False, "the fake worker has no server")

    async def set_adapter(self, name: str, path: str | None, inplace: bool) -> AdminResult:
        return AdminResult(False, "the fake worker serves no LoRA adapters")

    # -- the fake engine ---------------------------------------------------------------------
    def load(self) -> LoadReport:
        # a request is "waiting" until its first token, then "running" with its KV footprint
        reqs = [r for r, _, _ in self._reqs.values()]
        waiting = [r for r in reqs if r.request_id not in self._started]
        running = [r for r in reqs if r.request_id in self._started]
        queued = sum(len(r.prompt_tokens) for r in waiting)
        decode = sum(len(r.prompt_tokens) + self._started[r.request_id] for r in running)
        active = sum(-(-(len(r.prompt_tokens) + 1) // self.block_size) for r in running)
        return LoadReport(self.worker_id, self.cb.clock(), len(running), len(waiting), queued, decode, active,
                          len(self.cache), self.kv_blocks)

    async def _generate(self, req: EngineRequest, q: OutputQueue) -> None:
        rid, n = req.request_id, len(req.prompt_tokens)
        held = set(self.cache)
        hit = 0
        for h in req.block_hashes:
            if h not in held:
                break
            hit += 1
        cached = min(hit * self.block_size, n - 1) // self.block_size * self.block_size if n else 0
        new = tuple(h for h in req.block_hashes if h not in held)
        if new:
            self.seq += 1
            self.cache.extend(new)
            self.cb.on_events(self.worker_id, [BlockStored(self.worker_id, self.seq, new)])
        try:
            for k in range(req.max_tokens):
                await asyncio.sleep(self.step)
                last = k == req.max_tokens - 1
                tok = 97 + k % 26
                first = rid not in self._started
                self._started[rid] = k + 1
                if last:
                    self._reqs.pop(rid, None)
                    self._started.pop(rid, None)
                q.put_output(TokenOutput(rid, [tok], self.cb.clock(), n, cached, last,
                                         FinishReason.LENGTH if last else None, text=chr(tok)), self.cb.clock())
                if first or last:
                    self.cb.on_load(self.worker_id, self.load())
        finally:
            self._started.pop(rid, None)

    async def _heartbeats(self) -> None:
        while True:
            self.cb.on_heartbeat(self.worker_id, self.load())
            for _, q, _ in self._reqs.values():
                q.touch(self.cb.clock())
            await asyncio.sleep(min(self.heartbeat_interval, KEEPALIVE_S))
