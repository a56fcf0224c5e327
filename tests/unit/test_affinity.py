"""Cache affinity at dispatch (``scheduler/affinity.py``): when a worker frees up while its peers are full, the
held request whose prefix that worker holds goes ahead of the queue's head, within ``affinity_candidates``."""

from __future__ import annotations

import random

from thunderagent.config import RoutingConfig, SchedulerConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.scheduler import affinity
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.scheduler.queue import Held, HoldingQueue
from thunderagent.types import BlockStored, EngineRequest, LoadReport, WorkerState

BS = 16
A = list(range(64))  # a 4-block prefix cached on w0
B = list(range(100, 164))  # another, cached on w1


def _worker(wid: str, waiting: int = 0) -> WorkerState:
    # no slots reported: the engine-reported gate lets a worker start a request while nothing waits in its engine
    return WorkerState(wid, BS, 8192, 64, LoadReport(wid, 0.0, 0, waiting, 0, 0, 0, 0, 1000))


def _fleet(routing: dict[str, object] | None = None, **sched: object) -> tuple[Dispatcher, KvIndex]:
    index = KvIndex(prediction_ttl=60.0)
    for w in ("w0", "w1"):
        index.add_worker(w)
    d = Dispatcher(KvRouter(RoutingConfig(seed=1, **(routing or {})), index, random.Random(1)), BS,
                   SchedulerConfig(**{"enabled": True, "aging_tokens_per_s": 0.0, **sched}))
    for wid, prompt in (("w0", A), ("w1", B)):  # stored by an engine that hashed the tokens itself (verified)
        req = d.prepare(wid, prompt, 1)
        index.apply_event(BlockStored(wid, 0, tuple(req.block_hashes), None, tuple(req.check_hashes or ())), 0.0)
    return d, index


def _hold(d: Dispatcher, full: list[WorkerState]) -> None:
    """Three requests held while both workers are full: on A (16 new tokens), on B (32 new), and one with no
    cache anywhere (8 tokens: the queue's head)."""
    assert d.submit(d.prepare("a2", A + [1] * 16, 4), "", full, 0.0) is None
    assert d.submit(d.prepare("b2", B + [2] * 32, 4), "", full, 0.1) is None
    assert d.submit(d.prepare("c", [3] * 8, 4), "", full, 0.2) is None


def test_a_freed_worker_takes_the_request_whose_prefix_it_holds_before_the_queues_head() -> None:
    d, _ = _fleet()
    _hold(d, [_worker("w0", 1), _worker("w1", 1)])
    # the queue's order counts the whole fleet's cache: c (8 uncached) < a2 (16) < b2 (32)
    assert [h.req.request_id for h in d.queue.candidates(d.queue.next(0.3), 8)] == ["c", "a2", "b2"]
    # w1 frees up, w0 is still full: on w1, c costs 8, a2 80 and b2 32 -> c still goes first (fewest)
    first = d.pump([_worker("w0", 1), _worker("w1", 0)], 0.3)
    assert first is not None and first.request.request_id == "c" and not first.affinity
    # then b2 (32 on w1) overtakes a2 (16 on the full w0, 80 on w1), and lands on its cache
    second = d.pump([_worker("w0", 1), _worker("w1", 0)], 0.4)
    assert second is not None and second.request.request_id == "b2" and second.affinity
    assert second.decision.worker_id == "w1" and second.predicted_tokens == 64
    assert len(d.queue) == 1 and d.queue.next(0.5).req.request_id == "a2"


def test_with_every_worker_free_or_one_candidate_the_queues_order_stands() -> None:
    d, _ = _fleet(affinity_candidates=1)
    _hold(d, [_worker("w0", 1), _worker("w1", 1)])
    half = [_worker("w0", 1), _worker("w1", 0)]
    assert [d.pump(half, t).request.request_id for t in (0.3, 0.4, 0.5)] == ["c", "a2", "b2"]
    d2, _ = _fleet()
    _hold(d2, [_worker("w0", 1), _worker("w1", 1)])
    free = [_worker("w0", 0), _worker("w1", 0)]
    out = [d2.pump(free, t) for t in (0.3, 0.4, 0.5)]
    assert [x.request.request_id for x in out] == ["c", "a2", "b2"] and not any(x.affinity for x in out)


def test_only_the_first_candidates_of_the_key_are_re_ranked() -> None:
    d, _ = _fleet(affinity_candidates=2)
    full = [_worker("w0", 1), _worker("w1", 1)]
    _hold(d, full)
    # with 2 candidates b2 is out of reach at first: c against a2 -> c
    half = [_worker("w0", 1), _worker("w1", 0)]
    assert d.pump(half, 0.3).request.request_id == "c"
    second = d.pump(half, 0.4)  # now the first two are a2 and b2: b2 goes
    assert second.request.request_id == "b2" and second.affinity
    d3, _ = _fleet(affinity_candidates=2)
    _hold(d3, full)
    assert d3.submit(d3.prepare("tiny", [4] * 4, 4), "", full, 0.25) is None  # now tiny (4), c (8) lead
    assert [d3.pump(half, t).request.request_id for t in (0.3, 0.4)] == ["tiny", "c"]


def test_ageing_counts_in_the_re_ranking_and_overdue_requests_go_as_before() -> None:
    d, _ = _fleet(max_wait_s=5.0)
    _hold(d, [_worker("w0", 1), _worker("w1", 1)])
    half = [_worker("w0", 1), _worker("w1", 0)]
    # at 5.05 a2 (held at 0.0) is overdue and forced through first, then b2 and c are ranked on w1
    assert d.pump(half, 5.05).request.request_id == "a2"
    q = HoldingQueue(SchedulerConfig(enabled=True, aging_tokens_per_s=100.0))
    old = Held(EngineRequest("old", [1] * 50, [], 0, 4), "", 0, 0.0, 50)
    new = Held(EngineRequest("new", [1] * 10, [], 0, 4), "", 0, 1.0, 10)
    # rank = uncached + age x enqueued: old 50 + 0 against new 10 + 100 -> old first, whatever the clock
    assert q.rank(old, 50) < q.rank(new, 10)
    q.push(old, 0.0)
    q.push(new, 1.0)
    assert [h.req.request_id for h in q.candidates(q.next(1.0), 8)] == ["old", "new"]
    q.cancel("old")
    assert [h.req.request_id for h in q.candidates(q.next(1.0), 8)] == ["new"]  # gone entries dropped


def test_affinity_never_crosses_a_priority_tier_and_borrows_across_route_keys() -> None:
    d, _ = _fleet()
    full = [_worker("w0", 1), _worker("w1", 1)]
    half = [_worker("w0", 1), _worker("w1", 0)]
    # the head is a2 (cached on the full w0) at priority 1; b2, cached on the free w1, waits at priority 0
    assert d.submit(d.prepare("a2", A + [1] * 16, 4, priority=1), "", full, 0.0) is None
    assert d.submit(d.prepare("b2", B + [2] * 32, 4), "", full, 0.1) is None
    first = d.pump(half, 0.2)
    assert first.request.request_id == "a2" and not first.affinity  # strict tiers: b2 is no candidate
    # route key "x" holds a2, key "y" holds b2 (32 uncached at enqueue) and b3: round robin gives x the first turn
    d2, _ = _fleet(drr_quantum_tokens=100)
    assert d2.submit(d2.prepare("a2", A + [1] * 16, 4), "x", full, 0.0) is None
    assert d2.submit(d2.prepare("b2", B + [2] * 32, 4), "y", full, 0.1) is None
    assert d2.submit(d2.prepare("b3", [5] * 200, 4), "y", full, 0.15) is None
    out = d2.pump(half, 0.2)
    # b2 goes out of y's turn for its cache on w1, and y owes its cost: deficit 0 - 32 (at most one quantum)
    assert out.request.request_id == "b2" and out.affinity and out.route_key == "y"
    assert d2.queue._tiers[0].keys["y"].deficit == -32.0
    assert d2.pump(half, 0.3).request.request_id == "a2"  # x's turn was kept
    # with a quantum of 16 a 32-token debt is too deep: no borrowing, x's a2 goes first
    d3, _ = _fleet(drr_quantum_tokens=16)
    assert d3.submit(d3.prepare("a2", A + [1] * 16, 4), "x", full, 0.0) is None
    assert d3.submit(d3.prepare("b2", B + [2] * 32, 4), "y", full, 0.1) is None
    assert d3.pump(half, 0.2).request.request_id == "a2"


def test_recomputing_a_full_workers_prefix_counts_against_a_candidate() -> None:
    """a2's 64-token prefix sits on w0 (full); f is fresh (96 tokens, cached nowhere). The queue's order puts a2
    first (16 uncached anywhere against 96). On the free w1, a2 would prefill 80 tokens, 64 of them the fleet
    holds: weighted 0 it still costs less than f (80 < 96) and goes first, recomputing w0's prefix; weighted 3
    it costs 80 + 3 x 64 = 272, so f goes ahead and a2 waits for its holder."""
    full = [_worker("w0", 1), _worker("w1", 1)]
    half = [_worker("w0", 1), _worker("w1", 0)]
    picked = {}
    for weight in (0.0, 3.0):
        d, index = _fleet(affinity_recompute_weight=weight)
        assert d.submit(d.prepare("a2", A + [1] * 16, 4), "", full, 0.0) is None
        assert d.submit(d.prepare("f", [7] * 96, 4), "", full, 0.1) is None
        free = index.bit_of("w1")
        assert [affinity.cost_on(h.req, index, BS, 0.2, free, weight)
                for h in d.queue.candidates(d.queue.next(0.2), 8)] == ([80, 96] if not weight else [272.0, 96])
        out = d.pump(half, 0.2)
        picked[weight] = (out.request.request_id, out.affinity)
    assert picked == {0.0: ("a2", False), 3.0: ("f", True)}
    # (the default weight is 3) a2 is still held, first in line for when its holder can start it
    d, _ = _fleet()
    assert d.submit(d.prepare("a2", A + [1] * 16, 4), "", full, 0.0) is None
    assert d.submit(d.prepare("f", [7] * 96, 4), "", full, 0.1) is None
    assert d.pump(half, 0.2).request.request_id == "f"
    assert len(d.queue) == 1 and d.queue.next(0.3).req.request_id == "a2"


def test_candidates_skip_requests_whose_cache_sits_on_full_workers_only() -> None:
    """At enqueue each request records the workers holding its longest cached prefix (``Held.holders``): a2 and
    a3 -> w0, b2 -> w1, c -> none. When only w1 can start a request, a2 and a3 would recompute w0's prefix there:
    the window of 2 candidates looks past them (at most 4 x 2 live entries) to b2, which goes on its cache."""
    d, index = _fleet(affinity_candidates=2)
    full = [_worker("w0", 1), _worker("w1", 1)]
    assert d.submit(d.prepare("a2", A + [1] * 16, 4), "", full, 0.0) is None
    assert d.submit(d.prepare("a3", A + [1] * 20, 4), "", full, 0.1) is None
    assert d.submit(d.prepare("b2", B + [2] * 32, 4), "", full, 0.2) is None
    assert d.submit(d.prepare("c", [3] * 48, 4), "", full, 0.3) is None
    w0, w1 = index.bit_of("w0"), index.bit_of("w1")
    q = d.queue
    head = q.next(0.4)
    assert [(h.req.request_id, h.holders) for h in q.candidates(head, 8)] == [
        ("a2", w0), ("a3", w0), ("b2", w1), ("c", 0)]
    assert [h.req.request_id for h in q.candidates(head, 2, w1)] == ["a2", "b2"]  # the head always; a3 skipped
    assert [h.req.request_id for h in q.candidates(head, 3, w1)] == ["a2", "b2", "c"]  # c: held nowhere, fits any
    assert [h.req.request_id for h in q.candidates(head, 1, w1)] == ["a2"]
    assert [h.req.request_id for h in q.candidates(head, 2, w0)] == ["a2", "a3"]
    out = d.pump([_worker("w0", 1), _worker("w1", 0)], 0.4)
    assert out.request.request_id == "b2" and out.affinity and out.decision.worker_id == "w1"
    # a key whose best is held by full workers only offers no peer
    d2, index2 = _fleet()
    assert d2.submit(d2.prepare("a2", A + [1] * 16, 4), "x", full, 0.0) is None
    assert d2.submit(d2.prepare("a3", A + [1] * 20, 4), "y", full, 0.1) is None
    assert d2.submit(d2.prepare("b2", B + [2] * 32, 4), "z", full, 0.2) is None
    head2 = d2.queue.next(0.3)
    assert head2.req.request_id == "a2"
    assert [h.req.request_id for h in d2.queue.peers(head2, 4, 0.3)] == ["a3", "b2"]
    assert [h.req.request_id for h in d2.queue.peers(head2, 4, 0.3, index2.bit_of("w1"))] == ["b2"]


def test_a_candidates_cost_is_exact_below_its_bound_and_walked_no_further_above_it() -> None:
    """a2 on the free w1: 80 tokens to prefill, 64 of them held by w0 (4 blocks): 80 + 3 x 64 = 272. Below a bound
    the figure is exact; at or above it the walk over the whole fleet stops once the cost reaches the bound (here
    after one block: 80 + 3 x 16 = 128 >= 100), and a candidate with more to prefill than the bound is not walked."""
    d, index = _fleet()
    req = d.prepare("a2", A + [1] * 16, 4)
    w1 = index.bit_of("w1")
    assert affinity.cost_on(req, index, BS, 0.0, w1, 3.0) == 272
    assert affinity.cost_on(req, index, BS, 0.0, w1, 3.0, bound=273.0) == 272
    assert affinity.cost_on(req, index, BS, 0.0, w1, 3.0, bound=272.0) == 272  # (ties lose: 272 >= 272)
    assert affinity.cost_on(req, index, BS, 0.0, w1, 3.0, bound=100.0) == 128
    assert affinity.cost_on(req, index, BS, 0.0, w1, 3.0, bound=80.0) == 80
    assert affinity.cost_on(req, index, BS, 0.0, index.bit_of("w0"), 3.0, bound=20.0) == 16  # on its holder: 16


def test_a_head_no_free_worker_holds_goes_to_its_holders_queue_instead_of_recomputing() -> None:
    """Only a2 is held; its 64-token prefix sits on w0, whose KV is 99 % full of running requests (busy: the router
    alone leaves it out and sends a2 to the free w1, recomputing the prefix). No other candidate is better for w1,
    and w0 holds more of a2's prompt than any free worker, with no more queued prefill than the 64 tokens w1 would
    recompute: a2 goes to w0's queue. With the recompute weight 0 (the first pass), under the latency gate, or
    when w0's queued prefill passes those 64 tokens (a hot prefix's requests must not pile onto one holder), or when
    the router refuses busy workers (``fallback: reject``), the router decides."""
    def w0(queued: int) -> WorkerState:
        return WorkerState("w0", BS, 8192, 64, LoadReport("w0", 0.0, 1, 0, queued, 0, 990, 0, 1000))

    out = {}
    for label, sched, queued in (("weight 3", {}, 64), ("weight 0", {"affinity_recompute_weight": 0.0}, 64),
                                 ("latency gate", {"prefills_in_flight": 1}, 64), ("65 queued", {}, 65),
                                 ("busy refused", {"routing": {"fallback": "reject"}}, 0)):
        d, _ = _fleet(**sched)  # type: ignore[arg-type]
        full = [w0(queued), _worker("w1", 1)]
        assert d.submit(d.prepare("a2", A + [1] * 16, 4), "", full, 0.0) is None
        got = d.pump([w0(queued), _worker("w1", 0)], 0.1)
        out[label] = (got.request.request_id, got.decision.worker_id, got.predicted_tokens, got.affinity)
    assert out == {"weight 3": ("a2", "w0", 64, False), "weight 0": ("a2", "w1", 0, False),
                   "latency gate": ("a2", "w1", 0, False), "65 queued": ("a2", "w1", 0, False),
                   "busy refused": ("a2", "w1", 0, False)}  # (fallback reject: a busy holder would not be routed)
    # a fresh request (held nowhere) is no holder's: it goes where the router sends it
    d, _ = _fleet()
    assert d.submit(d.prepare("f", [7] * 96, 4), "", [w0(0), _worker("w1", 1)], 0.0) is None
    assert d.pump([w0(0), _worker("w1", 0)], 0.1).decision.worker_id == "w1"
