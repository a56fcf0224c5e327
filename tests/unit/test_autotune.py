"""The weight tuner (router/autotune.py): steps, keeps, reverts, the noise gate, bounds, the config switch."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from thunderagent.config import CostWeights, Policy, RoutingConfig
from thunderagent.config.autotune import AutotuneConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.autotune import TuneStep, WeightTuner, Window, feed
from thunderagent.router.router import KvRouter


def _cfg(**kw: object) -> AutotuneConfig:
    base: dict[str, object] = {"enabled": True, "window": 4, "min_samples": 4, "switch_every": 2, "z": 2.0,
                               "max_rel_noise": 0.5, "params": ("credit_load_scale",), "step": 2.0,
                               "min_step": 2.0}
    base.update(kw)
    return AutotuneConfig(**base)  # type: ignore[arg-type]


JITTER = (0.01, -0.01, 0.02, -0.02)


def drive(t: WeightTuner, f: Callable[[CostWeights, int], float], n: int, start: float = 0.0) -> list[TuneStep]:
    """``n`` requests, the i-th arriving and finishing at ``start + i`` with TTFT ``f(weights in effect, i)``."""
    steps: list[TuneStep] = []
    for i in range(n):
        now = start + i
        steps += t.observe(now, f(t.weights, i), 100, 0, 0, now)
    return steps


def test_window_stats() -> None:
    w = Window()
    for v, best, cached in ((1.0, 50, 10), (2.0, 0, 0), (3.0, 100, 100)):
        w.add(v, 100, cached, best)
    assert w.mean == 2.0
    assert w.se == pytest.approx((1.0 / 3) ** 0.5)
    assert w.recompute_rate == 40 / 300


def test_window_noise_counts_blocks_of_correlated_requests() -> None:
    # 8 blocks of 10 requests, each block's TTFT its own (requests of a block share its queues)
    w = Window()
    for b in range(8):
        for _ in range(10):
            w.add(float(b), 100, 0, 0, block=b)
    per_request = (sum((b - 3.5) ** 2 for b in range(8)) * 10 / 79 / 80) ** 0.5  # 0.258
    assert w.se == pytest.approx((6.0 / 8) ** 0.5) and w.se > 3 * per_request  # the blocks' means: var 6
    # under MIN_BLOCKS blocks the per-request estimate stands alone
    few = Window()
    for b in range(7):
        for _ in range(10):
            few.add(float(b), 100, 0, 0, block=b)
    assert few.se == pytest.approx((sum((b - 3.0) ** 2 for b in range(7)) * 10 / 69 / 70) ** 0.5)
    # blocks that agree add nothing: the per-request estimate is the larger
    flat = Window()
    for b in range(8):
        for x in (1.0, 3.0):
            flat.add(x, 100, 0, 0, block=b)
    assert flat.se == pytest.approx((16 / 15 / 16) ** 0.5)


def test_the_arms_alternate_and_a_clear_gain_is_kept_then_pushed() -> None:
    t = WeightTuner(_cfg(), CostWeights())
    seen: list[float] = []

    def ttft(w: CostWeights, i: int) -> float:
        seen.append(w.credit_load_scale)
        return 1.0 / w.credit_load_scale + JITTER[i % 4]

    steps = drive(t, ttft, 10)
    # request 0 starts the trial (not a sample); then 2 tried, 2 kept, ... until 4 each
    assert seen == [4.0, 8.0, 8.0, 4.0, 4.0, 8.0, 8.0, 4.0, 4.0, 16.0]
    assert [(s.action, s.old, s.new) for s in steps] == [("try", 4.0, 8.0), ("keep", 4.0, 8.0), ("try", 8.0, 16.0)]
    assert t.kept.credit_load_scale == 8.0 and t.weights.credit_load_scale == 16.0


def test_worse_reverts_and_the_other_direction_is_tried() -> None:
    t = WeightTuner(_cfg(), CostWeights())
    steps = drive(t, lambda w, i: w.credit_load_scale + JITTER[i % 4], 9)
    assert [(s.action, s.old, s.new) for s in steps] == [("try", 4.0, 8.0), ("revert", 8.0, 4.0), ("try", 4.0, 2.0)]
    assert "worse" in steps[1].reason
    assert t.kept == CostWeights() and t.weights.credit_load_scale == 2.0


def test_a_gain_within_noise_reverts() -> None:
    t = WeightTuner(_cfg(), CostWeights())
    noise = (0.3, -0.3, 0.1, -0.1)
    steps = drive(t, lambda w, i: 1.0 - 0.05 * (w.credit_load_scale > 4) + noise[i % 4], 9)
    assert [s.action for s in steps] == ["try", "revert", "try"] and "within noise" in steps[1].reason
    assert t.kept == CostWeights()


def test_a_noisy_arm_never_decides_a_keep() -> None:
    t = WeightTuner(_cfg(max_rel_noise=0.001), CostWeights())
    steps = drive(t, lambda w, i: 1.0 / w.credit_load_scale + JITTER[i % 4], 9)
    assert [s.action for s in steps] == ["try", "revert", "try"] and "too noisy" in steps[1].reason
    assert t.kept == CostWeights()


def test_a_request_counts_for_the_weights_in_effect_when_it_arrived() -> None:
    t = WeightTuner(_cfg(switch_every=100), CostWeights())
    t.observe(0.0, 1.0, 100, 0, 0, 10.0)  # starts the trial at 10.0 (tried weights in effect)
    assert t.observe(5.0, 1.0, 100, 0, 0, 11.0) == []  # arrived before the trial: dropped
    t.observe(10.0, 1.0, 100, 0, 0, 12.0)  # arrived at the switch: the tried weights
    assert t.samples == 1
    trying = t.summary()["trying"]
    assert trying == {"param": "credit_load_scale", "value": 8.0, "samples": [0, 1]}


def test_bounds_clamp_and_skip() -> None:
    t = WeightTuner(_cfg(credit_load_scale_bounds=(1.0, 6.0)), CostWeights())
    steps = drive(t, lambda w, i: 1.0 / w.credit_load_scale + JITTER[i % 4], 10)
    assert [(s.action, s.old, s.new) for s in steps] == [("try", 4.0, 6.0), ("keep", 4.0, 6.0), ("try", 6.0, 3.0)]


def test_every_weight_at_its_bounds_holds() -> None:
    t = WeightTuner(_cfg(credit_load_scale_bounds=(4.0, 4.0)), CostWeights())
    steps = drive(t, lambda w, i: 1.0, 5)
    assert [s.action for s in steps] == ["hold"] and t.weights == CostWeights() and t.samples == 0


def test_feed_swaps_the_router_config() -> None:
    routing = RoutingConfig(autotune=_cfg())
    router = KvRouter(routing, KvIndex(120.0), random.Random(0), Policy.kv_aware)
    t = WeightTuner(routing.autotune, routing.weights)
    feed(t, router, 0.0, 1.0, 10, 0, 0, 1.0)  # the first finished request starts a trial
    assert router.cfg.weights.credit_load_scale == 8.0 and router.cfg.weights is t.weights
    assert router.cfg.temperature == routing.temperature
    feed(t, router, 1.0, 1.0, 10, 0, 0, 2.0)
    feed(t, router, 2.0, 1.0, 10, 0, 0, 3.0)  # switch_every = 2: the kept weights again
    assert router.cfg.weights is t.kept is routing.weights


def test_config_switch_and_validation() -> None:
    with pytest.raises(ValidationError, match="routing.autotune.enabled"):
        AutotuneConfig(window=10)
    with pytest.raises(ValidationError, match="distinct names"):
        AutotuneConfig(enabled=True, params=("queue",))
    with pytest.raises(ValidationError, match="outside autotune.contention_bounds"):
        RoutingConfig(autotune=_cfg(params=("contention",), contention_bounds=(2.0, 4.0)))
    with pytest.raises(ValidationError, match="kv_aware only"):
        RoutingConfig(policy=Policy.round_robin, autotune=_cfg())
    with pytest.raises(ValidationError, match="min_samples"):
        AutotuneConfig(enabled=True, window=4, min_samples=5)
    with pytest.raises(ValidationError, match=r"min_step \(4.0\) must not exceed step \(2.0\)"):
        AutotuneConfig(enabled=True, step=2.0, min_step=4.0)
    with pytest.raises(ValidationError, match=r"settle_max_requests \(10\) must not be below"):
        AutotuneConfig(enabled=True, settle_requests=20, settle_max_requests=10)
    for knob in ("min_step", "settle_requests", "settle_max_requests"):
        with pytest.raises(ValidationError, match="routing.autotune.enabled"):
            AutotuneConfig(**{knob: 3})


def test_live_hook_feeds_exports_and_reports() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from thunderagent.control.autotune_hook import AutotuneHook

    routing = RoutingConfig(autotune=_cfg())
    router = KvRouter(routing, KvIndex(120.0), random.Random(0), Policy.kv_aware)
    reg = CollectorRegistry()
    hook = AutotuneHook(routing, router, reg)
    assert 'thunderagent_autotune_weight{name="credit_load_scale"} 4.0' in generate_latest(reg).decode()
    hook.finished(0.0, None, 10, 0, 0, 1.0)  # never produced a token: not a sample
    hook.finished(0.0, 0.5, 10, 0, 0, 1.0)
    assert router.cfg.weights.credit_load_scale == 8.0
    assert 'thunderagent_autotune_weight{name="credit_load_scale"} 8.0' in generate_latest(reg).decode()
    health = hook.health()["autotune"]
    assert health["weights"] == {"credit_load_scale": 8.0} and health["kept"] == {"credit_load_scale": 4.0}
    assert health["steps"][0]["action"] == "try"  # type: ignore[index]
    off = AutotuneHook(RoutingConfig(), router, CollectorRegistry())
    assert off.health() == {} and off.tuner is None


def test_parse_config_names_the_field() -> None:
    from thunderagent.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="routing.autotune.window.*acts only with routing.autotune.enabled"):
        parse_config({"routing": {"autotune": {"window": 10}}})
    cfg = parse_config({"routing": {"autotune": {"enabled": True, "window": 10, "min_samples": 5}}})
    assert cfg.routing.autotune.window == 10


def test_bench_runs_small(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("_bench_autotune", bench / "autotune.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["autotune.py", "--requests", "120", "--timings", "1", "--window", "20"])
    mod.main()
    out = capsys.readouterr().out
    assert "grid best" in out and "tuner ->" in out and "prefill x1:" in out


def test_a_small_gain_shows_once_reverted_trials_are_pooled() -> None:
    noise = (0.2, -0.1, -0.1)  # period 3 against the arms' period 4: both arms see all of it

    def ttft(w: CostWeights, i: int) -> float:
        return 1.0 - 0.15 * (w.credit_load_scale > 4) + noise[i % 3]

    # one move only (down is at the bound): the same trial again and again
    # (no rests between rounds: settling is tested on its own below)
    pooled = WeightTuner(_cfg(credit_load_scale_bounds=(4.0, 8.0), pool_trials=4, settle_requests=0), CostWeights())
    steps = drive(pooled, ttft, 40)
    assert [s.action for s in steps][:4] == ["try", "revert", "try", "keep"]
    assert "within noise" in steps[1].reason and "(n=8," in steps[3].reason  # two trials' samples
    assert pooled.kept.credit_load_scale == 8.0
    fresh = WeightTuner(_cfg(credit_load_scale_bounds=(4.0, 8.0), pool_trials=1, settle_requests=0), CostWeights())
    assert "keep" not in [s.action for s in drive(fresh, ttft, 40)]  # each trial alone is within noise


def test_a_round_without_a_keep_rests_on_the_kept_weights_longer_each_time() -> None:
    # the defaults are best: both moves (x2, /2) revert, then the kept weights run alone
    t = WeightTuner(_cfg(settle_requests=6, settle_max_requests=12), CostWeights())
    seen: list[float] = []

    def ttft(w: CostWeights, i: int) -> float:
        seen.append(w.credit_load_scale)
        return abs(w.credit_load_scale - 4.0) + 1.0 + JITTER[i % 4]

    steps = drive(t, ttft, 17)
    assert [(s.action, s.old, s.new) for s in steps] == [
        ("try", 4.0, 8.0), ("revert", 8.0, 4.0), ("try", 4.0, 2.0), ("revert", 2.0, 4.0), ("hold", 0.0, 0.0)]
    assert "run alone for the next 6 requests" in steps[-1].reason
    # request 16 ended the second trial; the next 6 run on the kept weights alone, then trials resume
    steps = drive(t, ttft, 7, start=17)
    assert seen[17:23] == [4.0] * 6 and t.summary()["resting"] == 0
    assert [(s.action, s.new) for s in steps] == [("try", 8.0)] and t.weights.credit_load_scale == 8.0
    # the second fruitless round rests twice as long, the third as long as settle_max_requests allows
    steps = drive(t, ttft, 16, start=24)
    assert [s.action for s in steps][-1] == "hold" and "next 12 requests" in steps[-1].reason
    assert t._rest == 12  # capped


def test_a_coarse_step_that_finds_nothing_is_refined_down_to_min_step() -> None:
    # the best weight is 2 (TTFT grows with |log2 w - 1|): x8 and /8 from 4 are both worse, x2.83 then /2.83
    # is better; at the finest step (2) nothing is, and the tuner rests. One window per pool: every
    # revert gives its move up at once
    t = WeightTuner(_cfg(step=8.0, min_step=2.0, settle_requests=10, pool_trials=1), CostWeights())

    def ttft(w: CostWeights, i: int) -> float:
        return abs(math.log2(w.credit_load_scale) - 1.0) + 1.0 + JITTER[i % 4]

    steps = drive(t, ttft, 200)
    r = 2 ** 0.5
    assert [(s.action, round(s.old, 3), round(s.new, 3)) for s in steps][:14] == [
        ("try", 4.0, 32.0), ("revert", 32.0, 4.0), ("try", 4.0, 0.5), ("revert", 0.5, 4.0),
        ("refine", 8.0, round(8 ** 0.5, 3)),
        ("try", 4.0, round(4 * 8 ** 0.5, 3)), ("revert", round(4 * 8 ** 0.5, 3), 4.0),
        ("try", 4.0, round(r, 3)), ("keep", 4.0, round(r, 3)),
        ("try", round(r, 3), 0.5), ("revert", 0.5, round(r, 3)),
        ("try", round(r, 3), 4.0), ("revert", 4.0, round(r, 3)),
        ("refine", round(8 ** 0.5, 3), 2.0)]
    assert t.kept.credit_load_scale == pytest.approx(r) and t.step == 2.0
    assert "hold" in [s.action for s in steps] and "refine" not in [s.action for s in steps[14:]]


def test_a_coarse_move_is_given_up_only_on_a_full_pool() -> None:
    # x8 is worse, /8 better by less than one trial's noise: rounds at x8 go on (with rests) while the
    # pools fill, and the pooled samples keep /8; no refinement before that
    noise = (0.2, -0.1, -0.1)

    def ttft(w: CostWeights, i: int) -> float:
        return 1.0 + 0.5 * (w.credit_load_scale > 4) - 0.15 * (w.credit_load_scale < 4) + noise[i % 3]

    t = WeightTuner(_cfg(step=8.0, min_step=2.0, settle_requests=3, pool_trials=4), CostWeights())
    steps = drive(t, ttft, 60)
    acts = [(s.action, s.new) for s in steps]
    assert ("keep", 0.5) in acts
    before = acts[:acts.index(("keep", 0.5))]
    assert before == [("try", 32.0), ("revert", 4.0), ("try", 0.5), ("revert", 4.0), ("hold", 0.0)] * 2 + [
        ("try", 32.0), ("revert", 4.0), ("try", 0.5)]  # the third trial of /8 pools 3 windows
    assert "(n=12," in steps[acts.index(("keep", 0.5))].reason


def test_a_keep_resets_the_rest() -> None:
    t = WeightTuner(_cfg(settle_requests=6, settle_max_requests=48), CostWeights())
    # best at 4 (the kept weights): two rounds fail (17 and 16 requests; rests of 6, then 12) ...
    best = [4.0]

    def ttft(w: CostWeights, i: int) -> float:
        return abs(w.credit_load_scale - best[0]) + 1.0 + JITTER[i % 4]

    steps = drive(t, ttft, 17 + 7 + 16)
    assert [s.action for s in steps].count("hold") == 2 and t._rest == 24
    # ... then the load drifts: 8 wins, is kept, and the next fruitless round rests 6 again
    best[0] = 8.0
    steps = drive(t, ttft, 200, start=40)
    acts = [(s.action, s.new) for s in steps]
    assert ("keep", 8.0) in acts and t.kept.credit_load_scale == 8.0
    # (two more rounds at 4 first: the pool still held their older samples, where 8 was worse)
    assert [a for a, _ in acts[:acts.index(("keep", 8.0))]].count("hold") == 2
    after = steps[acts.index(("keep", 8.0)):]
    holds = [s for s in after if s.action == "hold"]
    assert holds and "next 6 requests" in holds[0].reason


def test_fast_path_explanations_use_the_tuned_weights() -> None:
    from thunderagent.router.candidates import FleetView
    from thunderagent.router.cost import score
    from thunderagent.types import BlockStored, LoadReport, RouteRequest, WorkerState

    def worker(i: int, queued: int) -> WorkerState:
        return WorkerState(f"w{i}", 16, 1024, 8, LoadReport(f"w{i}", 0.0, 0, 0, queued, 0, 0, 0, 1000))

    routing = RoutingConfig(candidate_limit=2, whole_scan_max_workers=0)
    index = KvIndex(120.0)
    for i in range(6):
        index.add_worker(f"w{i}")
    router = KvRouter(routing, index, random.Random(0), Policy.kv_aware)
    hashes = list(range(1001, 1009))
    index.apply_event(BlockStored("w5", 0, tuple(hashes)), 0.0)
    workers = [worker(i, 100 * i) for i in range(5)] + [worker(5, 2048)]
    view = FleetView(routing, workers)  # built with the hand-set weights, as the drivers do
    router.cfg = routing.model_copy(update={"weights": routing.weights.model_copy(update={"credit_load_scale": 0.5})})
    d = router.route(RouteRequest("r", 128, hashes), view, 1.0)
    held = d.candidates[5]
    assert held.cost == score(workers[5], 128, 8, router.cfg, 0, 128).cost
    assert held.cost != score(workers[5], 128, 8, routing, 0, 128).cost
