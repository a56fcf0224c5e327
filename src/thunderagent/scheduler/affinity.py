"""Cache affinity at dispatch: which held request goes when some workers can start one and others cannot.

Pure and clock-free (``now`` is passed in). The holding queue orders a route key's requests by their
uncached prompt tokens *anywhere* in the fleet (estimated at enqueue), less ageing. When a worker frees
up while the others are still full, the queue's head may be a request whose cache sits on one of the
full workers: routed now, it either recomputes its prefix on the free worker or waits in its holder's
engine. A request a few places behind it may find its own prefix on the free worker. So the next
request is the best of the ``scheduler.affinity_candidates`` at the head of the key's order, re-ranked by
the uncached tokens *on the workers that can start it now* (the index's current matches, predictions
included), with the same ageing: an SGLang-style longest-prefix-first pick, restricted to a bounded
window so that priorities and ``max_wait_s`` (an overdue request is forced through before this is asked)
keep their meaning. The window also holds the best request of other route keys of the same tier: one of
those sent out of its key's turn is charged to its key's deficit, which may go at most one quantum below
zero, so deficit round robin's shares hold over time (per-user keys, e.g. the body's ``user``, would
otherwise leave one request per key and nothing to choose from).

Re-ranked by the uncached tokens on the free workers alone, a candidate whose long prefix sits on a full
worker still wins over a fresh request of the same size, and the free worker computes that prefix a second
time: the fleet spends capacity on cache it has, exactly when it is overloaded. So each token the free
workers would recompute although a full worker holds it counts ``scheduler.affinity_recompute_weight`` times
more (a fresh request costs what it costs anywhere; one that can wait for its holder ranks behind it).

Measured on the Mooncake conversation trace x8 (README "Scheduler"): more of each prompt served from
cache, so the overloaded fleet drains faster; both the mean and the tail of TTFT fall.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from thunderagent.config import RoutingConfig, SchedulerConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.cost import is_busy, queued_prefill
from thunderagent.scheduler.queue import Held, HoldingQueue
from thunderagent.types import EngineRequest, WorkerState


def uncached_on(req: EngineRequest, index: KvIndex, block_size: int, now: float, within: int) -> int:
    """Prompt tokens ``req`` would prefill on the best worker of those whose ``bit_of`` bits are in ``within``, its
    longest cached prefix there per the index. Within a mask the index's walk stops at the first
    block none of those workers holds: a candidate whose prefix sits on full workers costs a block or two."""
    n = len(req.prompt_tokens)
    if not req.block_hashes:
        return n
    # (the double-hash guard as the router's: the check hashes cut unverified blocks)
    levels = index.match_levels(req.block_hashes, now, req.check_hashes, within)
    best = max((blocks for blocks, _ in levels), default=0)
    return n - min(best * block_size, n)


def estimate(req: EngineRequest, index: KvIndex, block_size: int, now: float) -> tuple[int, int]:
    """At enqueue: the prompt tokens ``req`` would prefill on the best worker, and the workers holding that
    longest prefix (a mask of ``bit_of`` bits; 0 when no worker holds any of its blocks)."""
    n = len(req.prompt_tokens)
    if not req.block_hashes:
        return n, 0
    levels = index.match_levels(req.block_hashes, now, req.check_hashes)
    if not levels:
        return n, 0
    blocks, holders = levels[-1]
    return n - min(blocks * block_size, n), holders


def cost_on(req: EngineRequest, index: KvIndex, block_size: int, now: float, free: int, recompute_weight: float,
            bound: float = math.inf, levels: list[tuple[int, int]] | None = None) -> float:
    """What sending ``req`` to the workers of ``free`` (a mask of ``bit_of`` bits) costs the fleet, in prompt tokens:
    the tokens it would prefill on the best of them (a walk restricted to ``free``, which stops at the first block
    none of them holds), plus ``recompute_weight`` times those of them that some other (full) worker holds, i.e.
    cache the fleet has and would compute again (a walk over the whole fleet). Exact below ``bound``; at or above
    it the figure is only a lower bound: the second walk stops once the cost has reached ``bound`` (a candidate
    that cannot beat the best so far is not walked to the end of a 100k-token prompt's cache). ``levels``: that
    whole-fleet walk when the caller made it already (unbounded)."""
    uncached = uncached_on(req, index, block_size, now, free)
    if not recompute_weight or uncached >= bound:
        return uncached
    n = len(req.prompt_tokens)
    here = n - uncached  # whole blocks: the hashes cover full blocks only
    hashes, checks = req.block_hashes, req.check_hashes
    if bound != math.inf:  # blocks past ``here`` worth ``bound`` in weighted tokens, and one more
        limit = here // block_size + int((bound - uncached) / (recompute_weight * block_size)) + 1
        if limit < len(hashes):
            hashes, checks = hashes[:limit], None if checks is None else checks[:limit]
    anywhere = 0
    for blocks, _ in index.match_levels(hashes, now, checks) if levels is None else levels:
        anywhere = max(anywhere, blocks)
    return uncached + recompute_weight * max(0, min(anywhere * block_size, n) - here)


def holder_queue(sent: Mapping[str, int], routing: RoutingConfig) -> Callable[[WorkerState], int]:
    """:func:`choose`'s ``queued``: the uncached prompt tokens sent to a worker and not prefilled yet, the larger of
    the dispatcher's own count (``sent``, exact at once) and the worker's last report. A worker the router would
    refuse as busy (``routing.fallback: reject``) counts as unbounded: a head sent there would not be routed."""
    reject = routing.fallback == "reject"

    def queued(w: WorkerState) -> int:
        if reject and is_busy(w, routing):
            return 1 << 62
        return max(sent.get(w.worker_id, 0), queued_prefill(w))
    return queued


def choose(queue: HoldingQueue, held: Held, workers: Sequence[WorkerState], startable: Callable[[WorkerState], bool],
           cfg: SchedulerConfig, index: KvIndex, block_size: int, now: float,
           queued: Callable[[WorkerState], int] | None = None) -> tuple[Held, Sequence[WorkerState]]:
    """What goes instead of ``held`` (the queue's next, neither overdue-forced nor pinned) given which of
    ``workers`` can start a request now, and where it may go: ``held`` itself, anywhere, while every worker can
    (the queue's order already counts the whole fleet's cache) or none can, with ``affinity_candidates`` 1, and
    with prefill-role workers in the pool (disaggregation: the prefix that matters is on the prefill tier, which
    this gate does not judge). When ``held`` stays the best (no other candidate costs the free workers less) but
    a full worker holds more of its prompt than any free one, it goes to those of its deepest holders whose queued
    prefill (``queued``: uncached prompt tokens sent there and not prefilled yet; None: no holder may queue it,
    as under the latency gate) is at most what the free workers would recompute: it waits there no longer than
    that recomputation would take, the fleet computes less, and the free workers take the next candidates. (Only
    with ``affinity_recompute_weight`` above 0. The bound keeps a hot prefix's requests from piling onto one
    holder while other workers idle: past it they recompute the prefix once elsewhere. A holder whose KV is full
    of running requests is not kept out: its engine admits the request as blocks free, and keeping those out gave
    back most of the gain on the Mooncake trace, 1,532 against 1,395 ms mean at x8.)"""
    if cfg.affinity_candidates <= 1:
        return held, workers
    free, full = 0, False  # the workers that can start a request now, as a mask of the index's bits
    for w in workers:
        if w.role == "prefill":
            return held, workers
        if startable(w):
            free |= index.bit_of(w.worker_id)
        else:
            full = True
    if not free or not full:
        return held, workers
    weight = cfg.affinity_recompute_weight
    # the head's walk over the whole fleet: its cost in ``pick`` and, if it stays, where its deepest holders are
    levels = index.match_levels(held.req.block_hashes, now, held.req.check_hashes) if weight else None
    best = pick(queue, held, free, cfg.affinity_candidates, index, block_size, now, weight, levels)
    if best is not held or queued is None or levels is None:
        return best, workers
    if not levels or levels[-1][1] & free:  # (a free worker is among the deepest holders)
        return held, workers
    deep, holders = levels[-1]
    recompute = (deep - max((b for b, m in levels if m & free), default=0)) * block_size
    pool = [w for w in workers if index.bit_of(w.worker_id) & holders and queued(w) <= recompute]
    return held, pool or workers


def pick(queue: HoldingQueue, held: Held, startable: int, k: int, index: KvIndex, block_size: int,
         now: float, recompute_weight: float = 0.0, held_levels: list[tuple[int, int]] | None = None) -> Held:
    """The request to dispatch instead of ``held`` (the queue's next, not overdue), among it, the ``k - 1`` that
    follow it in its key's order and the best of up to ``k - 1`` other route keys of its tier that may borrow
    (:meth:`HoldingQueue.peers`: one of those goes out of its key's turn, which its key repays from its next
    rounds): the lowest rank with its uncached tokens counted on ``startable`` (the workers that can start a
    request now, as a mask of ``KvIndex.bit_of`` bits) and, with ``recompute_weight``, the tokens a full worker
    holds that they would compute again weighted in (:func:`cost_on`). Ties keep the queue's order. Requests
    pinned to a worker (a released follower, a stored response's continuation) are not candidates: where they go
    is decided. ``held_levels``: ``held``'s whole-fleet walk, when the caller made it."""
    w = recompute_weight
    best, best_rank = held, queue.rank(held, cost_on(held.req, index, block_size, now, startable, w,
                                                     levels=held_levels))
    for cand in (*queue.candidates(held, k, startable), *queue.peers(held, k - 1, now, startable)):
        if cand is held or cand.pin is not None:
            continue
        # (the rank is linear in the cost: the cost that would tie the best so far bounds the walk)
        rank = queue.rank(cand, cost_on(cand.req, index, block_size, now, startable, w,
                                        best_rank - queue.rank(cand, 0)))
        if rank < best_rank:
            best, best_rank = cand, rank
    return best
