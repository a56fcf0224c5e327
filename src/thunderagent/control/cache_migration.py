"""Cache migration in the live fleet (``routing.migration``): the migrator on the health tick.

A thin driver of :class:`~thunderagent.transfer.migration.Migrator` (the policy the simulator runs):
the fleet reports each routed request (:meth:`CacheMigrationFlow.observe`, the prefix's demand) and calls
:meth:`CacheMigrationFlow.tick` on its health tick with the routable workers; each planned copy starts on
the transfer plane (the prefill/decode plane when the fleet has a prefill group, else the one
``routing.migration.link`` configures) and runs as a task.

**How a copy moves, live**: as the simulated engines' existing hash handoff (``engine/kv_handoff.py``), not
as bytes: the target gets a one-token warm-up request whose ``kv_from`` names the source and the
prefix's block hashes; the engine imports the blocks into its prefix cache on arrival (its ``BlockStored``
events confirm them in the index), then computes the prompt's last token. The copy ends with that request
(its seconds are not a byte transfer: the plane's link estimate does not learn from them). The source is
not pinned (live, as for prefill/decode handoffs, nothing would unpin it). Real engines need byte
transport (being built separately), so a fleet with non-simulated engines refuses ``routing.migration``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

from thunderagent.config import Config, ConfigError, Policy, Role
from thunderagent.engine.timing import make_timing
from thunderagent.execution.handle import WorkerHandle
from thunderagent.kv.hashing import BASE_SEED
from thunderagent.kv.index import KvIndex
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.transfer.migration import Migration, Migrator
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import EngineRequest, FinishReason, KvTransfer, WorkerState

log = logging.getLogger(__name__)

_FAILED = (FinishReason.ERROR, FinishReason.UNAVAILABLE, FinishReason.ABORT)


class CacheMigrationFlow:
    def __init__(self, migrator: Migrator, workers: Mapping[str, WorkerHandle], index: KvIndex,
                 clock: Callable[[], float]) -> None:
        self.migrator = migrator
        self.workers = workers
        self.index = index
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def observe(self, d: Dispatch, now: float) -> None:
        self.migrator.observe(d.request.block_hashes, d.decision.best_overlap_blocks, now, d.request.check_hashes)

    def tick(self, workers: Sequence[WorkerState], now: float) -> None:
        plane = self.migrator.plane
        for m in self.migrator.tick(workers, self.index, now):
            t = plane.start(m.tid, m.src, m.dst, m.nbytes, now)
            assert t is not None, "the migrator plans a copy only when the plane has room"
            log.info("cache migration %s: %d blocks of a prefix (demand %.1f) from %s to %s", m.tid, m.blocks,
                     m.demand, m.src, m.dst)
            self._tasks[m.tid] = asyncio.create_task(self._copy(m, t.deadline - now), name=m.tid)

    async def _copy(self, m: Migration, timeout_s: float) -> None:
        ok, cause = False, "aborted"
        try:
            dst = self.workers.get(m.dst)
            if dst is None:
                cause = "target_gone"
            else:
                bs = self.migrator.block_size
                n = len(m.hashes)
                # the prompt's tokens do not matter to a simulated engine (it caches by the hashes given)
                req = EngineRequest(m.tid, [0] * (n * bs + 1), list(m.hashes), BASE_SEED, 1, True,
                                    kv_from=KvTransfer(m.src, n * bs, m.hashes),
                                    check_hashes=None if m.checks is None else list(m.checks))
                q = dst.submit(req)
                cause = "timeout"
                async with asyncio.timeout(timeout_s):
                    while not (out := await q.get()).finished:
                        pass
                ok = out.finish_reason not in _FAILED
                cause = "ok" if ok else "failed"
        except TimeoutError:
            if (w := self.workers.get(m.dst)) is not None:
                w.abort(m.tid)
        finally:
            self._tasks.pop(m.tid, None)
            now = self.clock()
            self.migrator.plane.finish(m.tid, now, ok=ok, cause=cause, learn=False)
            self.migrator.finished(m.tid, ok)
            if ok:
                self.migrator.landed(m, self.index, now)
            else:
                log.warning("cache migration %s from %s to %s failed (%s)", m.tid, m.src, m.dst, cause)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def health(self) -> dict[str, object]:
        return {"cache_migration": self.migrator.stats()}


def make_cache_migration(cfg: Config, plane: TransferPlane | None, workers: Mapping[str, WorkerHandle],
                         index: KvIndex, clock: Callable[[], float], policy: Policy) -> CacheMigrationFlow | None:
    """The live driver of ``routing.migration`` (None when off); ``plane``: the prefill/decode plane, if any;
    ``policy``: the router's."""
    mc = cfg.routing.migration
    if not mc.enabled:
        return None
    if policy is not Policy.kv_aware:
        raise ConfigError(f"routing.migration.enabled acts with policy kv_aware only (the router's is {policy.value})")
    nodes = cfg.execution_group.nodes
    if any(n.engine != "simulated" for n in nodes):
        raise ConfigError("routing.migration.enabled: live copies use the simulated engines' hash handoff; "
                          "real engines (engine: vllm|sglang|openai) need KV byte transport, not built yet")
    if (plane is None) != mc.link.enabled:
        raise ConfigError("routing.migration.link.enabled must be true without a prefill group (it is the copies' "
                          "plane) and false with one (that group's plane is shared)")
    decode = next(n for n in nodes if n.role is not Role.prefill)
    mig = Migrator(cfg.routing, plane if plane is not None else TransferPlane(mc.link), make_timing(decode.timing),
                   decode.block_size)
    return CacheMigrationFlow(mig, workers, index, clock)
