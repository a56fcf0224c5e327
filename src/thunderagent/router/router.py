"""KvRouter: index match + cost + policy + prediction, one call per request.

``route`` is pure and synchronous: it takes the request's precomputed block hashes, the routable
workers' states and ``now``; it returns a :class:`Decision` that explains itself, and records a
prediction in the index (the request's blocks will be on the winner shortly; events confirm it).
With ``routing.hot_prefix.enabled`` (kv_aware only), a hot prefix's request may go to a new replica
instead (``router/hot.py``); the decision then says so.

Handed a :class:`~thunderagent.router.candidates.FleetView` of more than ``routing.candidate_limit``
and ``routing.whole_scan_max_workers`` workers with some free, the kv_aware policy (hot prefixes off)
scores only the workers that can win (``router/selection.py``) and the decision's ``candidates`` are
computed when first read (:class:`~thunderagent.router.candidates.LazyScores`): the explanation costs
nothing unless a request, the decision log or a test asks for it. Any other case scans every worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from thunderagent.config import Policy, RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.candidates import FleetView, LazyScores
from thunderagent.router.cost import CostTerms, cost_terms, load_key, queued_prefill, score_terms
from thunderagent.router.errors import NoWorkerAvailable
from thunderagent.router.hot import HotPrefixes
from thunderagent.router.policies import Candidate, KvAware, make_policy
from thunderagent.router.selection import select
from thunderagent.decision import Decision, HotPrefixNote, literal
from thunderagent.types import RouteRequest, WorkerState


def holding(req: RouteRequest, workers: Sequence[WorkerState]) -> Sequence[WorkerState]:
    """The workers that can hold ``req`` (a mixed fleet's smaller workers would end it unserved). When
    none can, all of them: the frontend refuses what no registered worker holds, so this is a race with
    a worker leaving, and the engine's own refusal then names the limit."""
    total = req.num_tokens + req.max_tokens
    if isinstance(workers, FleetView) and total <= workers.seq_floor and req.num_tokens <= workers.prompt_floor:
        return workers  # O(1): every worker holds it
    fit = [w for w in workers if w.holds(req.num_tokens, total)]
    return workers if not fit or len(fit) == len(workers) else fit


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

        # the fleet-view fast path: kv_aware's choice is provably among few workers (selection.py)
        self._fast = self.hot is None and isinstance(self.policy, KvAware)
        # up to here the whole scan is cheaper than the selection's bookkeeping (measured interleaved: 0.83x
        # its time at 8 workers, 0.87x at 16, 1.02x at 24), and its choice is the selection's (which scores
        # every worker that could win while the fleet is within 4 x candidate_limit)
        self._whole_scan_max = max(cfg.candidate_limit, cfg.whole_scan_max_workers)
        # (view, its version, the index's epoch) the next two were derived for. The view itself, not its
        # id(): the registry builds views of part of the fleet as workers leave routing, and a freed view's
        # id can be reused by the next one, of the same size and version.
        self._tracked: tuple[FleetView | None, int, int] = (None, -1, -1)
        self._bits: list[int] = []  # index bit of each view position
        self._view_mask = 0
        self._terms_of = cfg  # the config ``_terms`` were read from
        self._terms: CostTerms = cost_terms(cfg)

    def route(self, req: RouteRequest, workers: Sequence[WorkerState], now: float, *,
              predict: bool = True) -> Decision:
        """``predict``: record the request's blocks on the winner (False: the caller decides later)."""
        if not workers:
            raise NoWorkerAvailable("no healthy worker is registered")
        fit = holding(req, workers)
        too_small, workers = len(workers) - len(fit), fit
        if (self._fast and isinstance(workers, FleetView) and workers.free_count
                and len(workers) > self._whole_scan_max):
            return self._route_view(req, workers, now, predict)
        cands = self._candidates(req, workers, now)
        free = [c for c in cands if not c.score.busy]
        prefix = ""  # literal text before the reason's format string: no braces in it
        hot: HotPrefixNote | None = None
        if not free and self.cfg.fallback == "policy":
            # Every worker is saturated: busy filtering tells nothing apart, so choose among all.
            # Cache hits matter most here: they cut the work the whole fleet is queued behind.
            i, (why, args) = self.policy.choose(cands, self.rng, req.num_tokens, now)
            chosen, prefix = cands[i], "all workers busy; "
        elif not free:
            if self.cfg.fallback == "reject":
                raise NoWorkerAvailable(f"all {len(cands)} workers are busy", retry_after=1.0)
            best = min(cands, key=lambda c: load_key(c.worker))
            chosen, why, args = best, "all workers busy: fallback to least loaded", ()
        else:
            chosen, why, args, hot = self._choose_free(req, cands, free, now)
            if len(free) < len(cands):
                prefix = f"{len(cands) - len(free)} busy filtered; "
        if too_small:  # a mixed fleet's workers too small for it were never candidates
            prefix = f"{too_small} cannot hold it; {prefix}"
        wid = chosen.worker.worker_id
        if predict and req.block_hashes:
            self.index.predict(wid, req.block_hashes, now, req.check_hashes)
        return Decision(
            request_id=req.request_id,
            worker_id=wid,
            policy=self.policy.name,
            why=prefix + why if prefix else why,
            why_args=args,
            candidates=tuple(c.score for c in cands),
            overlap_blocks=chosen.score.overlap_blocks,
            hot_prefix=hot,
            best_overlap_blocks=_best_overlap(cands),
            fallback=not free,
            busy_filtered=len(cands) - len(free) if free else 0,
        )

    def _route_view(self, req: RouteRequest, view: FleetView, now: float, predict: bool) -> Decision:
        policy = self.policy
        assert isinstance(policy, KvAware)
        index = self.index
        tracked = self._tracked
        if tracked[0] is not view or tracked[1] != view.version or tracked[2] != index.epoch:  # O(n), rare
            recent = policy.recent
            here = {w.worker_id for w in view}
            for wid in recent.tracked:
                if wid not in here and not index.bit_of(wid):
                    # left the fleet: its rate only decays, so it would sort first in the miss scan's
                    # order for good, and enough of them would fill the entries that scan visits
                    recent.forget(wid)
            for w in view:
                recent.track(w.worker_id)  # rank new workers by recent traffic
            self._bits = [index.bit_of(w.worker_id) for w in view]  # a new list: LazyScores keep the old
            self._view_mask = sum(self._bits)
            self._tracked = (view, view.version, index.epoch)
        levels = index.match_levels(req.block_hashes, now, req.check_hashes) if req.block_hashes else []
        sel = select(req.num_tokens, levels, view, self._bits, self._view_mask, index, policy, self.cfg, now,
                     req.held)
        free = [c for c in sel.cands if not c.score.busy]
        i, (why, args) = policy.choose(free, self.rng, req.num_tokens, now)
        chosen = free[i]
        busy = len(view) - view.free_count
        if busy:
            why = f"{busy} busy filtered; " + why
        wid = chosen.worker.worker_id
        if predict and req.block_hashes:
            self.index.predict(wid, req.block_hashes, now, req.check_hashes)
        return Decision(
            request_id=req.request_id,
            worker_id=wid,
            policy=policy.name,
            why=why,
            why_args=args,
            candidates=LazyScores(view, req.num_tokens, sel.levels, self._bits, sel.min_queued, sel.best_cached,
                                  self.cfg, req.held),
            overlap_blocks=chosen.score.overlap_blocks,
            best_overlap_blocks=sel.best_overlap,
            busy_filtered=busy,
        )

    def _candidates(self, req: RouteRequest, workers: Sequence[WorkerState], now: float) -> list[Candidate]:
        """Every worker scored, in the workers' order. Plain loops: compiled, a generator handed to ``min`` /
        ``max`` is a generic call, a loop is native code."""
        index = self.index
        overlaps = index.find_matches(req.block_hashes, now, req.check_hashes) if req.block_hashes else {}
        ws = list(workers)  # one pass of the view's iterator, which is interpreted
        min_queued = queued_prefill(ws[0])
        best_cached = 0
        for w in ws:
            queued = queued_prefill(w)
            if queued < min_queued:
                min_queued = queued
            if overlaps:
                cached = overlaps.get(w.worker_id, 0) * w.block_size
                if cached > best_cached:
                    best_cached = cached
        terms = self._cost_terms()
        num_tokens, held = req.num_tokens, req.held
        out: list[Candidate] = []
        for w in ws:
            wid = w.worker_id
            s = score_terms(w, num_tokens, overlaps.get(wid, 0), terms, min_queued, best_cached, held)
            out.append(Candidate(w, s, index.num_blocks(wid)))
        return out

    def _cost_terms(self) -> CostTerms:
        """The cost's constants, read off the config once per config: the config is frozen, and a new one
        (the weight tuner's step, ``router/autotune.py``) is a new object."""
        cfg = self.cfg
        if cfg is not self._terms_of:
            self._terms = cost_terms(cfg)
            self._terms_of = cfg
        return self._terms

    def _choose_free(
        self, req: RouteRequest, cands: list[Candidate], free: list[Candidate], now: float
    ) -> tuple[Candidate, str, tuple[object, ...], HotPrefixNote | None]:
        """Some worker is not busy: a hot prefix's new replica, else the policy among the free ones.
        Returns the choice, its reason (format string and arguments) and the hot prefix's note."""
        hot, note = self.hot, None
        if hot is not None and req.block_hashes:
            i, note = hot.steer(req.block_hashes, cands, now)
            if i >= 0:
                assert note is not None and isinstance(self.policy, KvAware)
                chosen = cands[i]
                self.policy.record(chosen, req.num_tokens, now)
                hot.to_replicas += 1
                # no arguments: the reason is taken as it is, never formatted
                return chosen, hot.reason(note, chosen.worker.block_size, chosen.worker.worker_id, True), (), note
        i, (why, args) = self.policy.choose(free, self.rng, req.num_tokens, now)
        chosen = free[i]
        if note is not None and hot is not None and chosen.worker.worker_id in note.replicas:
            hot.to_replicas += 1
            head = hot.reason(note, chosen.worker.block_size, chosen.worker.worker_id, False)
            return chosen, literal(head) + why if args else head + why, args, note
        return chosen, why, args, None


def _best_overlap(cands: list[Candidate]) -> int:
    best = 0
    for c in cands:
        if c.score.overlap_blocks > best:
            best = c.score.overlap_blocks
    return best
