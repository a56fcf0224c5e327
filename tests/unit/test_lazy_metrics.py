"""Rates computed when scraped (control/seed_metrics.py, control/metrics.py) read exactly what the
eager per-request recompute they replaced would have set."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from thunderagent.control.metrics import Metrics
from thunderagent.control.seed_metrics import SeedMetrics
from thunderagent.control.window import WindowSums
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.types import Decision, EngineRequest


def dispatch(prompt: int = 10, predicted: int = 0, worker: str = "w0") -> Dispatch:
    req = EngineRequest("r", [1] * prompt, [], 0, 4)
    return Dispatch(req, Decision("r", worker, "kv_aware", "cost", overlap_blocks=1 if predicted else 0),
                    predicted, predicted)


def value(r: CollectorRegistry, name: str, **labels: str) -> float | None:
    return r.get_sample_value(name, labels)


def test_window_rates_read_at_scrape_equal_the_eager_recompute():
    rng = random.Random(7)
    r = CollectorRegistry()
    m = SeedMetrics(r, 20.0, max_route_keys=4)
    routed, ended = WindowSums(20.0, 2), WindowSums(20.0, 3)  # the reference: recomputed after every call
    expect = (0.0, 0.0, 0.0)
    now = 0.0
    for _ in range(400):
        now += rng.choice((0.0, 0.3, 1.7, 9.0))
        op = rng.random()
        if op < 0.4:
            predicted = rng.choice((0, 64))
            m.routed(dispatch(predicted=predicted), now)
            routed.add(now, 1.0, 1.0 if predicted else 0.0)
        elif op < 0.8:
            prompt = rng.randint(1, 500)
            cached, recomputed = rng.randint(0, prompt), rng.randint(0, 50)
            m.ended(prompt, cached, recomputed, now)
            ended.add(now, prompt, cached, recomputed)
        else:
            m.refresh(now)  # the health tick
        n, hits = routed.totals(now)
        prompt, cached, recomputed = ended.totals(now)
        expect = (hits / n if n else 0.0, cached / prompt if prompt else 0.0, recomputed / prompt if prompt else 0.0)
        if rng.random() < 0.3:  # scraped now and then: between scrapes nothing is computed
            assert value(r, "thunderagent_cache_hit_rate") == expect[0]
            assert value(r, "thunderagent_cache_reuse_rate") == expect[1]
            assert value(r, "thunderagent_prefill_recompute_window_rate") == expect[2]
    assert value(r, "thunderagent_cache_hit_rate") == expect[0]


def test_latency_children_are_built_once_per_worker_and_route_key():
    r = CollectorRegistry()
    m = SeedMetrics(r, 60.0, max_route_keys=1)
    a = m.latency("w0", "k1")
    assert m.latency("w0", "k1") is a
    assert m.latency("w0", "k2") is m.latency("w0", "k3")  # both past the cap: _other
    assert m.latency("w1", "k1") is not a
    a.ttft(0.5)
    m.latency("w0", "k1").itl(0.1)
    m.latency("w0", "k9").ttft(0.2)
    assert value(r, "thunderagent_worker_ttft_seconds_count", worker="w0") == 2
    assert value(r, "thunderagent_route_key_ttft_seconds_count", route_key="k1") == 1
    assert value(r, "thunderagent_route_key_itl_seconds_count", route_key="k1") == 1
    assert value(r, "thunderagent_route_key_ttft_seconds_count", route_key="_other") == 1


def test_decision_and_hit_counters_keep_their_children():
    r = CollectorRegistry()
    m = SeedMetrics(r, 60.0, max_route_keys=1)
    for d in (dispatch(predicted=64, worker="w1"), dispatch(predicted=64, worker="w1"), dispatch(worker="w2")):
        m.routed(d, 1.0)
    assert value(r, "thunderagent_decisions_total", kind="hit") == 2
    assert value(r, "thunderagent_decisions_total", kind="miss") == 1
    assert value(r, "thunderagent_routed_hits_total", worker="w1") == 2
    assert value(r, "thunderagent_routed_hits_total", worker="w2") is None


def test_fleet_rates_keep_the_denominators_a_set_would_have_left():
    m = Metrics(60.0, 4)
    r = m.registry
    assert value(r, "thunderagent_router_predicted_hit_rate") == 0.0
    assert value(r, "thunderagent_prefill_recompute_rate") == 0.0
    d = dispatch(prompt=100, predicted=40)
    d.best_known_tokens = 80
    m.observe_route(d, 1e-5, 1.0)
    assert value(r, "thunderagent_router_predicted_hit_rate") == 0.4
    m.observe_prefill(d, 100, 30, 2.0)  # 50 recomputed of the 100 routed so far
    assert value(r, "thunderagent_prefill_recompute_rate") == 0.5
    m.observe_route(dispatch(prompt=100), 1e-5, 3.0)
    assert value(r, "thunderagent_router_predicted_hit_rate") == 0.2
    # the recompute rate moves with its own observations only, as when it was set per request
    assert value(r, "thunderagent_prefill_recompute_rate") == 0.5
    m.observe_prefill(dispatch(prompt=100), 100, 0, 4.0)
    assert value(r, "thunderagent_prefill_recompute_rate") == 0.25
