"""KvRouter: index match + cost + policy + prediction, one call per request.

``route`` is pure and synchronous: it takes the request's precomputed block hashes, the routable
workers' states and ``now``; it returns a :class:`Decision` that explains itself, and records a
prediction in the index (the request's blocks will be on the winner shortly; events confirm it).
With ``routing.hot_prefix.enabled`` (kv_aware only), a hot prefix's request may go to a new replica
instead (``router/hot.py``); the decision then says so.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from thunderagent.config import Policy, RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.cost import load_key, queued_prefill, score
from thunderagent.router.hot import HotPrefixes
from thunderagent.router.policies import Candidate, KvAware, make_policy
from thunderagent.types import Decision, HotPrefixNote, RouteRequest, WorkerState


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
        # hot-prefix replicas steer around the kv_aware policy only: the others ignore the cache
        self.hot = (
            HotPrefixes(cfg.hot_prefix)
            if cfg.hot_prefix.enabled and isinstance(self.policy, KvAware) else None
        )

    def route(self, req: RouteRequest, workers: Sequence[WorkerState], now: float, *,
              predict: bool = True) -> Decision:
        """``predict``: record the request's blocks on the winner (False: the caller decides later)."""
        if not workers:
            raise NoWorkerAvailable("no healthy worker is registered")
        cands = self._candidates(req, workers, now)
        free = [c for c in cands if not c.score.busy]
        prefix = ""
        hot: HotPrefixNote | None = None
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
            chosen, reason, hot = self._choose_free(req, cands, free, now)
            if len(free) < len(cands):
                prefix = f"{len(cands) - len(free)} busy filtered; "
        wid = chosen.worker.worker_id
        if predict and req.block_hashes:
            self.index.predict(wid, req.block_hashes, now, req.check_hashes)
        return Decision(
            request_id=req.request_id,
            worker_id=wid,
            policy=self.policy.name,
            reason=prefix + reason,
            candidates=tuple(c.score for c in cands),
            overlap_blocks=chosen.score.overlap_blocks,
            hot_prefix=hot,
        )

    def _candidates(self, req: RouteRequest, workers: Sequence[WorkerState], now: float) -> list[Candidate]:
        overlaps = self.index.find_matches(req.block_hashes, now, req.check_hashes) if req.block_hashes else {}
        min_queued = min(queued_prefill(w) for w in workers)
        best_cached = max((overlaps.get(w.worker_id, 0) * w.block_size for w in workers), default=0)
        return [
            Candidate(
                w,
                score(w, req.num_tokens, overlaps.get(w.worker_id, 0), self.cfg, min_queued, best_cached),
                self.index.num_blocks(w.worker_id),
            )
            for w in workers
        ]

    def _choose_free(
        self, req: RouteRequest, cands: list[Candidate], free: list[Candidate], now: float
    ) -> tuple[Candidate, str, HotPrefixNote | None]:
        """Some worker is not busy: a hot prefix's new replica, else the policy among the free ones."""
        hot, note = self.hot, None
        if hot is not None and req.block_hashes:
            i, note = hot.steer(req.block_hashes, cands, now)
            if i >= 0:
                assert note is not None and isinstance(self.policy, KvAware)
                chosen = cands[i]
                self.policy.record(chosen, req.num_tokens, now)
                hot.to_replicas += 1
                return chosen, hot.reason(note, chosen.worker.block_size, chosen.worker.worker_id, True), note
        i, reason = self.policy.choose(free, self.rng, req.num_tokens, now)
        chosen = free[i]
        if note is not None and hot is not None and chosen.worker.worker_id in note.replicas:
            hot.to_replicas += 1
            return chosen, hot.reason(note, chosen.worker.block_size, chosen.worker.worker_id, False) + reason, note
        return chosen, reason, None
