"""KvRouter: index match + cost + policy + prediction, one call per request.

``route`` is pure and synchronous: it takes the request's precomputed block hashes, the routable
workers' states and ``now``; it returns a :class:`Decision` that explains itself, and records a
prediction in the index (the request's blocks will be on the winner shortly; events confirm it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from thunderagent.config import Policy, RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.cost import load_key, queued_prefill, score
from thunderagent.router.policies import Candidate, make_policy
from thunderagent.types import Decision, RouteRequest, WorkerState


class NoWorkerAvailable(RuntimeError):
    """No worker can take the request now (none healthy, or all busy with fallback=reject)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KvRouter:
    def __init__(
        self,
        cfg: RoutingConfig,
        index: KvIndex,
        rng: random.Random,
        policy: Policy | None = None,
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.rng = rng
        self.policy = make_policy(cfg, policy)

    def route(self, req: RouteRequest, workers: Sequence[WorkerState], now: float) -> Decision:
        if not workers:
            raise NoWorkerAvailable("no healthy worker is registered")
        overlaps = self.index.find_matches(req.block_hashes, now) if req.block_hashes else {}
        min_queued = min(queued_prefill(w) for w in workers)
        best_cached = max((overlaps.get(w.worker_id, 0) * w.block_size for w in workers), default=0)
        cands = [
            Candidate(
                w,
                score(w, req.num_tokens, overlaps.get(w.worker_id, 0), self.cfg, min_queued, best_cached),
                self.index.num_blocks(w.worker_id),
            )
            for w in workers
        ]
        free = [c for c in cands if not c.score.busy]
        prefix = ""
        if not free and self.cfg.fallback == "policy":
            # Every worker is saturated: busy filtering tells nothing apart, so choose among all.
            # Cache hits matter most here: they cut the work the whole fleet is queued behind.
            i, reason = self.policy.choose(cands, self.rng, req.num_tokens, now)
            chosen, prefix = cands[i], "all workers busy; "
        elif not free:
            if self.cfg.fallback == "reject":
                raise NoWorkerAvailable(f"all {len(cands)} workers are busy", retry_after=1.0)
            best = min(cands, key=lambda c: load_key(c.worker))
            chosen, reason = best, "all workers busy: fallback to least loaded"
        else:
            i, reason = self.policy.choose(free, self.rng, req.num_tokens, now)
            chosen = free[i]
            if len(free) < len(cands):
                prefix = f"{len(cands) - len(free)} busy filtered; "
        wid = chosen.worker.worker_id
        if req.block_hashes:
            self.index.predict(wid, req.block_hashes, now)
        return Decision(
            request_id=req.request_id,
            worker_id=wid,
            policy=self.policy.name,
            reason=prefix + reason,
            candidates=tuple(c.score for c in cands),
            overlap_blocks=chosen.score.overlap_blocks,
        )
