"""The scheduler's holding queue and the dispatch path around it: exact orders, bounds, cancellation."""

from __future__ import annotations

import random

import pytest

from thunderagent.config import RoutingConfig, SchedulerConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.scheduler.queue import Held, HoldingQueue, QueueFull
from thunderagent.types import EngineRequest, LoadReport, WorkerState

CFG = SchedulerConfig(enabled=True, max_queued=6, max_queued_per_key=4, max_wait_s=10.0, aging_tokens_per_s=100.0,
                      drr_quantum_tokens=1000)


def held(rid: str, uncached: int, *, key: str = "", tier: int = 0, at: float = 0.0) -> Held:
    return Held(EngineRequest(rid, [1] * max(1, uncached), [], 0, 4, priority=tier), key, tier, at, uncached)


def drain(q: HoldingQueue, now: float) -> list[str]:
    out = []
    while (h := q.next(now)) is not None:
        q.take(h, now)
        out.append(h.req.request_id)
    return out


def test_strict_priority_tiers_then_short_first() -> None:
    q = HoldingQueue(CFG)
    for h in (held("lo-big", 900), held("lo-small", 100), held("hi-big", 800, tier=1), held("hi-small", 50, tier=1)):
        q.push(h, 0.0)
    assert q.by_tier() == {0: 2, 1: 2}
    assert drain(q, 0.0) == ["hi-small", "hi-big", "lo-small", "lo-big"]
    assert len(q) == 0 and q.by_tier() == {}


def test_ageing_lets_a_long_wait_beat_a_shorter_prompt() -> None:
    q = HoldingQueue(CFG)
    q.push(held("old-big", 900, at=0.0), 0.0)
    q.push(held("new-small", 500, at=5.0), 5.0)
    # at t=5: old-big scores 900 - 100*5 = 400 < new-small's 500
    assert q.next(5.0).req.request_id == "old-big"
    q2 = HoldingQueue(CFG)
    q2.push(held("old-big", 900, at=0.0), 0.0)
    q2.push(held("new-small", 500, at=1.0), 1.0)
    assert q2.next(1.0).req.request_id == "new-small"  # 800 vs 500: short first


def test_max_wait_goes_first_whatever_the_tier() -> None:
    q = HoldingQueue(CFG)
    q.push(held("starved", 5000, tier=0, at=0.0), 0.0)
    q.push(held("urgent", 10, tier=9, at=9.0), 9.0)
    assert q.next(9.99).req.request_id == "urgent"
    assert q.next(10.0).req.request_id == "starved"  # held max_wait_s: it goes next


def test_deficit_round_robin_shares_a_tier_across_route_keys() -> None:
    q = HoldingQueue(CFG)  # quantum 1000 tokens
    for i in range(3):
        q.push(held(f"a{i}", 600, key="a"), 0.0)  # tenant a: big prompts
    for i in range(3):
        q.push(held(f"b{i}", 100, key="b"), 0.0)  # tenant b: small ones
    # round 1: a earns 1000, sends a0 (600), cannot pay a1 (400 left): b earns 1000, sends all three
    # (300), then a (1400) sends a1 and a2
    assert drain(q, 0.0) == ["a0", "b0", "b1", "b2", "a1", "a2"]


def test_bounds_give_retry_after_from_the_drain_rate() -> None:
    q = HoldingQueue(CFG)
    for i in range(4):
        q.push(held(f"a{i}", 10, key="a"), 0.0)
    with pytest.raises(QueueFull, match="max_queued_per_key") as err:
        q.push(held("a4", 10, key="a"), 0.0)
    assert err.value.retry_after == 1.0  # no drain measured yet
    q.push(held("b0", 10, key="b"), 0.0)
    q.push(held("b1", 10, key="b"), 0.0)
    with pytest.raises(QueueFull, match="scheduler.max_queued"):
        q.push(held("c0", 10, key="c"), 0.0)
    for t in (1.0, 3.0, 5.0):  # one dispatch every 2 s
        q.take(q.next(t), t)
    assert len(q) == 3
    assert q.retry_after(5.0) == 6.0  # 3 ahead x 2 s


def test_a_route_keys_backlog_refuses_its_own_requests_for_the_wait_not_anothers() -> None:
    """``max_queue_delay_s`` counts what deficit round robin sends before a new request: a noisy key's
    next request waits behind its own backlog; a quiet key's first one behind what the noisy key sends
    in one round (a quantum of cost: two of its 400-token requests), not behind its whole backlog; a
    higher tier's behind nothing of a lower tier's."""
    cfg = SchedulerConfig(enabled=True, max_queued=100, max_queued_per_key=100, max_wait_s=60.0,
                          drr_quantum_tokens=1000, max_queue_delay_s=4.5, admit_ttft_factor=None)
    q = HoldingQueue(cfg)
    for i in range(7):
        q.push(held(f"n{i}", 400, key="noisy"), 0.0)  # no drain measured yet: the counts bound alone
    for t in (1.0, 2.0):  # one dispatch a second
        q.take(q.next(t), t)
    assert len(q) == 5
    assert q.ahead(held("x", 400, key="noisy")) == 6  # its own 5, then itself: 6 s
    assert q.ahead(held("x", 400, key="quiet")) == 4  # 1 round: ceil(1000 / 400) = 3 noisy ones, then itself
    assert q.ahead(held("x", 2500, key="quiet")) == 6  # 3 rounds: all 5 noisy ones first
    assert q.ahead(held("x", 400, key="quiet", tier=1)) == 1  # a higher tier goes first
    assert q.ahead(held("x", 400, key="noisy", tier=-1)) == 6  # a lower tier waits for all of tier 0
    with pytest.raises(QueueFull, match="max_queue_delay_s") as err:
        q.push(held("n7", 400, key="noisy", at=2.0), 2.0)
    assert err.value.wait
    q.push(held("q0", 400, key="quiet", at=2.0), 2.0)  # about 4 s counted as 6 before keys were told apart
    with pytest.raises(QueueFull, match="max_queue_delay_s"):
        q.push(held("q1", 2500, key="quiet", at=2.0), 2.0)
    # round robin sends it no later than counted (3 noisy ones at most, then q0): here after 2, the
    # noisy key having spent part of its round's credit on n0 and n1 already
    assert drain(q, 3.0) == ["n2", "n3", "q0", "n4", "n5", "n6"]
    one = HoldingQueue(cfg)  # with one key the count is the whole queue, as before
    for i in range(3):
        one.push(held(f"s{i}", 10), 0.0)
    assert one.ahead(held("x", 10)) == 4


def test_cancel_leaves_at_once() -> None:
    q = HoldingQueue(CFG)
    q.push(held("x", 10), 0.0)
    q.push(held("y", 20), 0.0)
    assert q.cancel("x") and not q.cancel("x") and "x" not in q
    assert drain(q, 0.0) == ["y"]


def _worker(wid: str, waiting: int = 0) -> WorkerState:
    return WorkerState(wid, 16, 8192, 64, LoadReport(wid, 0.0, 0, waiting, 0, 0, 0, 0, 1000))


def test_dispatcher_holds_while_no_worker_can_start_and_pumps_in_order() -> None:
    index = KvIndex(prediction_ttl=60.0)
    for w in ("w0", "w1"):
        index.add_worker(w)
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16,
                   SchedulerConfig(enabled=True, engine_queue_depth=1, aging_tokens_per_s=0.0))
    free = [_worker("w0"), _worker("w1")]
    full = [_worker("w0", waiting=1), _worker("w1", waiting=3)]
    req = d.prepare("r0", list(range(40)), 4)
    assert d.submit(req, "", free, 0.0) is not None  # nothing held and room: routed at once
    assert d.submit(d.prepare("lo", list(range(50)), 4), "", full, 0.0) is None
    assert d.submit(d.prepare("hi", list(range(60)), 4, priority=5), "", full, 0.1) is None
    assert d.pump(full, 0.2) is None  # still no room
    assert d.submit(d.prepare("late", list(range(10)), 4), "", free, 0.3) is None  # others are ahead of it
    first = d.pump(free, 0.5)
    assert first is not None and first.request.request_id == "hi" and first.queue_wait == pytest.approx(0.4)
    # short first on *uncached* tokens: "lo" (50 tokens) shares r0's two predicted blocks, 18 left to
    # prefill; "late" has 10
    assert [d.pump(free, 0.6).request.request_id for _ in range(2)] == ["late", "lo"]
    assert d.pump(free, 0.7) is None and len(d.queue) == 0
    assert d.submit(d.prepare("c", [1] * 20, 4), "", full, 1.0) is None
    assert d.cancel("c") and d.pump(free, 1.1) is None


def test_dispatcher_without_scheduler_routes_at_once() -> None:
    index = KvIndex(prediction_ttl=60.0)
    index.add_worker("w0")
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16, SchedulerConfig(enabled=False))
    assert d.queue is None
    assert d.submit(d.prepare("r", [1] * 20, 4), "", [_worker("w0", waiting=50)], 0.0) is not None
    assert d.pump([_worker("w0")], 0.0) is None and not d.cancel("r")


def test_a_worker_with_a_pass_of_prefill_backlog_cannot_start_more() -> None:
    index = KvIndex(prediction_ttl=60.0)
    index.add_worker("w0")
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16,
                   SchedulerConfig(enabled=True, engine_queue_depth=4, engine_backlog_passes=1.0))

    def w(queued: int, waiting: int = 0, kv: int = 0) -> list[WorkerState]:
        return [WorkerState("w0", 16, 8192, 64, LoadReport("w0", 0.0, 1, waiting, queued, 0, kv, 0, 1000))]

    assert d.can_start(w(8191)) and not d.can_start(w(8192))  # a full pass of prefill ahead: hold
    assert not d.can_start(w(0, waiting=4))  # engine_queue_depth
    assert not d.can_start(w(0, kv=990))  # busy: KV usage 0.99 >= busy_kv_usage 0.98


def test_contention_counts_requests_held_in_the_scheduler() -> None:
    from thunderagent.router.cost import score

    cfg = RoutingConfig()
    w = WorkerState("w0", 16, 8192, 64, LoadReport("w0", 0.0, 1, 1, 0, 0, 0, 0, 1000))
    # 640 tokens of this 1,000-token prompt sit on another worker: each request waiting for this one
    # (the engine's 1, plus 3 held in the scheduler) pays for recomputing them
    plain, held = score(w, 1000, 0, cfg, 0, 640), score(w, 1000, 0, cfg, 0, 640, held=3)
    assert plain.cost == 1000 + 1 * 640 and held.cost == 1000 + (1 + 3) * 640
    assert not held.busy  # the busy filter still reads the engine's own queue
    assert score(w, 1000, 40, cfg, 0, 640, held=3).cost == 1000 - 640  # the holder: nothing avoidable


def _cache_test(others: int) -> str:
    """Where a held request whose 640-token prefix w0 holds goes, with ``others`` held behind it."""
    index = KvIndex(prediction_ttl=60.0)
    for wid in ("w0", "w1"):
        index.add_worker(wid)
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16,
                   SchedulerConfig(enabled=True, engine_queue_depth=1, aging_tokens_per_s=0.0))
    full = [_worker("w0", waiting=1), _worker("w1", waiting=1)]
    req = d.prepare("r", list(range(1000)), 4)
    index.predict("w0", req.block_hashes[:40], 0.0)
    assert d.submit(req, "", full, 0.0) is None
    for k in range(others):  # longer, uncached: they go after "r"
        assert d.submit(d.prepare(f"o{k}", [10_000 + k] * 2000, 4), "", full, 0.0) is None
    # w0 has a quarter pass of prefill queued, w1 nothing: alone, "r" goes to the idle worker
    # (1,000 tokens there against 1,000 - 640/1.0625 + 2,048 on w0); behind 8 held requests
    # (4 per worker) recomputing its 640 cached tokens on w1 costs 4 x 640 more and w0 wins
    ready = [WorkerState("w0", 16, 8192, 64, LoadReport("w0", 0.0, 1, 0, 2048, 0, 0, 0, 1000)), _worker("w1")]
    d_ = d.pump(ready, 1.0)
    assert d_ is not None and d_.request.request_id == "r"
    return d_.decision.worker_id


def test_held_backlog_keeps_a_held_request_on_its_cache() -> None:
    assert _cache_test(0) == "w1"
    assert _cache_test(8) == "w0"


def _overdue_mix(share: float) -> tuple[list[str], HoldingQueue]:
    cfg = SchedulerConfig(enabled=True, max_wait_s=10.0, aging_tokens_per_s=0.0, overdue_share=share)
    q = HoldingQueue(cfg)
    q.push(held("old1", 100, at=0.0), 0.0)
    q.push(held("old2", 90, at=0.5), 0.5)
    for k, n in enumerate((5, 6, 7)):
        q.push(held(f"s{k + 1}", n, at=20.0), 20.0)
    return drain(q, 20.0), q


def test_overdue_share_interleaves_overdue_requests_with_the_short_first_order() -> None:
    assert _overdue_mix(1.0)[0] == ["old1", "old2", "s1", "s2", "s3"]  # every overdue one first: FIFO
    assert _overdue_mix(0.5)[0] == ["s1", "old1", "s2", "old2", "s3"]  # one in two, oldest first
    cfg = SchedulerConfig(enabled=True, max_wait_s=10.0, aging_tokens_per_s=0.0, overdue_share=0.25)
    q = HoldingQueue(cfg)
    q.push(held("old", 100, at=0.0), 0.0)
    for k in range(5):
        q.push(held(f"s{k}", 10 + k, at=20.0), 20.0)
    assert drain(q, 20.0) == ["s0", "s1", "s2", "old", "s3", "s4"]  # one in four


def test_only_an_overdue_requests_turn_bypasses_the_gate() -> None:
    cfg = SchedulerConfig(enabled=True, max_wait_s=10.0, aging_tokens_per_s=0.0, overdue_share=0.5)
    q = HoldingQueue(cfg)
    q.push(held("a", 50, at=0.0), 0.0)
    q.push(held("b", 60, at=0.0), 0.0)
    first = q.next(20.0)
    # both overdue, no overdue turn: the short-first pick waits for a worker like any other (a
    # sustained overload is not dumped into the engines), and its dispatch is an overdue one
    assert first.req.request_id == "a" and not q.forced(first, 20.0)
    q.take(first, 20.0)
    q.push(held("s", 10, at=19.0), 19.0)
    assert q.next(20.0).req.request_id == "s" and not q.forced(q.next(20.0), 20.0)
    q.take(q.next(20.0), 20.0)
    second = q.next(20.0)
    assert second.req.request_id == "b" and q.forced(second, 20.0)  # its turn: it goes even without room
    legacy = HoldingQueue(SchedulerConfig(enabled=True, max_wait_s=10.0))
    legacy.push(held("c", 50, at=0.0), 0.0)
    assert legacy.forced(legacy.next(20.0), 20.0) and not legacy.forced(legacy.next(5.0), 5.0)


def test_tracked_prefill_gate_counts_what_was_sent_until_its_first_token() -> None:
    index = KvIndex(prediction_ttl=60.0)
    index.add_worker("w0")
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16,
                   SchedulerConfig(enabled=True, tracked_prefill_passes=0.5, aging_tokens_per_s=0.0))
    # the engine reports a long queue: the tracked gate does not read it (only the busy filter does)
    w = [WorkerState("w0", 16, 100, 64, LoadReport("w0", 0.0, 1, 5, 10_000, 0, 0, 0, 1000))]
    a = d.submit(d.prepare("a", list(range(40)), 4), "", w, 0.0)
    assert a is not None and a.predicted_tokens == 0  # 40 uncached tokens sent: 40 <= 0.5 x 100
    assert d.can_start(w)
    b = d.submit(d.prepare("b", list(range(40)), 4), "", w, 0.0)  # a's 2 full blocks predicted there
    assert b is not None and b.predicted_tokens == 32  # 8 more: 48 sent
    assert d.can_start(w)
    assert d.submit(d.prepare("c", [7] * 60, 4), "", w, 0.0) is not None  # 108 > 50: full
    assert not d.can_start(w)
    assert d.submit(d.prepare("x", [9] * 20, 4), "", w, 0.1) is None  # held
    assert d.progressed("c", ok=True) == 1  # c's first token: 48 left, and "x" is held: pump
    assert d.progressed("c", ok=False) == 0  # its end: counted once
    assert d.can_start(w)
    x = d.pump(w, 0.2)
    assert x is not None and x.request.request_id == "x" and not d.can_start(w)  # 68 sent
    d.retract(x)  # the worker could not take it: nothing of it is pending there
    assert d.can_start(w)


def test_a_request_that_sends_no_tokens_ends_after_the_one_that_emptied_its_worker_count() -> None:
    """One of vLLM's paths that generate nothing (an embedding, a stored response's read) sends 0 tokens: it may end
    after a request whose end took its worker's tracked total to 0 (once a KeyError: the client got a 500)."""
    index = KvIndex(prediction_ttl=60.0)
    index.add_worker("w0")
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16,
                   SchedulerConfig(enabled=True, tracked_prefill_passes=0.5, aging_tokens_per_s=0.0))
    w = [WorkerState("w0", 16, 100, 64, LoadReport("w0", 0.0, 0, 0, 0, 0, 0, 0, 1000))]
    plain = d.submit(d.prepare("plain", [], 1), "", w, 0.0)
    assert plain is not None and plain.predicted_tokens == 0
    assert d.submit(d.prepare("a", list(range(40)), 4), "", w, 0.0) is not None
    d.progressed("a", ok=True)  # a's first token: the worker's count goes to 0
    d.progressed("plain", ok=True)  # then the plain one's end
    assert d.can_start(w) and d.submit(d.prepare("b", [5] * 40, 4), "", w, 0.1) is not None  # counted afresh


def test_prefills_in_flight_gate_sends_only_to_a_worker_without_a_pending_prefill() -> None:
    index = KvIndex(prediction_ttl=60.0)
    for wid in ("w0", "w1"):
        index.add_worker(wid)
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16,
                   SchedulerConfig(enabled=True, prefills_in_flight=1, aging_tokens_per_s=0.0))
    w = [_worker("w0"), _worker("w1")]
    a = d.submit(d.prepare("a", list(range(40)), 4), "", w, 0.0)
    assert a is not None
    other = "w1" if a.decision.worker_id == "w0" else "w0"
    # a's blocks are predicted on its worker, but that worker is mid-prefill: b goes to the other one
    b = d.submit(d.prepare("b", list(range(40)), 4), "", w, 0.0)
    assert b is not None and b.decision.worker_id == other and b.predicted_tokens == 0
    assert not d.can_start(w)
    assert d.submit(d.prepare("c", list(range(40)), 4), "", w, 0.1) is None  # held: both mid-prefill
    assert d.progressed("b", ok=True) == 1  # b's first token on the other worker: pump
    c = d.pump(w, 0.2)
    assert c is not None and c.request.request_id == "c" and c.decision.worker_id == other
    assert c.queue_wait == pytest.approx(0.1)
    assert d.progressed("a", ok=True) == 0  # nothing held any more
    assert d.can_start(w)
    # a migrated stream's continuation (its first token long reported) is not counted as pending
    cont = d.prepare("a", list(range(48)), 4)
    cont.resumed = 8
    dc = d.dispatch(cont, w, 0.3)
    assert dc.decision.worker_id == a.decision.worker_id  # where its blocks are
    assert d.can_start(w) and d.progressed("a", ok=False) == 0
    # the slot rule still applies besides the gate: a worker with every slot taken cannot start
    full = LoadReport("w0", 0.0, 8, 0, 0, 0, 0, 0, 1000)  # 8 running
    assert not d.can_start([WorkerState("w0", 16, 8192, 64, full, max_num_seqs=8)])
    assert d.can_start([WorkerState("w0", 16, 8192, 64, full, max_num_seqs=9)])


def test_prefills_in_flight_needs_the_holding_queue() -> None:
    with pytest.raises(ValueError, match="prefills_in_flight acts only with scheduler.enabled"):
        SchedulerConfig(enabled=False, prefills_in_flight=1)
    with pytest.raises(ValueError):
        SchedulerConfig(enabled=True, prefills_in_flight=0)
