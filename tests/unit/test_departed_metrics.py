"""A worker that left the fleet keeps its labelled series for ``DEPARTED_SERIES_S``, then they are
removed (control/metrics.py): the page does not grow with every worker id ever seen."""

from __future__ import annotations

from prometheus_client import generate_latest

from thunderagent.control.metrics import DEPARTED_SERIES_S, Metrics
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.types import Decision, EngineRequest, LoadReport


def load(worker: str) -> LoadReport:
    return LoadReport(worker, 0.0, 2, 1, 64, 100, 10, 20, 100)


def serve_one(m: Metrics, worker: str, now: float) -> None:
    """What a request leaves behind: load gauges, routing counters, a hit, latency histograms."""
    req = EngineRequest("r", [1] * 128, [], 0, 4)
    d = Dispatch(req, Decision("r", worker, "kv_aware", "cost", overlap_blocks=1), 64, 64)
    m.observe_load(load(worker), True)
    m.observe_route(d, 1e-5, now)
    lat = m.seed.latency(worker, "tenant")
    lat.ttft(0.2)
    lat.itl(0.01)
    m.out_of_routing.labels(worker, "unreachable").set(0)


def page(m: Metrics) -> str:
    return generate_latest(m.registry).decode()


def test_a_departed_workers_series_go_after_the_grace_and_come_back_fresh_if_it_returns() -> None:
    m = Metrics(60.0, 4)
    for w in ("w1", "w2"):
        serve_one(m, w, 1.0)
    m.observe_fleet([load("w1"), load("w2")], 1.0)
    before = page(m)
    assert before.count('worker="w1"') >= 8  # gauges, counters, histograms, the two-label gauge
    m.observe_fleet([load("w2")], 2.0)  # w1 left: its series stay while a dashboard shows it
    m.observe_fleet([load("w2")], 2.0 + DEPARTED_SERIES_S - 0.1)
    assert page(m).count('worker="w1"') == before.count('worker="w1"')
    m.observe_fleet([load("w2")], 2.0 + DEPARTED_SERIES_S)
    after = page(m)
    assert 'worker="w1"' not in after
    assert after.count('worker="w2"') == before.count('worker="w2"')  # the others untouched
    assert m.registry.get_sample_value("thunderagent_routed_total", {"worker": "w2"}) == 1.0

    serve_one(m, "w1", 700.0)  # the same id again: its series start over and are exported
    assert m.registry.get_sample_value("thunderagent_routed_total", {"worker": "w1"}) == 1.0
    assert m.registry.get_sample_value("thunderagent_routed_hits_total", {"worker": "w1"}) == 1.0
    assert m.registry.get_sample_value("thunderagent_worker_ttft_seconds_count", {"worker": "w1"}) == 1.0


def test_a_worker_back_before_the_grace_keeps_its_series() -> None:
    m = Metrics(60.0, 4)
    serve_one(m, "w1", 1.0)
    m.observe_fleet([load("w1")], 1.0)
    m.observe_fleet([], 2.0)
    m.observe_fleet([load("w1")], 2.0 + DEPARTED_SERIES_S / 2)  # back: the clock starts over when it leaves again
    m.observe_fleet([], 3.0 + DEPARTED_SERIES_S / 2)
    m.observe_fleet([], 2.0 + DEPARTED_SERIES_S + 1)
    assert m.registry.get_sample_value("thunderagent_routed_total", {"worker": "w1"}) == 1.0
    m.observe_fleet([], 3.0 + 1.5 * DEPARTED_SERIES_S)
    assert m.registry.get_sample_value("thunderagent_routed_total", {"worker": "w1"}) is None
