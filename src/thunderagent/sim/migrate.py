"""The simulator's side of cache migration: copies on the virtual clock.

The decisions are the migrator's (``transfer/migration.py``) and the plane's; this module carries them
out, as the live fleet does on its health tick:

1. a planned copy pins the prefix on the source engine (its blocks stay cached while they are read;
   a source that lost the prefix since the index last heard fails the copy, cause ``source_lost``),
   and starts on the plane (the migrator planned it only with room: it never queues);
2. it takes ``bytes / bandwidth + latency`` of virtual time (``slow_link`` slows the true link as for
   prefill/decode handoffs; the plane's estimate does not know it), cut at the plane's deadline;
3. at its end the source unpins the blocks, the target engine imports them into its prefix cache
   (``BlockStored`` events, as a handoff's decode side does) and the index predicts them there; a
   target whose pool cannot take them counts ``import_failed``.

A plane shared with prefill/decode handoffs (``sim/pd.py``): a copy's end may start queued handoffs,
which are handed back to that side.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from thunderagent.config import NodeConfig, Policy, RoutingConfig
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.engine.timing import make_timing
from thunderagent.kv.index import KvIndex
from thunderagent.sim.pd import PdSim
from thunderagent.transfer.migration import Migrator
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import WorkerState


class MigrationSim:
    def __init__(self, migrator: Migrator, engines: list[SimulatedEngine], pos: dict[str, int], index: KvIndex,
                 pd: PdSim | None, on_import: Callable[[int, float], None], slow_link: float = 1.0) -> None:
        """``on_import(engine, now)``: a target imported a prefix (the driver applies its KV events)."""
        self.migrator = migrator
        self.plane = migrator.plane
        self.engines = engines
        self.pos = pos
        self.index = index
        self.pd = pd
        self.slow_link = slow_link
        self.on_import = on_import
        self.heap: list[tuple[float, int, str]] = []  # (copy end, tie-break, tid)
        self.ok: dict[str, bool] = {}
        self._n = 0
        self.source_lost = 0
        self.import_failed = 0
        self.landed = 0

    def next_time(self) -> float:
        """When the next copy ends (inf: none in flight)."""
        return self.heap[0][0] if self.heap else math.inf

    def step(self, now: float, workers: Sequence[WorkerState], *, look: bool) -> list[int]:
        """Copies ending by ``now`` land; with ``look``, the migrator looks at ``workers`` and its new
        copies start. Returns the engines whose cache changed (targets that imported a prefix)."""
        touched: list[int] = []
        mig, plane, engines, heap = self.migrator, self.plane, self.engines, self.heap
        while heap and heap[0][0] <= now:
            _, _, tid = heapq.heappop(heap)
            ok = self.ok.pop(tid)
            m = mig.finished(tid, ok)
            for t in plane.finish(tid, now, ok=ok, cause="timeout"):
                assert self.pd is not None, "only prefill/decode handoffs queue on the plane"
                self.pd._schedule(t, now)
            engines[self.pos[m.src]].release_transfer(tid)
            if not ok:
                continue
            j = self.pos[m.dst]
            if engines[j].import_blocks(m.hashes, m.checks):
                mig.landed(m, self.index, now)
                self.landed += 1
                self.on_import(j, now)
                touched.append(j)
            else:
                self.import_failed += 1
        if look:
            for m in mig.tick(workers, self.index, now):
                src = engines[self.pos[m.src]]
                if src.pin_blocks(m.tid, m.hashes) < len(m.hashes):  # evicted since the index heard
                    src.release_transfer(m.tid)
                    mig.finished(m.tid, False)
                    self.source_lost += 1
                    continue
                t = plane.start(m.tid, m.src, m.dst, m.nbytes, now)
                assert t is not None, "the migrator plans a copy only when the plane has room"
                true_s = m.nbytes / plane.default_bps * self.slow_link + plane.cfg.latency_s
                end = now + true_s
                self.ok[m.tid] = end <= t.deadline
                self._n += 1
                heapq.heappush(heap, (min(end, t.deadline), self._n, m.tid))
        return touched

    def stats(self) -> dict[str, object]:
        return {**self.migrator.stats(), "landed": self.landed, "source_lost": self.source_lost,
                "import_failed": self.import_failed}


def sim_migration(routing: RoutingConfig, node: NodeConfig, engines: list[SimulatedEngine], pos: dict[str, int],
                  index: KvIndex, pd: PdSim | None, on_import: Callable[[int, float], None],
                  slow_link: float, policy: Policy) -> MigrationSim | None:
    """``routing.migration`` in the simulator (None when off): copies move on the prefill/decode plane when
    the fleet has one, else on ``routing.migration.link``."""
    cfg = routing.migration
    if not cfg.enabled:
        return None
    if policy is not Policy.kv_aware:
        raise ValueError(f"routing.migration acts with policy kv_aware only (this run's is {policy.value}): "
                         "other policies ignore where the copies land")
    if (pd is None) != cfg.link.enabled:
        raise ValueError("routing.migration.link.enabled must be true without a prefill group (it is the copies' "
                         "plane) and false with one (that group's plane is shared)")
    plane = TransferPlane(cfg.link) if pd is None else pd.plane
    mig = Migrator(routing, plane, make_timing(node.timing), node.block_size)
    return MigrationSim(mig, engines, pos, index, pd, on_import, slow_link)
