"""A simulated worker whose KV handoffs move real bytes (``execution/kv_bytes.py``).

:class:`KvBytesWorker` wraps the :class:`~thunderagent.execution.local.LocalWorker` of a simulated
engine and keeps the handle contract (``execution/handle.py``):

* a ``remote_decode`` job's finished output names where its bytes wait: its blocks are offered on
  the process's :class:`KvByteService`, and its :class:`~thunderagent.types.KvTransfer` gets
  ``engine_params`` ``{"kv_bytes": [host, port], "block_bytes": n}`` (the field real engines use for
  their own transfer object);
* a ``kv_from`` request carrying such params is held while the worker pulls and verifies the bytes;
  only then does its engine take the request (and import the blocks). A failed pull (or a pool that
  cannot take the blocks) ends it ``UNAVAILABLE`` before any output, with :attr:`TokenOutput.kv_pull`
  saying why: the control plane's flow prefills it on this worker instead, counted by that cause.
  A good pull rides on the request's first output, so the plane learns the link from the pull's own
  duration.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import replace

from thunderagent.config import KvTransferConfig
from thunderagent.execution.handle import FollowingQueue, OutputQueue
from thunderagent.execution.kv_bytes import KvByteService, pull
from thunderagent.execution.local import LocalWorker
from thunderagent.types import EngineRequest, FinishReason, KvPull, KvTransfer, TokenOutput

log = logging.getLogger(__name__)

#: shortest pull timeout. The plane's estimate (``timeout_factor`` x bytes / bandwidth) is a NIC's;
#: a simulated pull shares its CPU with the engine loops (and a loaded test host), so a floor keeps
#: pulls of a few MB from timing out on a busy loopback.
MIN_PULL_TIMEOUT_S = 2.0


class _Tap(FollowingQueue):
    """The queue handed to the fleet while this wrapper feeds it: liveness follows the engine's own
    queue once there is one (its keepalives)."""


def byte_source(t: KvTransfer | None) -> tuple[str, int, int, str | None] | None:
    """(host, port, block bytes, the offer's key) when ``t`` is a simulated worker's byte transfer, else None. The
    key is the source job's request id (None from an older worker: the pulling request's own id, a handoff's)."""
    if t is None or not t.engine_params or not t.block_hashes:
        return None
    try:
        p = json.loads(t.engine_params)
        host, port = p["kv_bytes"]
        key = p.get("transfer")
        return str(host), int(port), int(p["block_bytes"]), None if key is None else str(key)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # another engine's transfer object


class KvBytesWorker:
    def __init__(self, inner: LocalWorker, service: KvByteService, block_bytes: int, plane: KvTransferConfig,
                 clock: Callable[[], float]) -> None:
        self.inner = inner
        self.worker_id = inner.worker_id
        self.service = service
        self.block_bytes = block_bytes
        self.plane = plane
        self._clock = clock  # the control plane's (queue liveness)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __getattr__(self, name: str) -> object:  # engine, clock, failed...: the wrapped worker's
        return getattr(self.inner, name)

    @property
    def heartbeats_paused(self) -> bool:  # fault injection sets it: on the wrapped worker, which beats
        return self.inner.heartbeats_paused

    @heartbeats_paused.setter
    def heartbeats_paused(self, value: bool) -> None:
        self.inner.heartbeats_paused = value

    def start(self) -> None:
        self.service.open(self.worker_id)
        self.inner.start()

    async def stop(self) -> None:
        for t in list(self._tasks.values()):
            t.cancel()
        self._tasks.clear()
        await self.inner.stop()
        await self.service.close()

    def snapshot(self) -> tuple[list[int], int] | None:
        return self.inner.snapshot()

    def abort(self, request_id: str) -> None:
        t = self._tasks.pop(request_id, None)
        if t is not None:
            t.cancel()
        self.inner.abort(request_id)

    def submit(self, req: EngineRequest) -> OutputQueue:
        src = byte_source(req.kv_from)
        if not req.remote_decode and src is None:
            return self.inner.submit(req)
        tap = _Tap(self._clock())
        tap.accepted = True
        work = self._offer(req, tap) if req.remote_decode else self._pull(req, tap, src)  # type: ignore[arg-type]
        task = asyncio.get_running_loop().create_task(work, name=f"kv-bytes-{req.request_id}")
        self._tasks[req.request_id] = task
        task.add_done_callback(lambda t, rid=req.request_id: self._tasks.pop(rid, None) if self._tasks.get(rid) is t
                               else None)
        return tap

    # -- prefill side ------------------------------------------------------------------------
    async def _offer(self, req: EngineRequest, tap: _Tap) -> None:
        q = self.inner.submit(req)
        tap.source = q
        while True:
            out = await q.get()
            t = out.kv_transfer
            if out.finished and t is not None and t.block_hashes:
                self.service.offer(req.request_id, t.block_hashes, self.block_bytes, self._clock())
                host, port = self.service.address
                # the offer's key rides along: a cache migration's pull is another request than the source's job
                out.kv_transfer = replace(t, engine_params=json.dumps(
                    {"kv_bytes": [host, port], "block_bytes": self.block_bytes, "transfer": req.request_id}))
            tap.put_output(out, q.last_heard)
            if out.finished:
                return

    # -- decode side -------------------------------------------------------------------------
    def _timeout(self, source: str, nbytes: int) -> float:
        """``timeout_factor`` x the link's estimate: a probed one (``links``) when there is one, else
        the configured default (the plane's live EWMA is the control plane's, not this process's)."""
        p = self.plane
        gbps, latency = p.bandwidth_gbps, p.latency_s
        for ln in p.links:
            if ln.src == source and ln.dst == self.worker_id:
                gbps, latency = ln.bandwidth_gbps, ln.latency_s
        return max(MIN_PULL_TIMEOUT_S, p.timeout_factor * (nbytes * 8 / (gbps * 1e9) + latency))

    def _target_full(self, hashes: tuple[int, ...]) -> bool:
        """The pool cannot take the blocks it lacks (or a fault says so)."""
        if self.service.draw_target_full():
            return True
        bm = self.inner.engine.blocks  # type: ignore[attr-defined]
        missing = len(hashes) - bm.match_prefix(hashes, len(hashes))[0]
        return missing > bm.free_blocks

    async def _pull(self, req: EngineRequest, tap: _Tap, src: tuple[str, int, int, str | None]) -> None:
        t = req.kv_from
        assert t is not None
        host, port, block_bytes, key = src
        if self._target_full(t.block_hashes):
            res = KvPull("target_full", 0, 0, 0.0)
        else:
            nbytes = block_bytes * len(t.block_hashes)
            res = await pull(host, port, key or req.request_id, t.block_hashes, self._timeout(t.source_worker, nbytes),
                             progress=lambda: tap.touch(self._clock()))
        self.service.count(res)
        if res.cause != "ok":
            log.warning("request %s: KV pull from %s failed (%s): refused (the control plane prefills it here, or "
                        "routes it again when fallback_to_local is false)",
                        req.request_id, t.source_worker, res.cause)
            tap.put_output(TokenOutput(req.request_id, [], self.inner.clock.now(), len(req.prompt_tokens), 0, True,
                                       FinishReason.UNAVAILABLE, kv_pull=res), self._clock())
            return
        log.info("request %s: pulled %d KV bytes from %s in %.4fs, %d checksums verified", req.request_id,
                 res.nbytes, t.source_worker, res.seconds, res.blocks)
        q = self.inner.submit(req)
        tap.source = q
        first = True
        try:
            while True:
                out = await q.get()
                if first:
                    out.kv_pull = res
                    first = False
                tap.put_output(out, q.last_heard)
                if out.finished:
                    return
        except asyncio.CancelledError:
            self.inner.abort(req.request_id)
            raise
