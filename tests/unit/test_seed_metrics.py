"""Window sums and the seed metrics' arithmetic (control/window.py, control/seed_metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from thunderagent.control.seed_metrics import SeedMetrics, decision_kind
from thunderagent.control.window import WindowSums
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.types import Decision, EngineRequest, LoadReport


def test_window_sums_cover_the_last_window_to_one_slice():
    w = WindowSums(60.0, 2, buckets=6)  # 10 s slices
    w.add(0.0, 1, 10)
    w.add(15.0, 2, 20)
    assert w.totals(15.0) == [3.0, 30.0]
    assert w.totals(59.9) == [3.0, 30.0]
    assert w.totals(60.0) == [2.0, 20.0]  # slice [0, 10) fell out
    assert w.totals(70.0) == [0.0, 0.0]  # and [10, 20)
    w.add(1000.0, 5, 0)  # a long silence clears everything
    assert w.totals(1000.0) == [5.0, 0.0]
    w.add(990.0, 1, 1)  # a clock that went back counts in the newest slice
    assert w.totals(1000.0) == [6.0, 1.0]
    with pytest.raises(ValueError):
        WindowSums(0.0, 1)


def dispatch(overlap: int = 0, best_known: int = 0, predicted: int = 0, wait: float = 0.0,
             grouped: bool = False, fallback: bool = False, busy: int = 0) -> Dispatch:
    req = EngineRequest("r", [1] * 10, [], 0, 4)
    dec = Decision("r", "w0", "kv_aware", "cost", overlap_blocks=overlap, fallback=fallback, busy_filtered=busy)
    return Dispatch(req, dec, best_known, predicted, queue_wait=wait, grouped=grouped)


def test_decision_kinds_in_precedence_order():
    assert decision_kind(dispatch(grouped=True, wait=1.0)) == "grouped"
    assert decision_kind(dispatch(wait=0.5, overlap=2)) == "held"
    assert decision_kind(dispatch(fallback=True, overlap=1)) == "fallback"
    assert decision_kind(dispatch(busy=1, overlap=1)) == "busy_filtered"
    assert decision_kind(dispatch(overlap=1, best_known=64, predicted=64)) == "hit"
    assert decision_kind(dispatch(best_known=64)) == "miss_balance"
    assert decision_kind(dispatch()) == "miss"


def value(r: CollectorRegistry, name: str, **labels: str) -> float:
    v = r.get_sample_value(name, labels)
    assert v is not None, name
    return v


def test_rates_over_the_window_and_the_fleet_shape():
    r = CollectorRegistry()
    m = SeedMetrics(r, 60.0, max_route_keys=2)
    m.routed(dispatch(), 0.0)
    m.routed(dispatch(overlap=3, best_known=192, predicted=192), 1.0)
    m.ended(200, 0, 0, 2.0)
    m.ended(300, 192, 64, 3.0)
    assert value(r, "thunderagent_cache_hit_rate") == 0.5
    assert value(r, "thunderagent_cache_reuse_rate") == pytest.approx(192 / 500)
    assert value(r, "thunderagent_prefill_recompute_window_rate") == pytest.approx(64 / 500)
    assert value(r, "thunderagent_decisions_total", kind="hit") == 1
    assert value(r, "thunderagent_decisions_total", kind="miss") == 1
    assert value(r, "thunderagent_decisions_total", kind="grouped") == 0  # every kind exported from the start
    m.refresh(100.0)  # a quiet window decays to nothing
    assert value(r, "thunderagent_cache_hit_rate") == 0.0 and value(r, "thunderagent_cache_reuse_rate") == 0.0
    loads = [LoadReport(f"w{i}", 0.0, 1, q, 0, 0, kv, 0, 100) for i, (q, kv) in enumerate([(1, 10), (9, 80), (3, 5)])]
    m.loads(loads)
    assert value(r, "thunderagent_hot_worker_queue_depth") == 9
    assert value(r, "thunderagent_queue_skew_ratio") == 3.0  # 9 / median 3
    assert value(r, "thunderagent_kv_usage_max") == 0.8
    m.loads([LoadReport("w0", 0.0, 0, 0, 0, 0, 0, 0, 100), LoadReport("w1", 0.0, 0, 2, 0, 0, 0, 0, 100)])
    assert value(r, "thunderagent_queue_skew_ratio") == 2.0  # a median of 0 counts as 1


def test_route_keys_are_capped_into_other():
    r = CollectorRegistry()
    m = SeedMetrics(r, 60.0, max_route_keys=2)
    for key in ("a", "b", "c", "a", "d"):
        m.latency("w0", key).ttft(0.5)
    assert value(r, "thunderagent_route_key_ttft_seconds_count", route_key="a") == 2
    assert value(r, "thunderagent_route_key_ttft_seconds_count", route_key="b") == 1
    assert value(r, "thunderagent_route_key_ttft_seconds_count", route_key="_other") == 2
    assert value(r, "thunderagent_worker_ttft_seconds_count", worker="w0") == 5
