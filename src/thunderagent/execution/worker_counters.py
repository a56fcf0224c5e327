"""What one worker process (``thunderagent worker``) counts of its own work, for its metrics endpoint
(``thunderagent worker --metrics-port``: ``control/worker_metrics.py`` reads these at each scrape).

Plain integers bumped on the service's paths (one attribute increment each: no Prometheus object on the hot
path), so a process without a metrics endpoint pays next to nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.types import AllBlocksCleared, BlockStored, KvEvent


@dataclass(slots=True)
class WorkerCounters:
    requests_accepted: int = 0  # generate RPCs its engine took
    #: requests answered at once without running: ``shutting_down``, ``duplicate_id``, ``engine_refused``
    requests_refused: dict[str, int] = field(default_factory=dict)
    #: requests whose stream ended here, by finish reason (stop, length, abort, error, ...; ``cut``: aborted by
    #: its frontend, its frontend gone, or the worker stopping)
    requests_finished: dict[str, int] = field(default_factory=dict)
    kv_batches: int = 0  # KV event messages published
    kv_blocks_stored: int = 0  # blocks in their BlockStored events
    kv_blocks_removed: int = 0  # blocks in their BlockRemoved events
    kv_clears: int = 0  # AllBlocksCleared events (a cache reset, a restart)
    heartbeats: int = 0  # heartbeats and hellos published

    def published(self, events: Sequence[KvEvent]) -> None:
        """A batch of KV events went out."""
        self.kv_batches += 1
        for ev in events:
            if isinstance(ev, BlockStored):
                self.kv_blocks_stored += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.kv_clears += 1
            else:
                self.kv_blocks_removed += len(ev.block_hashes)

    def refused(self, why: str) -> None:
        self.requests_refused[why] = self.requests_refused.get(why, 0) + 1

    def finished(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
