"""Which workers a kv_aware decision over a fleet view scores (``KvRouter`` fast path).

The kv_aware policy (``policies.KvAware``) chooses among the free workers in one of two ways, and
the scored set must contain every worker that way could choose:

* **Cost** (argmin, ties within ``TIE_RELATIVE``, or with a temperature the near-ties within
  ``tie_margin``): the workers holding a prefix of the request are all scored. Every other free
  worker costs at least ``weights.prefill * num_tokens + base_load`` (``cost.base_load``: the
  request-independent terms; the contention term is >= 0), so the free workers are scored in
  ascending ``base_load`` order (``FleetView.free_order``): at least ``candidate_limit`` of them,
  then on while that bound is within ``policy.window(best)`` of the best cost found. Once it is
  not, no worker further down can reach the winning set: the policy's choice (and its random
  draws, as the scored list keeps the fleet's order) is the full scan's.
* **Miss** (every free worker's overlap within ``miss_overlap_fraction`` of the prompt): the free
  workers ready within a pass are ranked by recent prefill traffic (``RecentRequests.order``), and
  those tied with the least are scored.

Bound: past ``candidate_limit``, a scan goes on for at most ``SCAN_FACTOR`` x ``candidate_limit``
workers (and the miss scan visits at most ``VISIT_FACTOR`` x that many). A fleet with more workers
than that within the winning window (a near-empty fleet of identical workers) gets a choice among
the scored ones: as good by the policy's measure, but its random tie-break draws from fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunderagent.config import RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.candidates import FleetView
from thunderagent.router.cost import score
from thunderagent.router.policies import Candidate, KvAware

#: the cost scan scores at most this many times ``candidate_limit`` workers holding no prefix
SCAN_FACTOR = 4
#: the miss scan looks at most at this many times ``SCAN_FACTOR * candidate_limit`` workers
VISIT_FACTOR = 4


@dataclass(slots=True)
class Selection:
    cands: list[Candidate]  # scored workers, in the view's order
    min_queued: int  # over the whole fleet (the cost's credit is relative to it)
    best_cached: int  # tokens, over the whole fleet
    best_overlap: int  # blocks, over the whole fleet


def select(
    num_tokens: int,
    overlaps: dict[str, int],
    view: FleetView,
    index: KvIndex,
    policy: KvAware,
    cfg: RoutingConfig,
    now: float,
) -> Selection:
    min_queued = view.min_queued()
    held: list[tuple[int, int]] = []  # (position, overlap blocks) of the view's workers holding a prefix
    best_cached = best_overlap = 0
    for wid, blocks in overlaps.items():
        i = view.position(wid)
        if i is None or blocks <= 0:
            continue
        held.append((i, blocks))
        best_overlap = max(best_overlap, blocks)
        best_cached = max(best_cached, blocks * view[i].block_size)

    picked: dict[int, Candidate] = {}

    def add(i: int, blocks: int) -> Candidate:
        w = view[i]
        c = picked[i] = Candidate(w, score(w, num_tokens, blocks, cfg, min_queued, best_cached),
                                  index.num_blocks(w.worker_id))
        return c

    best = float("inf")
    free_held: list[int] = []  # overlap tokens of the free workers holding a prefix
    for i, blocks in held:
        c = add(i, blocks)
        if view.is_free(i):
            free_held.append(blocks * c.worker.block_size)
            best = min(best, c.score.cost)

    # cost scan: free workers holding nothing, least base load first, while one could still win
    k = cfg.candidate_limit
    cap = SCAN_FACTOR * k
    floor = cfg.weights.prefill * num_tokens
    # float slack: the bound and score() add the same terms in a different order
    slack = 1e-9 * max(1.0, abs(floor))
    scanned = 0
    for base, i in view.free_order:
        if i in picked:
            continue
        if scanned >= k and (scanned >= cap or floor + base > best + policy.window(best) + slack):
            break
        c = add(i, 0)
        scanned += 1
        if c.score.cost < best:
            best = c.score.cost

    # miss scan: the policy compares overlaps over the free workers; one holding nothing (0) is
    # among them whenever the view has more free workers than free holders
    lo = 0 if view.free_count > len(free_held) else min(free_held)
    hi = max(free_held, default=0)
    if hi - lo <= policy.miss_fraction * num_tokens:
        recent = policy.recent
        low = -1.0
        found = visited = 0
        for _key, wid in recent.order:
            visited += 1
            if visited > VISIT_FACTOR * cap:
                break
            i = view.position(wid)
            if i is None or not view.is_free(i):
                continue
            w = view[i]
            if w.load.queued_prefill_tokens >= w.max_num_batched_tokens:
                continue  # not ready within a pass
            r = recent.rate(wid, now)
            if low < 0:
                low = r
            elif r - low >= 1e-9 or found >= cap:
                break  # past the least recent's ties (same tolerance as the policy)
            found += 1
            if i not in picked:
                add(i, 0)

    return Selection([picked[i] for i in sorted(picked)], min_queued, best_cached, best_overlap)
