"""Fleet-view fast path (router/candidates.py, router/selection.py): which workers are scored, the
choice equals the full scan's, the lazy explanation equals the eager one, near-tie temperature."""

from __future__ import annotations

import math
import random

import pytest

from thunderagent.config import Policy, RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router import selection
from thunderagent.router.balance import RecentRequests
from thunderagent.router.candidates import FleetView, LazyScores
from thunderagent.router.router import KvRouter
from thunderagent.router.selection import select
from thunderagent.types import BlockStored, LoadReport, RouteRequest, WorkerState

BS = 16
SEEDS = 8


def load(wid: str, *, running=0, waiting=0, queued=0, decode=0, active=0, total=1000) -> LoadReport:
    return LoadReport(wid, 0.0, running, waiting, queued, decode, active, active, total)


def worker(wid: str, **kw) -> WorkerState:
    return WorkerState(wid, BS, max_num_batched_tokens=1024, queue_depth_threshold=8, load=load(wid, **kw))


def test_view_orders_free_workers_by_base_load_and_tracks_busy_and_queued():
    cfg = RoutingConfig()
    view = FleetView(cfg, [worker("a", queued=300), worker("b", queued=100), worker("c", waiting=8)])
    assert len(view) == 3 and [w.worker_id for w in view] == ["a", "b", "c"]
    assert view.free_order == [(100.0, 1), (300.0, 0)]  # c is busy (queue depth 8 >= threshold 8)
    assert view.min_queued() == 0 and view.free_count == 2
    view.set_load(2, load("c", queued=50))  # c frees up
    view.set_load(1, load("b", queued=2000, decode=10))
    assert view.free_order == [(50.0, 2), (300.0, 0), (2001.0, 1)]
    assert view.min_queued() == 50 and view[1].load.queued_prefill_tokens == 2000
    view.set_load(0, load("a", active=990))  # kv usage 0.99 >= busy_kv_usage: busy
    assert view.free_order == [(50.0, 2), (2001.0, 1)] and not view.is_free(0)
    v0 = view.version
    view.remove("b")
    assert [w.worker_id for w in view] == ["a", "c"] and view.free_order == [(50.0, 1)]
    assert view.position("c") == 1 and view.position("b") is None and view.version == v0 + 1
    view.update(worker("d", queued=10))
    assert view.position("d") == 2 and view.free_order == [(10.0, 2), (50.0, 1)]
    with pytest.raises(ValueError, match="already in the fleet view"):
        view.add(worker("d"))


def test_recent_order_is_rate_order_at_any_time():
    r = RecentRequests(10.0)
    for w in ("a", "b", "c", "d"):
        r.track(w)
    r.add("a", 0.0, 1000)
    r.add("b", 5.0, 600)
    r.add("c", 20.0, 100)
    for now in (20.0, 50.0, 500.0):
        by_rate = sorted("abcd", key=lambda w: r.rate(w, now))
        assert [w for _, w in r.order] == by_rate
    r.forget("b")
    assert [w for _, w in r.order] == ["d", "c", "a"]


def make(n: int, seed: int, **cfg) -> tuple[KvRouter, KvIndex]:
    index = KvIndex(prediction_ttl=10.0)
    for i in range(n):
        index.add_worker(f"w{i}")
    cfg.setdefault("whole_scan_max_workers", 0)  # these tests are about the selection: from candidate_limit + 1
    return KvRouter(RoutingConfig(seed=seed, **cfg), index, random.Random(seed)), index


HASHES = list(range(1001, 1009))  # 8 blocks = 128 tokens


def selected(router: KvRouter, view: FleetView, hashes: list[int], n: int = 128) -> selection.Selection:
    index = router.index
    bits = [index.bit_of(w.worker_id) for w in view]
    return select(n, index.match_levels(hashes, 1.0), view, bits, sum(bits), index, router.policy,  # type: ignore[arg-type]
                  router.cfg, 1.0)


def test_scores_holders_plus_k_least_loaded_then_stops_on_the_bound():
    router, index = make(6, 0, candidate_limit=2)
    index.apply_event(BlockStored("w5", 0, tuple(HASHES)), 0.0)
    view = FleetView(router.cfg, [worker(f"w{i}", queued=1000 * i) for i in range(6)])
    sel = selected(router, view, HASHES)
    # w5 holds the prefix; w0, w1 are the 2 least loaded; w2's bound 128 + 2000 > w0's cost 128: stop
    assert [c.worker.worker_id for c in sel.cands] == ["w0", "w1", "w5"]
    assert [c.score.cost for c in sel.cands][:2] == [128.0, 1128.0]
    assert sel.best_overlap == 8 and sel.best_cached == 128 and sel.min_queued == 0
    d = router.route(RouteRequest("r", 128, HASHES), view, 1.0)
    assert d.worker_id == "w0" and d.best_overlap_blocks == 8
    assert isinstance(d.candidates, LazyScores) and len(d.candidates) == 6


def test_scan_goes_past_k_while_a_worker_could_still_win():
    # w0, w1 least loaded by queue but each with 7 waiting requests: the contention term (7 x 128
    # avoidable tokens) makes them cost 1,024 and 1,034; the bound goes on to w2 (cost 328) and stops
    # at w3 (at least 128 + 300 > 328).
    router, index = make(6, 0, candidate_limit=2)
    index.apply_event(BlockStored("w5", 0, tuple(HASHES)), 0.0)
    ws = [worker("w0", waiting=7, queued=0), worker("w1", waiting=7, queued=10), worker("w2", queued=200),
          worker("w3", queued=300), worker("w4", queued=5000), worker("w5", queued=8000, waiting=7)]
    view = FleetView(router.cfg, ws)
    sel = selected(router, view, HASHES)
    assert [c.worker.worker_id for c in sel.cands] == ["w0", "w1", "w2", "w5"]
    full, _ = make(6, 0, candidate_limit=2)
    full.index.apply_event(BlockStored("w5", 0, tuple(HASHES)), 0.0)
    assert router.route(RouteRequest("r", 128, HASHES), view, 1.0).worker_id == "w2"
    assert full.route(RouteRequest("r", 128, HASHES), list(ws), 1.0).worker_id == "w2"


def test_a_prefix_the_whole_fleet_holds_is_scanned_by_load_not_enumerated():
    # all 30 workers hold the 2-block system prompt (a dense level: more than 4 x candidate_limit
    # holders), w7 also holds 6 more blocks (sparse): w7 is scored as a holder, the rest by load
    # order while their bound (128 - 32 + base) can beat the best.
    router, index = make(30, 0, candidate_limit=1)
    for i in range(30):
        index.apply_event(BlockStored(f"w{i}", 0, tuple(HASHES[:2])), 0.0)
    index.apply_event(BlockStored("w7", 1, tuple(HASHES[2:])), 0.0)
    view = FleetView(router.cfg, [worker(f"w{i}", queued=10 * (29 - i)) for i in range(30)])
    sel = selected(router, view, HASHES)
    assert sel.levels == [(2, sum(index.bit_of(f"w{i}") for i in range(30) if i != 7)), (8, index.bit_of("w7"))]
    # w29 (queued 0): 96 + contention 0 = 96... w7: 128 - 128 + 220 = 220; bound of w28: 96 + 10 > 96
    assert [c.worker.worker_id for c in sel.cands] == ["w7", "w29"]
    assert [c.score.overlap_blocks for c in sel.cands] == [8, 2]
    assert router.route(RouteRequest("r", 128, HASHES), view, 1.0).worker_id == "w29"


def test_small_fleet_and_filtered_lists_are_scanned_whole():
    router, _ = make(3, 0, candidate_limit=3)
    view = FleetView(router.cfg, [worker(f"w{i}") for i in range(3)])
    d = router.route(RouteRequest("r", 128, HASHES), view, 1.0)
    assert isinstance(d.candidates, tuple) and len(d.candidates) == 3


def test_all_busy_view_falls_back_as_before():
    router, _ = make(20, 0, candidate_limit=2)
    view = FleetView(router.cfg, [worker(f"w{i}", waiting=8 + (i % 3)) for i in range(20)])
    d = router.route(RouteRequest("r", 128, HASHES), view, 1.0)
    assert d.reason.startswith("all workers busy; ") and isinstance(d.candidates, tuple)


def _random_load(rng: random.Random, wid: str) -> LoadReport:
    waiting = rng.choice([0, 0, 0, 1, 3, 7, 8])
    active = rng.choice([0, 100, 500, 750, 900, 985])
    return load(wid, running=rng.randrange(4), waiting=waiting, queued=rng.choice([0, rng.randrange(4000)]),
                decode=rng.randrange(20_000), active=active)


@pytest.mark.parametrize("extra", [
    {},
    {"temperature": 0.7, "tie_margin": 300.0},
    {"miss_overlap_fraction": 0.3},
    {"weights": {"contention": 4.0, "decode": 0.5}},
])
def test_choice_and_explanation_equal_the_full_scan_on_random_fleets(extra, monkeypatch):
    # With the scan bound raised (no cap), the scored set always contains the winning set, so the
    # fast path must reproduce the full scan decision for decision: worker, reason, every score.
    monkeypatch.setattr(selection, "SCAN_FACTOR", 1000)
    for seed in range(SEEDS):
        rng = random.Random(seed)
        n = rng.randrange(5, 40)
        fast, fidx = make(n, seed, candidate_limit=rng.randrange(1, 4), **extra)
        full, sidx = make(n, seed, candidate_limit=rng.randrange(1, 4), **extra)
        prefixes = [[rng.getrandbits(60) for _ in range(8)] for _ in range(6)]
        for e in range(3 * n):  # random holdings, identical in both indexes
            wid, p = f"w{rng.randrange(n)}", rng.choice(prefixes)
            ev = BlockStored(wid, e, tuple(p[: rng.randrange(1, 9)]))
            fidx.apply_event(ev, 0.0)
            sidx.apply_event(ev, 0.0)
        amounts = [1 + i * 7.3 + rng.random() for i in range(n)]
        for r in (fast, full):  # distinct recent traffic: no exact ties in the miss balance
            for i in range(n):
                r.policy.recent.add(f"w{i}", 0.0, amounts[i])  # type: ignore[attr-defined]
        view = FleetView(fast.cfg, [WorkerState(f"w{i}", BS, 1024, 8, _random_load(rng, f"w{i}")) for i in range(n)])
        now, fast_paths = 1.0, 0
        for q in range(60):
            now += 0.05
            p = rng.choice(prefixes)
            hashes = p[: rng.randrange(0, 9)] + [rng.getrandbits(60) for _ in range(rng.randrange(0, 3))]
            req = RouteRequest(f"r{q}", max(1, len(hashes)) * BS + rng.randrange(BS), hashes)
            a = fast.route(req, view, now)
            b = full.route(req, list(view), now)
            fast_paths += isinstance(a.candidates, LazyScores)
            assert (a.worker_id, a.reason, a.overlap_blocks, a.best_overlap_blocks) == \
                (b.worker_id, b.reason, b.overlap_blocks, b.best_overlap_blocks), (seed, q)
            assert a.explain() == b.explain()
            i = rng.randrange(n)
            view.set_load(i, _random_load(rng, f"w{i}"))
        assert fast_paths > 0 or view.free_count == 0


def test_lazy_explanation_keeps_the_loads_of_decision_time():
    router, index = make(8, 0, candidate_limit=1)
    view = FleetView(router.cfg, [worker(f"w{i}", queued=100 * i) for i in range(8)])
    d = router.route(RouteRequest("r", 128, HASHES), view, 1.0)
    view.set_load(0, load("w0", queued=9999))  # after the decision
    assert d.candidates[0].queued_prefill_tokens == 0 and d.explain()["candidates"][0]["queued_prefill_tokens"] == 0


def test_near_tie_temperature_never_picks_outside_the_margin():
    # queued prefill = cost beyond the prompt; "e" holds the prompt (so it is no cache miss) but is far behind
    costs_by_worker = {"a": 0, "b": 100, "c": 600, "d": 5000, "e": 90_000}
    picks: dict[str, int] = dict.fromkeys(costs_by_worker, 0)
    for seed in range(300):
        router, index = make(0, seed, temperature=5.0, tie_margin=512.0)
        index.add_worker("e")
        index.apply_event(BlockStored("e", 0, tuple(HASHES)), 0.0)
        ws = [worker(w, queued=q) for w, q in costs_by_worker.items()]
        picks[router.route(RouteRequest("r", 128, HASHES), ws, 1.0).worker_id] += 1
    assert picks["c"] == 0 and picks["d"] == 0 and picks["e"] == 0
    assert picks["a"] > picks["b"] > 0
    # margin 0: argmin, whatever the temperature
    router, index = make(0, 1, temperature=5.0, tie_margin=0.0)
    index.add_worker("e")
    index.apply_event(BlockStored("e", 0, tuple(HASHES)), 0.0)
    ws = [worker("b", queued=100), worker("a"), worker("e", queued=90_000)]
    assert router.route(RouteRequest("r", 128, HASHES), ws, 1.0).worker_id == "a"


def test_near_tie_temperature_in_the_fast_path_equals_full_scan_weights():
    seen: dict[str, int] = {}
    for seed in range(60):
        router, index = make(40, seed, temperature=1.0, tie_margin=150.0, candidate_limit=2)
        index.apply_event(BlockStored("w39", 0, tuple(HASHES)), 0.0)  # a holder far behind: no cache miss
        view = FleetView(router.cfg, [
            worker(f"w{i}", queued=90_000 if i == 39 else (0 if i in (17, 30) else 1000) + 10 * i) for i in range(40)
        ])
        wid = router.route(RouteRequest("r", 128, HASHES), view, 1.0).worker_id
        seen[wid] = seen.get(wid, 0) + 1
    # w17 (cost 298) and w30 (428) are within 150 of each other; every other worker is >= 1,000 dearer
    assert set(seen) == {"w17", "w30"} and seen["w17"] > seen["w30"]
    assert math.isfinite(router.policy.window(0.0))  # type: ignore[attr-defined]


def test_other_policies_scan_whole_views():
    router, _ = make(30, 0, policy=Policy.least_loaded, candidate_limit=1)
    view = FleetView(router.cfg, [worker(f"w{i}", running=30 - i) for i in range(30)])
    d = router.route(RouteRequest("r", 128, []), view, 1.0)
    assert d.worker_id == "w29" and isinstance(d.candidates, tuple) and len(d.candidates) == 30


def test_registry_keeps_its_view_in_step_with_loads_and_health():
    from thunderagent.control.registry import WorkerRegistry  # noqa: PLC0415
    from thunderagent.types import WorkerInfo  # noqa: PLC0415

    reg = WorkerRegistry(1.0, 3, RoutingConfig())
    for wid in ("a", "b", "c"):
        reg.register(WorkerInfo(wid, "both", BS, 1024, 8, 1000), 0.0)
    view = reg.routable()
    assert isinstance(view, FleetView) and [w.worker_id for w in view] == ["a", "b", "c"]
    reg.heartbeat("a", load("a", queued=500), 1.0)
    reg.heartbeat("b", load("b", waiting=8), 1.0)  # busy
    reg.heartbeat("c", load("c", queued=100), 1.0)
    assert view.free_order == [(100.0, 2), (500.0, 0)] and view.busy_positions == {1}
    reg.update_load("c", load("c", queued=900))
    assert view.free_order == [(500.0, 0), (900.0, 2)] and view[2].load.queued_prefill_tokens == 900
    reg.heartbeat("a", load("a"), 3.5)
    reg.heartbeat("c", load("c"), 3.5)
    reg.check(4.5)  # b silent for 3.5 s > 3 s lease: out of the view
    assert [w.worker_id for w in reg.routable()] == ["a", "c"] and view.busy_positions == set()
    reg.heartbeat("b", load("b", queued=7), 4.6)
    reg.check(4.7)  # back, at the end
    assert [w.worker_id for w in reg.routable()] == ["a", "c", "b"] and view[2].load.queued_prefill_tokens == 7
    reg.deregister("a")
    assert [w.worker_id for w in reg.routable()] == ["c", "b"]


def test_match_levels_agree_with_find_matches_with_and_without_check_hashes():
    rng = random.Random(5)
    index = KvIndex(prediction_ttl=10.0, double_hash=True)
    for i in range(12):
        index.add_worker(f"w{i}")
    chain = [rng.getrandbits(60) for _ in range(10)]
    checks = [rng.getrandbits(60) for _ in range(10)]
    for i in range(12):
        n = rng.randrange(1, 11)
        index.predict(f"w{i}", chain[:n], 0.0, checks[:n])
    index.apply_event(BlockStored("w3", 0, tuple(chain)), 0.0)
    index.add_worker("gone")
    index.apply_event(BlockStored("gone", 0, tuple(chain[:4])), 0.0)
    for q in (chain, chain[:5], chain[:1], [rng.getrandbits(60)]):
        for ch in (None, checks[: len(q)], [1] * len(q)):
            levels = index.match_levels(q, 1.0, ch)
            as_dict = {index.worker_of(low): b for b, m in levels for low in (1 << k for k in range(m.bit_length())) if m & low}
            assert as_dict == index.find_matches(q, 1.0, ch)
            assert [b for b, _ in levels] == sorted({b for b, _ in levels})


def test_workers_that_left_do_not_crowd_the_miss_balance():
    """A fleet whose workers come and go under new ids (pods restarted, scale-downs): the ones that
    left must not stay at the head of the recent-traffic order, where the fast path's miss scan (which
    visits a bounded number of entries) would find only them and choose among fewer workers than the
    full scan does."""
    n, gone = 8, 200
    fast, fidx = make(0, 3, candidate_limit=2)
    full, sidx = make(0, 3, candidate_limit=2)
    for r, idx in ((fast, fidx), (full, sidx)):
        for i in range(gone):  # served a while, then left (the index forgets them, their bits are reused)
            idx.add_worker(f"old{i}")
        r.route(RouteRequest("warm", 64, [7, 8, 9, 10]),
                FleetView(r.cfg, [worker(f"old{i}") for i in range(gone)]), 0.5)
        for i in range(gone):
            r.policy.recent.add(f"old{i}", 0.5, 10.0)  # type: ignore[attr-defined]
            idx.remove_worker(f"old{i}")
        for i in range(n):
            idx.add_worker(f"w{i}")
            r.policy.recent.add(f"w{i}", 1.0, 1.0 + 3 * i)  # type: ignore[attr-defined]
    view = FleetView(fast.cfg, [worker(f"w{i}", queued=10 * (n - i)) for i in range(n)])
    for q in range(20):  # misses: balanced by recent traffic among every worker ready within a pass
        req = RouteRequest(f"m{q}", 64, [10_000 + 4 * q + k for k in range(4)])
        a = fast.route(req, view, 2.0 + q)
        b = full.route(req, list(view), 2.0 + q)
        assert isinstance(a.candidates, LazyScores)
        assert (a.worker_id, a.reason) == (b.worker_id, b.reason), q
    assert len(fast.policy.recent.order) == n  # type: ignore[attr-defined]
