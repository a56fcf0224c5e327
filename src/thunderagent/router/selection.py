"""Which workers a kv_aware decision over a fleet view scores (``KvRouter`` fast path).

The kv_aware policy (``policies.KvAware``) chooses among the free workers in one of two ways, and
the scored set must contain every worker that way could choose:

* **Cost** (argmin, ties within ``TIE_RELATIVE``, or with a temperature the near-ties within
  ``tie_margin``): a free worker holding ``d`` leading blocks costs at least
  ``weights.prefill * (num_tokens - overlap_credit * d * block_size) + base_load`` (``cost.base_load``:
  the request-independent terms; the credit only shrinks and the contention term is >= 0). The
  index answers with one mask per match depth (``KvIndex.match_levels``), so a prefix the whole
  fleet holds costs one mask, not one entry per worker. The holders of a *sparse* depth (at most
  ``SCAN_FACTOR * candidate_limit`` workers) are all scored; everyone else is scored in ascending
  ``base_load`` order (``FleetView.free_order``): at least ``candidate_limit`` workers, then on while
  the lowest bound (the deepest dense level's) is within ``policy.window(best)`` of the best cost
  found. Once it is not, no worker further down can reach the winning set: the policy's choice (and
  its random draws, as the scored list keeps the fleet's order) is the full scan's.
* **Miss** (every free worker's overlap within ``miss_overlap_fraction`` of the prompt): the free
  workers ready within a pass are ranked by recent prefill traffic (``RecentRequests.order``), and
  those tied with the least are scored.

Bound: past ``candidate_limit``, a scan scores at most ``SCAN_FACTOR`` x ``candidate_limit``
workers and visits at most ``VISIT_FACTOR`` x that many. A fleet with more workers
than that within the winning window (a near-empty fleet of identical workers) gets a choice among
the scored ones: as good by the policy's measure, but its random tie-break draws from fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunderagent.config import RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.candidates import FleetView, depth
from thunderagent.router.cost import cost_terms, score_terms
from thunderagent.router.policies import Candidate, KvAware

#: scans score at most this many times ``candidate_limit`` workers (and enumerate sparse levels up to it)
SCAN_FACTOR = 4
#: scans visit at most this many times ``SCAN_FACTOR * candidate_limit`` workers
VISIT_FACTOR = 4


@dataclass(slots=True)
class Selection:
    cands: list[Candidate]  # scored workers, in the view's order
    levels: list[tuple[int, int]]  # the index's match levels, restricted to the view's workers
    min_queued: int  # over the whole fleet (the cost's credit is relative to it)
    best_cached: int  # tokens, over the whole fleet
    best_overlap: int  # blocks, over the whole fleet


class _Selector:
    """One decision's selection (see the module docstring); ``run`` returns it.

    Hot path (once per routed request): slots, the view's state list read directly, and the cost's
    request-wide arguments bound once, so scoring a worker is one ``score`` call and one ``Candidate``."""

    __slots__ = ("n", "levels", "view", "states", "bits", "held", "index", "policy", "cfg", "min_queued",
                 "best_overlap", "best_cached", "picked", "best", "k", "cap", "terms")

    def __init__(self, num_tokens: int, levels: list[tuple[int, int]], view: FleetView, bits: list[int],
                 index: KvIndex, policy: KvAware, cfg: RoutingConfig, held: int = 0) -> None:
        self.n, self.levels, self.view, self.bits, self.held = num_tokens, levels, view, bits, held
        self.states = view.states
        self.index, self.policy, self.cfg = index, policy, cfg
        self.terms = cost_terms(cfg)
        self.min_queued = view.min_queued()
        self.best_overlap = levels[-1][0] if levels else 0
        self.best_cached = 0
        if levels:  # one block size per fleet (the dispatcher's): read it off a deepest holder
            deepest = view.position(index.worker_of(levels[-1][1] & -levels[-1][1]))
            assert deepest is not None
            self.best_cached = self.best_overlap * self.states[deepest].block_size
        self.picked: dict[int, Candidate] = {}
        self.best = float("inf")
        self.k = cfg.candidate_limit
        self.cap = SCAN_FACTOR * self.k

    def add(self, i: int, blocks: int) -> None:
        w = self.states[i]
        s = score_terms(w, self.n, blocks, self.terms, self.min_queued, self.best_cached, self.held)
        self.picked[i] = Candidate(w, s, self.index.num_blocks(w.worker_id))
        if s.cost < self.best:
            self.best = s.cost

    def floor(self, blocks: int, block_size: int) -> float:
        """Lowest possible cost of a worker holding ``blocks`` leading blocks, less its base load."""
        w = self.cfg.weights
        return w.prefill * (self.n - w.overlap_credit * min(blocks * block_size, self.n))

    def run(self, busy_mask: int, now: float) -> Selection:
        levels = self.levels
        # sparse levels: every free holder scored
        dense: list[tuple[int, int]] = []
        sparse = 0
        cap = self.cap
        for blocks, mask in levels:
            if mask.bit_count() > cap:
                dense.append((blocks, mask))
                continue
            sparse |= mask
            free = mask & ~busy_mask
            if free:
                position, worker_of, add = self.view.position, self.index.worker_of, self.add
                while free:
                    low = free & -free
                    free ^= low
                    i = position(worker_of(low))
                    if i is not None:
                        add(i, blocks)
        self._scan(sparse, dense)
        if self._is_miss(busy_mask):
            self._scan_recent(now)
        picked = self.picked
        return Selection([picked[i] for i in sorted(picked)], levels, self.min_queued, self.best_cached,
                         self.best_overlap)

    def _scan(self, sparse: int, dense: list[tuple[int, int]]) -> None:
        """The free workers outside the sparse levels, least base load first, while one could win."""
        bits, picked, add = self.bits, self.picked, self.add
        bs = self.states[0].block_size
        lowest = self.floor(0, bs)
        for b, _ in dense:
            f = self.floor(b, bs)
            if f < lowest:
                lowest = f
        slack = 1e-9 * max(1.0, abs(lowest))
        window = self.policy.window
        k, cap, limit = self.k, self.cap, VISIT_FACTOR * self.cap
        scored = visited = 0
        for base, i in self.view.free_order:
            visited += 1
            if scored >= k and (scored >= cap or visited > limit
                                or lowest + base > self.best + window(self.best) + slack):
                break
            bit = bits[i]
            if bit & sparse or i in picked:
                continue
            add(i, depth(dense, bit) if dense else 0)
            scored += 1

    def _is_miss(self, busy_mask: int) -> bool:
        """The policy's test (free workers' overlaps within ``miss_overlap_fraction`` of the prompt),
        from the masks: a free worker holding nothing counts 0."""
        free_levels = [(b, m & ~busy_mask) for b, m in self.levels if m & ~busy_mask]
        if not free_levels:
            return True  # every free worker holds nothing
        bs = self.states[0].block_size
        holders = sum(m.bit_count() for _, m in free_levels)
        lo = 0 if self.view.free_count > holders else free_levels[0][0] * bs
        return free_levels[-1][0] * bs - lo <= self.policy.miss_fraction * self.n

    def _scan_recent(self, now: float) -> None:
        """A miss: the free workers ready within a pass with the least recent traffic (and its ties)."""
        view, recent, picked, states = self.view, self.policy.recent, self.picked, self.states
        position, is_free, rate = view.position, view.is_free, recent.rate
        limit = VISIT_FACTOR * self.cap
        low = -1.0
        found = visited = 0
        for _key, wid in recent.order:
            visited += 1
            if visited > limit:
                break
            i = position(wid)
            if i is None or not is_free(i):
                continue
            w = states[i]
            if w.load.queued_prefill_tokens >= w.max_num_batched_tokens:
                continue  # not ready within a pass
            r = rate(wid, now)
            if low < 0:
                low = r
            elif r - low >= 1e-9 or found >= self.cap:
                break  # past the least recent's ties (the policy's tolerance)
            found += 1
            if i not in picked:
                self.add(i, depth(self.levels, self.bits[i]))


def select(num_tokens: int, levels: list[tuple[int, int]], view: FleetView, bits: list[int], view_mask: int,
           index: KvIndex, policy: KvAware, cfg: RoutingConfig, now: float, held: int = 0) -> Selection:
    """``levels``: ``index.match_levels`` of the request; ``bits``: the index bit of each view position
    (0 for a worker the index does not know); ``view_mask``: their union; ``held``: the scheduler's
    backlog per worker (``RouteRequest.held``)."""
    busy_mask = 0
    for i in view.busy_positions:
        busy_mask |= bits[i]
    # restrict to the view's workers (an index may know workers the driver does not route to)
    levels = [(b, m) for b, m in ((b, m & view_mask) for b, m in levels) if m]
    return _Selector(num_tokens, levels, view, bits, index, policy, cfg, held).run(busy_mask, now)
