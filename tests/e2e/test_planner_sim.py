"""The scaling planner acting in the simulator on a short ramp (issue 13 item 5): step-wise adds one
worker at a time (each joining cold after its start-up) while load rises and drains them as it
falls; add-all-at-once starts every worker on the first +1; both are paid less than the largest
fixed fleet. Seconds of wall time (a few hundred requests on a 20x slower simulated engine)."""

from __future__ import annotations

import json

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


def test_sim_cli_planner(tmp_path) -> None:
    from tests.e2e.test_sim_cli import EXCERPT, run_sim

    cfg = tmp_path / "planner.yaml"
    cfg.write_text("planner:\n  enabled: true\n  interval_s: 1\n  window_s: 10\n  cooldown_s: 10\n")
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(EXCERPT), "--workers", "4", "--speedup", "4", "--policy", "kv_aware",
                  "--config", str(cfg), "--planner", "--planner-startup-s", "5", "--json", str(out))
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["policy"] == "kv_aware+planner" and run["requests"] == 200
    scaling = run["extra"]["scaling"]
    assert scaling["mode"] == "step" and 1 <= scaling["peak_workers"] <= 4 and scaling["worker_minutes"] > 0
    res = run_sim("--trace", str(EXCERPT), "--planner")  # no planner in the config
    assert res.returncode == 2 and "--planner needs a config with planner: enabled: true" in res.stderr
    # with the holding queue (serve's default) and with program pacing: the planner sizes the fleet the
    # scheduler dispatches to, and every request is still served
    res = run_sim("--trace", str(EXCERPT), "--workers", "4", "--speedup", "4", "--policy", "kv_aware",
                  "--config", str(cfg), "--planner", "--planner-startup-s", "5", "--scheduler", "on",
                  "--pacing", "ours", "--json", str(out))
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["policy"] == "kv_aware+scheduler+pacing:ours+planner" and run["requests"] == 200
    assert run["extra"]["scaling"]["worker_minutes"] > 0 and "pacing" in run["extra"]


def test_forecast_sizing_acts_in_the_simulator() -> None:
    """planner.target_utilization in the simulator: steps whose reason is the arrival forecast, every request
    served, up while the load rises and down after."""
    node = NodeConfig(kv_blocks=1024, timing=TimingConfig(speedup=0.05))
    reqs = ramp(8, 1024, 512, 3.0, base_rate=0.2, ramp_up_s=120, hold_s=60, ramp_down_s=120, output_tokens=16)
    pc = PlannerConfig(enabled=True, interval_s=2.0, window_s=10.0, cooldown_s=15.0, max_workers=4, warm_requests=5,
                       up_ttft_s=2.0, down_ttft_s=1.0, up_kv_usage=0.5, down_kv_usage=0.3, up_queue_per_worker=1.0,
                       target_utilization=0.8, forecast_lead_s=12.0, trend_window_s=30.0)
    r = ScalingSim(node, RoutingConfig(), Policy.kv_aware, mode="step", initial=1, max_workers=4, planner=pc,
                   startup_s=10.0).replay(reqs, 120)
    assert r.requests == len(reqs)
    assert any(why[0].startswith("forecast: ") for why in r.reasons)
    ups = [t for t, d, _ in r.steps if d > 0]
    downs = [t for t, d, _ in r.steps if d < 0]
    assert ups and downs and min(ups) < min(downs)


def test_planner_in_closed_loop_scales_agent_programs(tmp_path) -> None:
    """`--planner --closed-loop --horizon H` (agent programs: each session's next step after its previous one and
    its think time): the planner's looks ride on open-loop markers up to the horizon, it adds workers while the
    programs queue on one, the session figures are reported, and decisions can be logged. Without a horizon a
    closed-loop planner run is refused (when its last request ends is not known beforehand)."""
    from tests.e2e.test_sim_cli import AGENTIC_EXCERPT, run_sim

    cfg = tmp_path / "planner.yaml"
    cfg.write_text("planner:\n  enabled: true\n  interval_s: 1\n  window_s: 5\n  cooldown_s: 5\n  up_ttft_s: 0.5\n  down_ttft_s: 0.2\n"
                   "  up_queue_per_worker: 0.5\n")
    out, log = tmp_path / "out.json", tmp_path / "decisions.jsonl"
    res = run_sim("--trace", str(AGENTIC_EXCERPT), "--workers", "3", "--kv-blocks", "1200", "--closed-loop",
                  "--think-cap", "2", "--policy", "kv_aware", "--config", str(cfg), "--planner",
                  "--planner-startup-s", "2", "--horizon", "600", "--decision-log", str(log), "--json", str(out))
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["policy"] == "kv_aware+planner"
    x = run["extra"]
    assert x["sessions"] == 4 and x["steps_per_min"] > 0 and x["horizon_s"] == 600
    assert x["scaling"]["mode"] == "step" and x["scaling"]["steps"] and x["scaling"]["steps"][0][1] == 1
    assert 1 < x["scaling"]["peak_workers"] <= 3
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines and {line["run"] for line in lines} == {"kv_aware+planner"}
    assert len(lines) == run["requests"]  # (every request decided once: the planner's markers are no requests)
    res = run_sim("--trace", str(AGENTIC_EXCERPT), "--closed-loop", "--config", str(cfg), "--planner")
    assert res.returncode == 2 and "--horizon" in res.stderr
