"""The scaling planner acting in the simulator on a short ramp (issue 13 item 5): step-wise adds one
worker at a time (each joining cold after its start-up) while load rises and drains them as it
falls; add-all-at-once starts every worker on the first +1; both are paid less than the largest
fixed fleet. Seconds of wall time (a few hundred requests on a 20x slower simulated engine)."""

from __future__ import annotations

from thunderagent.config import NodeConfig, PlannerConfig, Policy, RoutingConfig, TimingConfig
from thunderagent.sim.generators import ramp
from thunderagent.sim.scaling import ScalingSim


def test_step_wise_and_all_at_once_on_a_short_ramp() -> None:
    node = NodeConfig(kv_blocks=1024, timing=TimingConfig(speedup=0.05))
    routing = RoutingConfig()
    reqs = ramp(8, 1024, 512, 3.0, base_rate=0.2, ramp_up_s=120, hold_s=60, ramp_down_s=120, output_tokens=16)
    assert 300 < len(reqs) < 800
    pc = PlannerConfig(enabled=True, interval_s=2.0, window_s=10.0, cooldown_s=15.0, max_workers=4, warm_requests=5,
                       up_ttft_s=2.0, down_ttft_s=1.0, up_kv_usage=0.5, down_kv_usage=0.3, up_queue_per_worker=1.0)
    fixed = ScalingSim(node, routing, Policy.kv_aware, mode="fixed", initial=4, max_workers=4).replay(reqs, 120)
    step_sim = ScalingSim(node, routing, Policy.kv_aware, mode="step", initial=1, max_workers=4, planner=pc,
                          startup_s=10.0)
    step = step_sim.replay(reqs, 120)
    every = ScalingSim(node, routing, Policy.kv_aware, mode="all", initial=1, max_workers=4, planner=pc,
                       startup_s=10.0).replay(reqs, 120)
    for r in (fixed, step, every):
        assert r.requests == len(reqs)  # every request served
    ups = [t for t, d, _ in step.steps if d > 0]
    downs = [t for t, d, _ in step.steps if d < 0]
    assert len(ups) >= 2 and downs and max(ups) < min(downs)  # up while load rises, then down
    assert all(b - a >= 15.0 for a, b in zip(ups, ups[1:]))  # one step per cooldown at most
    assert step.peak_workers <= 4 and every.peak_workers == 4
    assert step.worker_minutes < fixed.worker_minutes and every.worker_minutes < fixed.worker_minutes
    assert fixed.worker_minutes == 4 * fixed.duration_s / 60
