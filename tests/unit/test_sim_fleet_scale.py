"""The simulator at fleet scale: skipped load refreshes change nothing, traffic scaled to the fleet,
and the per-run figures a scale study reads (decision time, KV-event load).

Before each routing decision the driver brings every engine's load report up to date, but refreshes
only the engines whose report may have changed: each engine tells a heap when that can next happen
(``SimulatedEngine.watch_load``). These tests pin that the skipping is invisible: the same runs with
every engine refreshed before each decision (as before it existed) give the very same results.
"""

from __future__ import annotations

import pytest

from thunderagent.config import (
    DisaggConfig,
    KvTransferConfig,
    MigrationConfig,
    NodeConfig,
    Policy,
    RoutingConfig,
    SchedulerConfig,
)
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.sim.driver import PdSetup, Simulator, _Run
from thunderagent.sim.generators import fleet_traffic
from thunderagent.sim.scaling import ScalingSim
from thunderagent.types import EngineRequest

NODE = NodeConfig(kv_blocks=2048)  # small pools: evictions (BlockRemoved) happen


def _fingerprint(out) -> tuple:
    r = out.result
    extra = dict(r.extra)
    return (sorted(out.ttft_by_id.items()), sorted(out.times_by_id.items()), out.requests_per_worker,
            r.ttft_ms, r.itl_ms, r.e2e_ms, r.prefix_reuse, r.prefill_recompute_rate, extra)


def _refresh_every_engine(run, now: float) -> None:
    """The refresh before the skipping existed: every engine's report, before each decision."""
    states = run.sim._states
    for i, e in enumerate(run.sim.engines):
        states.set_load(i, e.load(now))


def _both(monkeypatch, make) -> tuple[tuple, tuple]:
    """``make()`` run as shipped, then with every engine refreshed before each decision."""
    fast = _fingerprint(make())
    with monkeypatch.context() as m:
        m.setattr(_Run, "refresh_loads", _refresh_every_engine)
        slow = _fingerprint(make())
    return fast, slow


@pytest.mark.parametrize("policy", [Policy.kv_aware, Policy.least_loaded])
def test_skipping_unchanged_engines_changes_no_result(monkeypatch, policy):
    reqs = fleet_traffic("chat", 24, 12, 2.0, seed=3)

    def make():
        return Simulator(NODE, RoutingConfig(seed=1), 24, policy, seed=1).run(reqs, 1.0)

    fast, slow = _both(monkeypatch, make)
    assert fast == slow
    assert fast[-1]["kv_event_blocks"] > 0


def test_skipping_is_invisible_with_disaggregation_and_cache_migration(monkeypatch):
    """Engines touched outside a decision: prefill jobs and their transfers, cache copies pinned on the
    source, released and imported on the target."""
    from tests.unit.test_sim_migration import workload

    pd = PdSetup(1, 4, DisaggConfig(mode="always"), KvTransferConfig(enabled=True, bandwidth_gbps=200.0))
    routing = RoutingConfig(migration=MigrationConfig(enabled=True))
    reqs = workload(True, 6.0, prefix_tokens=32768, burst_s=8.0)

    def make():
        return Simulator(NodeConfig(), routing, 5, Policy.kv_aware, seed=0, pd=pd).run(reqs, 1.0)

    fast, slow = _both(monkeypatch, make)
    assert fast == slow
    assert fast[-1]["migration"]["landed"] >= 1 and fast[-1]["pd"]["remote_prefills"] > 0


def test_skipping_is_invisible_with_the_holding_queue(monkeypatch):
    """Held requests dispatched when a sequence slot frees (``_pump``), then their engines scheduled."""
    reqs = fleet_traffic("chat", 6, 30, 20.0, seed=1)
    node = NodeConfig(kv_blocks=2048, max_batch_size=2)

    def make():
        return Simulator(node, RoutingConfig(), 6, Policy.kv_aware, seed=0,
                         scheduler=SchedulerConfig(enabled=True)).run(reqs, 1.0)

    fast, slow = _both(monkeypatch, make)
    assert fast == slow
    assert fast[-1]["queue_wait_ms"]["max"] > 0


def test_skipping_is_invisible_when_the_planner_starts_and_drains_workers(monkeypatch):
    from thunderagent.config import PlannerConfig
    from thunderagent.sim.generators import ramp

    reqs = ramp(24, 1024, (256, 1024), 4.0, base_rate=0.5, ramp_up_s=120.0, hold_s=30.0, ramp_down_s=120.0, seed=2)
    planner = PlannerConfig(enabled=True, interval_s=5.0, window_s=20.0, cooldown_s=15.0, min_workers=1,
                            max_workers=4)
    node = NodeConfig(kv_blocks=1024, timing={"speedup": 0.05})

    def make():
        return ScalingSim(node, RoutingConfig(), Policy.kv_aware, mode="step", initial=1, max_workers=4,
                          planner=planner, startup_s=10.0).replay(reqs, 120.0).outcome

    fast, slow = _both(monkeypatch, make)
    assert fast == slow


def _request(rid: str, blocks: int) -> EngineRequest:
    tokens = list(range(blocks * 64))
    return EngineRequest(rid, tokens, list(range(1, blocks + 1)), 0, 50, ignore_eos=True)


def test_load_unchanged_until_the_pass_ends_or_the_engine_is_touched():
    e = SimulatedEngine("w", NodeConfig())
    e.load(0.0)
    assert e.load_unchanged(5.0)  # idle, nothing buffered: nothing can change
    e.add_request(_request("a", 4), 1.0)
    assert not e.load_unchanged(1.0)  # touched since the last report
    end = e.next_wakeup()
    assert end is not None
    first = e.load(1.0 + 1e-9)  # the prefill pass is in flight
    assert e.load_unchanged(end - 1e-6)
    again = e.load(end - 1e-6)
    assert (again.running, again.waiting, again.queued_prefill_tokens, again.decode_tokens,
            again.kv_active_blocks) == (first.running, first.waiting, first.queued_prefill_tokens,
                                        first.decode_tokens, first.kv_active_blocks)
    assert not e.load_unchanged(end)  # the pass ends: the report changes
    e.load(end)
    assert not e.load_unchanged(end + 1e-6)  # the next (decode) pass starts at ``end``
    nxt = e.load(end + 1e-6)
    assert nxt.decode_tokens > first.decode_tokens
    assert e.load_unchanged(end + 2e-6)
    e.advance(end + 2e-6)
    assert not e.load_unchanged(end + 2e-6)  # any other call may have changed it
    e.load(end + 2e-6)
    _ = e.blocks  # the pool handed out: the caller may change it
    assert not e.load_unchanged(end + 2e-6)


@pytest.mark.parametrize("kind,steps", [("chat", 5), ("agents", 10)])
def test_fleet_traffic_scales_with_the_fleet(kind, steps):
    small = fleet_traffic(kind, 4, 20, 2.0, seed=0)
    big = fleet_traffic(kind, 40, 20, 2.0, seed=0)
    assert len(small) == 4 * 20 and len(big) == 40 * 20  # whole sessions of ``steps`` requests
    assert len({r.session for r in big}) == 40 * 20 // steps
    # the same load per worker: sessions start 10x faster on a 10x fleet
    first: dict[str, float] = {}
    for r in big:
        first[r.session] = min(first.get(r.session, r.arrival_s), r.arrival_s)
    starts = sorted(first.values())
    rate = (len(starts) - 1) / (starts[-1] - starts[0])
    assert rate == pytest.approx(2.0 * 40 / steps, rel=0.25)
    assert fleet_traffic(kind, 4, 20, 2.0, seed=0) == small  # deterministic per seed


def test_fleet_traffic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="chat, agents"):
        fleet_traffic("web", 4, 10, 1.0)
    with pytest.raises(ValueError, match="rate_per_worker"):
        fleet_traffic("chat", 4, 10, 0.0)


def test_a_run_reports_decision_times_and_kv_event_load():
    reqs = fleet_traffic("chat", 8, 10, 1.0, seed=0)
    out = Simulator(NODE, RoutingConfig(), 8, Policy.kv_aware).run(reqs, 1.0)
    r = out.result
    assert r.decision_us is not None and 0 < r.decision_us.p50 <= r.decision_us.p99
    assert r.to_json()["decision_us"]["p50"] == r.decision_us.p50
    stored = sum(-(-t.input_length // 64) for t in reqs)  # an upper bound on the prompt blocks cached
    assert 0 < r.extra["kv_event_blocks"] <= 2 * (stored + sum(t.output_length for t in reqs) // 64 + len(reqs))
