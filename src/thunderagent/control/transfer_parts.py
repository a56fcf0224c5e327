"""The live fleet's transfer-plane parts, built in one place and driven together by :class:`~thunderagent.control.fleet.Fleet`.

- the prefill/decode plane's observer (``control/pd_plane.py``: the plans' transfers on the plane, the links'
  learning), with a ``role: prefill`` group;
- cache migration (``control/cache_migration.py``, ``routing.migration``): copies on the health tick;
- the links' warm-ups (``control/link_warmup.py``, the prefill group's ``kv_cache_transfer.warmup_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from thunderagent.config import Config, Policy
from thunderagent.control.cache_migration import CacheMigrationFlow, MigrationCollector, make_cache_migration
from thunderagent.control.disagg_flow import DisaggFlow
from thunderagent.control.link_learning import LinkLearner
from thunderagent.control.link_warmup import LinkWarmup
from thunderagent.control.metrics import Metrics
from thunderagent.control.pd_plane import PlaneObserver
from thunderagent.control.registry import WorkerRegistry
from thunderagent.execution.handle import WorkerHandle
from thunderagent.kv.index import KvIndex
from thunderagent.scheduler.disagg import Disaggregator
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.types import WorkerState


@dataclass(slots=True)
class TransferParts:
    observer: PlaneObserver | None
    migration: CacheMigrationFlow | None
    warmup: LinkWarmup | None
    #: the links' learning from the moves that landed (handoffs and copies; one plane, or migration's own)
    learner: LinkLearner | None
    #: several NATS frontends: whether this one plans cache migration's copies now (``Leadership.copying``: one
    #: of them does, or two would copy the same prefix); None: it alone
    copy_gate: Callable[[float], bool] | None = None

    def observe(self, d: Dispatch, now: float) -> None:
        """A request was routed (its prefix's demand, for cache migration)."""
        if self.migration is not None:
            self.migration.observe(d, now)

    @property
    def ticking(self) -> bool:
        """Something acts on the health tick (else the fleet need not list its routable workers for it)."""
        return self.migration is not None or self.warmup is not None

    def tick(self, routable: Sequence[WorkerState], now: float) -> None:
        """The health tick: copies to start (this frontend plans them), a link to warm up."""
        if self.migration is not None and (self.copy_gate is None or self.copy_gate(now)):
            self.migration.tick(routable, now)
        if self.warmup is not None:
            self.warmup.tick(routable, now)

    def on_server_pulls(self, worker_id: str, nbytes: float, seconds: float, transfers: float, now: float) -> None:
        """A server's own KV pulls so far (vLLM's NIXL metrics, read with its load polls): the links learn."""
        if self.learner is not None:
            self.learner.on_server_pulls(worker_id, nbytes, seconds, transfers, now)

    def on_server_prefill(self, worker_id: str, tokens: float, seconds: float) -> None:
        """A server's computed prompt tokens and prefill seconds so far (vLLM's metrics): cache migration weighs a
        copy against that server's measured prefill rate instead of a configured timing model."""
        if self.migration is not None:
            self.migration.migrator.server_prefill(worker_id, tokens, seconds)

    async def stop(self) -> None:
        for part in (self.migration, self.warmup):
            if part is not None:
                await part.stop()

    def health(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.migration is not None:
            gate = self.copy_gate
            out = self.migration.health(planning=gate is None or gate(self.migration.clock()))
        if self.observer is not None:
            out["pd_links"] = self.observer.links()
        elif self.learner is not None:  # migration's own plane (``routing.migration.link``)
            out["migration_links"] = self.learner.links()
        if self.warmup is not None:
            out |= self.warmup.health()
        return out


def transfer_parts(cfg: Config, pd: Disaggregator | None, flow: DisaggFlow, metrics: Metrics, registry: WorkerRegistry,
                   workers: Mapping[str, WorkerHandle], index: KvIndex, block_size: int, clock: Callable[[], float],
                   policy: Policy) -> TransferParts:
    """Build the parts ``cfg`` turns on; ``pd``: the dispatch path's disaggregator (a prefill group), whose plane
    ``flow``'s plans go on (its observer is set here)."""
    observer = None
    if pd is not None:  # the plans' transfers on the plane (caps, backpressure)
        observer = flow.observer = PlaneObserver(pd, metrics, registry)
    warm = None if pd is None or not pd.plane.cfg.warmup_tokens else LinkWarmup(
        pd.plane.cfg.warmup_tokens, block_size, flow, pd.plane, workers, clock)
    migration = make_cache_migration(cfg, None if pd is None else pd.plane, workers, index, clock, policy)
    learner = None if observer is None else observer.learner
    if migration is not None:
        metrics.registry.register(MigrationCollector(migration))
        if learner is None:
            learner = LinkLearner(migration.migrator.plane, metrics.pd_links_learned, registry.worker_ids)
        migration.learner = learner
    return TransferParts(observer, migration, warm, learner)
