"""An operator's prefix-cache reset of the fleet's workers (``/v1/admin/reset_prefix_cache``, vLLM's own
``/reset_prefix_cache`` path, ``/v1/admin/workers/{id}/reset_prefix_cache``: ``frontend/admin_api.py``).

Why a fleet needs it: after a model's weights change (an RL step, a hot fix), every server's cached KV is stale,
and the router's index must not send requests to caches that are gone. Each worker is asked at once
(``WorkerHandle.reset_prefix_cache``: vLLM's ``/reset_prefix_cache``, SGLang's ``/flush_cache``, a simulated
engine's pool, a worker process over NATS), and once it answered that it did, this frontend drops the worker's
index entries, its predictions included. The engine's own ``AllBlocksCleared`` event is not waited for: an idle
vLLM engine publishes its events only with its next step, so the event comes with the next request's batch (and
is applied in order: the clear, then that request's blocks); without events (``engine: openai``) none comes.
Other frontends of a NATS bus follow that event, and their predictions of a server without events expire by their
TTL. Entries stored between the server's reset and its answer reaching us are dropped with the rest (the cache
under-estimated, never over: they are found again when the engine stores them anew). A worker that refused
(blocks still in use, no such path, unreachable) keeps its cache and its entries, and says why.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from thunderagent.execution.handle import CacheReset

if TYPE_CHECKING:
    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class WorkerReset:
    worker_id: str
    success: bool
    error: str | None = None


async def reset_caches(fleet: Fleet, worker_ids: list[str], *, running: bool, external: bool) -> list[WorkerReset]:
    """Reset the prefix cache of each of ``worker_ids`` (known to the fleet), concurrently; in that order."""
    return list(await asyncio.gather(*(_one(fleet, wid, running, external) for wid in worker_ids)))


async def _one(fleet: Fleet, worker_id: str, running: bool, external: bool) -> WorkerReset:
    handle = fleet.workers.get(worker_id)
    if handle is None:
        return WorkerReset(worker_id, False, "it left the fleet")
    try:
        r = await handle.reset_prefix_cache(running, external)
    except Exception as e:  # a handle's bug must not lose the other workers' answers
        log.exception("prefix cache reset of %s failed", worker_id)
        r = CacheReset(False, error=f"failed: {e!r}")
    if r.success and worker_id in fleet.workers:
        index = fleet.index  # (its seq kept: the engine's AllBlocksCleared, when it comes, is the next event)
        index.resync(worker_id, (), index.last_seq(worker_id))
    log.warning("prefix cache of %s reset by an operator: %s", worker_id, "done" if r.success else
                f"refused: {r.error}")
    return WorkerReset(worker_id, r.success, r.error)
