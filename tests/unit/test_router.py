"""Cost function and policies: exact choices on hand-built worker states."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from thunderagent.config import CostWeights, Policy, RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.cost import is_busy, score
from thunderagent.router.router import KvRouter, NoWorkerAvailable
from thunderagent.types import BlockStored, Decision, LoadReport, RouteRequest, WorkerState

BS = 16


def load(wid: str, *, running=0, waiting=0, queued=0, decode=0, active=0, total=1000) -> LoadReport:
    return LoadReport(wid, 0.0, running, waiting, queued, decode, active, active, total)


def worker(wid: str, **kw) -> WorkerState:
    return WorkerState(wid, BS, max_num_batched_tokens=1024, queue_depth_threshold=8, load=load(wid, **kw))


def make_router(policy=Policy.kv_aware, seed=0, **cfg) -> tuple[KvRouter, KvIndex]:
    index = KvIndex(prediction_ttl=10.0)
    for w in ("a", "b", "c"):
        index.add_worker(w)
    return KvRouter(RoutingConfig(policy=policy, **cfg), index, random.Random(seed)), index


HASHES = [101, 102, 103, 104, 105, 106, 107, 108]  # 8 blocks = 128 tokens


def store(index: KvIndex, wid: str, hashes: list[int], seq: int = 0) -> None:
    index.apply_event(BlockStored(wid, seq, tuple(hashes)), 0.0)


def test_score_idle_worker_credits_full_overlap():
    s = score(worker("a"), 128, 4, RoutingConfig())
    assert s.prefill_tokens == 64 and s.cost == pytest.approx(64.0)


def test_score_credit_shrinks_with_backlog():
    cfg = RoutingConfig(weights=CostWeights(credit_load_scale=4.0))
    # 4 passes of backlog (4 * 1024 queued tokens) halve the credit: 128 - 0.5*64 = 96, plus queue 4096.
    s = score(worker("a", queued=4096), 128, 4, cfg)
    assert s.prefill_tokens == 96
    assert s.cost == pytest.approx(96 + 4096)


def test_score_memory_penalty_above_watermark_only():
    cfg = RoutingConfig(memory_watermark=0.7)
    assert score(worker("a", active=700), 128, 0, cfg).cost == pytest.approx(128)
    # usage 0.85 -> half way from watermark to full -> 0.5 * max_num_batched_tokens extra
    assert score(worker("a", active=850), 128, 0, cfg).cost == pytest.approx(128 + 512)


def test_busy_by_queue_depth_and_memory():
    cfg = RoutingConfig(busy_kv_usage=0.95)
    assert is_busy(worker("a", waiting=8), cfg)
    assert not is_busy(worker("a", waiting=7), cfg)
    assert is_busy(worker("a", active=950), cfg)


def test_kv_aware_picks_cached_worker_and_explains():
    router, index = make_router()
    store(index, "b", HASHES[:6])
    d = router.route(RouteRequest("r1", 128, HASHES), [worker("a"), worker("b"), worker("c")], 1.0)
    assert d.worker_id == "b"
    assert d.overlap_blocks == 6
    by_id = {c.worker_id: c for c in d.candidates}
    assert by_id["b"].cost == pytest.approx(32.0) and by_id["a"].cost == pytest.approx(128.0)
    assert "6 cached blocks" in d.reason
    assert d.explain()["worker"] == "b"


def test_kv_aware_prefers_idle_worker_when_cached_one_is_drowning():
    router, index = make_router()
    store(index, "b", HASHES)
    d = router.route(RouteRequest("r1", 128, HASHES), [worker("a"), worker("b", queued=5000)], 1.0)
    assert d.worker_id == "a"


def test_kv_aware_records_prediction():
    router, index = make_router()
    d = router.route(RouteRequest("r1", 128, HASHES), [worker("a"), worker("b"), worker("c")], 1.0)
    assert index.find_matches(HASHES, 2.0) == {d.worker_id: 8}
    assert index.find_matches(HASHES, 11.5) == {}  # prediction expired (ttl 10s), never confirmed


def test_tie_break_goes_to_smallest_cache_then_random():
    router, index = make_router()
    store(index, "a", [1, 2, 3])
    store(index, "b", [4])
    d = router.route(RouteRequest("r", 128, HASHES), [worker("a"), worker("b"), worker("c")], 1.0)
    assert d.worker_id == "c"  # equal cost; c holds nothing
    seen = set()
    for seed in range(20):
        r, _ = make_router(seed=seed)
        seen.add(r.route(RouteRequest("r", 128, HASHES), [worker("a"), worker("b")], 1.0).worker_id)
    assert seen == {"a", "b"}  # pure ties are random


def test_busy_filtered_and_fallback():
    router, index = make_router()
    store(index, "a", HASHES)
    d = router.route(RouteRequest("r", 128, HASHES), [worker("a", waiting=8), worker("b")], 1.0)
    assert d.worker_id == "b" and "1 busy filtered" in d.reason
    assert (d.busy_filtered, d.fallback) == (1, False)  # what the decision metrics read
    # all busy, default fallback "policy": the cache still decides
    d = router.route(RouteRequest("r", 128, HASHES), [worker("a", waiting=9), worker("b", waiting=8)], 1.0)
    assert d.worker_id == "a" and "all workers busy" in d.reason
    assert (d.busy_filtered, d.fallback) == (0, True)
    ll, ll_index = make_router(fallback="least_loaded")
    store(ll_index, "a", HASHES)
    d = ll.route(RouteRequest("r", 128, HASHES), [worker("a", waiting=9), worker("b", waiting=8)], 1.0)
    assert d.worker_id == "b" and "fallback" in d.reason and d.fallback
    rej, _ = make_router(fallback="reject")
    with pytest.raises(NoWorkerAvailable):
        rej.route(RouteRequest("r", 128, HASHES), [worker("a", waiting=9)], 1.0)


def test_no_workers_raises():
    router, _ = make_router()
    with pytest.raises(NoWorkerAvailable):
        router.route(RouteRequest("r", 128, HASHES), [], 1.0)


def test_temperature_softmax_samples_mostly_cheapest():
    picks = {"a": 0, "b": 0}
    for seed in range(200):
        router, index = make_router(seed=seed, temperature=0.5)
        store(index, "b", HASHES)
        picks[router.route(RouteRequest("r", 128, HASHES), [worker("a"), worker("b")], 1.0).worker_id] += 1
    # normalised costs 1 (a) and 0 (b): P(b) = 1 / (1 + e^-2) ~ 0.88
    assert 150 <= picks["b"] <= 195 and picks["a"] > 0


def test_round_robin_cycles_by_worker_id():
    router, _ = make_router(Policy.round_robin)
    ws = [worker("c"), worker("a"), worker("b")]
    got = [router.route(RouteRequest(str(i), 10, []), ws, 1.0).worker_id for i in range(6)]
    assert got == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_and_power_of_two():
    router, _ = make_router(Policy.least_loaded)
    ws = [worker("a", running=3), worker("b", running=1), worker("c", running=2)]
    assert router.route(RouteRequest("r", 10, []), ws, 1.0).worker_id == "b"
    p2, _ = make_router(Policy.power_of_two, seed=1)
    picks = {p2.route(RouteRequest("r", 10, []), ws, 1.0).worker_id for _ in range(30)}
    assert "a" not in picks  # the most loaded never wins a pairwise comparison


def test_random_policy_uses_all_workers():
    router, _ = make_router(Policy.random)
    ws = [worker("a"), worker("b"), worker("c")]
    assert {router.route(RouteRequest("r", 10, []), ws, 1.0).worker_id for _ in range(60)} == {"a", "b", "c"}


def test_misses_spread_by_recent_requests_not_instant_load():
    router, index = make_router()
    ws = [worker("a"), worker("b"), worker("c")]
    got = [router.route(RouteRequest(f"r{i}", 128, [1000 + i]), ws, 1.0).worker_id for i in range(6)]
    assert sorted(got[:3]) == ["a", "b", "c"] and sorted(got[3:]) == ["a", "b", "c"]


def test_miss_skips_backlogged_workers_and_rates_decay():
    router, _ = make_router(balance_half_life=10.0)
    ws = [worker("a"), worker("b", queued=2000)]  # b is 2 passes behind (1024-token passes)
    assert [router.route(RouteRequest(str(i), 128, [100 + i]), ws, 1.0).worker_id for i in range(3)] == ["a"] * 3
    kv = router.policy
    assert kv.recent.rate("a", 1.0) == pytest.approx(3 * 128)  # uncached prompt tokens sent to a
    assert kv.recent.rate("a", 11.0) == pytest.approx(3 * 64)  # one half-life later


def test_hit_is_not_a_miss_even_with_recent_traffic():
    router, index = make_router()
    ws = [worker("a"), worker("b")]
    store(index, "a", HASHES)
    for i in range(5):  # a keeps getting its conversation's turns: still the cheapest, so it stays
        assert router.route(RouteRequest(str(i), 128, HASHES), ws, 1.0).worker_id == "a"


def test_reason_is_formatted_when_read_and_worker_ids_stay_literal():
    """The reason is kept as a format string and its arguments; a worker id with braces (ids are the
    operator's) is an argument or escaped text, never format syntax."""
    router, index = make_router()
    for wid in ("a{0}", "b}"):
        index.add_worker(wid)
    store(index, "a{0}", HASHES[:4])
    d = router.route(RouteRequest("r", 128, HASHES), [worker("a{0}"), worker("b}")], 1.0)
    assert d.worker_id == "a{0}" and d.why_args  # not formatted yet
    assert d.reason == d.why.format(*d.why_args) and "4 cached blocks" in d.reason
    joined = replace(d, why=d.why_plus("prefill on p{1} (x})"))
    assert joined.reason == d.reason + "; prefill on p{1} (x})"
    plain = Decision("r", "w", "kv_aware", "text {kept}")  # no arguments: taken as it is
    assert plain.reason == "text {kept}" and plain.why_plus("{x}") == "text {kept}; {x}"
    p2, _ = make_router(policy=Policy.power_of_two)
    d = p2.route(RouteRequest("r", 128, HASHES), [worker("x{"), worker("y}")], 1.0)
    assert d.reason.startswith("less loaded of two sampled (vs ") and ("x{" in d.reason or "y}" in d.reason)
