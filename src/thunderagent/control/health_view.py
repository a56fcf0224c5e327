"""``GET /health``'s body: each worker's health and load, the holding queue, the membership's part."""

from __future__ import annotations

from collections.abc import Mapping, Set

from thunderagent.control.breaker import Breakers
from thunderagent.control.registry import Health, WorkerRegistry
from thunderagent.kv.index import KvIndex
from thunderagent.scheduler.queue import HoldingQueue


def health_summary(registry: WorkerRegistry, index: KvIndex, unavailable: Mapping[str, str],
                   marks: tuple[Set[str], Set[str], Set[str]], queue: HoldingQueue | None, now: float,
                   membership: Mapping[str, object], breakers: Breakers) -> dict[str, object]:
    loads = registry.loads()
    cordoned, asleep, paused = marks  # an operator's: workers cordoned, servers put to sleep or paused
    workers = [
        {
            "id": wid,
            "role": registry.info(wid).role,
            "health": registry.health(wid).value,
            "running": loads[wid].running,
            "waiting": loads[wid].waiting,
            "kv_usage": round(loads[wid].kv_usage, 4),
            "indexed_blocks": index.num_blocks(wid),
            # longest sequence (prompt + max_tokens) / prompt routing sends it (None: no limit stated)
            "max_seq_tokens": registry.info(wid).max_seq_tokens or None,
            "max_prompt_tokens": registry.info(wid).max_prompt_tokens or None,
            "out_of_routing": unavailable.get(wid),  # reason a worker gave (unreachable, ...)
            "cordoned": wid in cordoned,  # an operator took it out of routing (POST /v1/admin/workers/{id}/cordon)
            # its server was put to sleep (vLLM's /sleep through ThunderAgent): routed to only while no other can
            "asleep": wid in asleep,
            "paused": wid in paused,  # its server's generation paused through ThunderAgent (vLLM's /pause): likewise
            "breaker": breakers.state(wid).value,  # closed, half_open (probing) or open (ejected: slow or failing)
            "skipped": breakers.blocked(wid),  # why routing skips it now, if it does
        }
        for wid in registry.worker_ids()
    ]
    healthy = sum(1 for w in workers if w["health"] == Health.healthy.value and not w["out_of_routing"]
                  and not w["skipped"] and not w["cordoned"])
    summary: dict[str, object] = {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy,
                                  "workers": workers}
    if queue is not None:
        summary["scheduler"] = {"held": len(queue), "by_priority": {str(t): n for t, n in sorted(queue.by_tier().items())},
                                "oldest_wait_s": round(queue.oldest_wait(now), 3)}
    summary.update(membership)
    return summary
