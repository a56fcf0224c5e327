"""The weight tuner (router/autotune.py): steps, keeps, reverts, the noise gate, bounds, the config switch."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from thunderagent.config import CostWeights, Policy, RoutingConfig
from thunderagent.config.autotune import AutotuneConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.autotune import WeightTuner, Window, feed
from thunderagent.router.router import KvRouter


def _cfg(**kw: object) -> AutotuneConfig:
    base: dict[str, object] = {"enabled": True, "window": 4, "min_samples": 4, "z": 2.0, "max_rel_noise": 0.5,
                               "params": ("credit_load_scale",)}
    base.update(kw)
    return AutotuneConfig(**base)  # type: ignore[arg-type]


def _window(t: WeightTuner, values: list[float], at: float) -> list:
    steps = []
    for v in values:
        steps += t.observe(at, v, 100, 0, 0, at)
    return steps


def test_window_stats() -> None:
    w = Window()
    for v, best, cached in ((1.0, 50, 10), (2.0, 0, 0), (3.0, 100, 100)):
        w.add(v, 100, cached, best)
    assert w.mean == 2.0
    assert w.se == pytest.approx((1.0 / 3) ** 0.5)
    assert w.recompute_rate == 40 / 300


def test_try_keep_and_try_again() -> None:
    t = WeightTuner(_cfg(), CostWeights())
    assert _window(t, [1.0, 1.1, 0.9, 1.0], 1.0)[0].action == "try"  # baseline measured: credit_load_scale x2
    assert t.weights.credit_load_scale == 8.0
    steps = _window(t, [0.5, 0.55, 0.45, 0.5], 2.0)  # clearly better
    assert [s.action for s in steps] == ["keep", "try"]
    assert (steps[0].old, steps[0].new) == (4.0, 8.0)
    assert t.weights.credit_load_scale == 16.0  # the same move again, from the kept point


def test_worse_reverts_and_tries_the_other_direction() -> None:
    t = WeightTuner(_cfg(), CostWeights())
    _window(t, [1.0, 1.1, 0.9, 1.0], 1.0)
    steps = _window(t, [2.0, 2.1, 1.9, 2.0], 2.0)
    assert [s.action for s in steps] == ["revert"] and "worse" in steps[0].reason
    assert t.weights.credit_load_scale == 4.0
    assert _window(t, [1.0, 1.1, 0.9, 1.0], 3.0)[0].action == "try"  # a fresh baseline first
    assert t.weights.credit_load_scale == 2.0


def test_gain_within_noise_reverts() -> None:
    t = WeightTuner(_cfg(), CostWeights())
    _window(t, [1.0, 1.2, 0.8, 1.0], 1.0)
    steps = _window(t, [0.9, 1.1, 0.7, 0.9], 2.0)  # 0.1 better, se of the difference ~0.12
    assert [s.action for s in steps] == ["revert"] and "within noise" in steps[0].reason
    assert t.weights.credit_load_scale == 4.0


def test_noisy_baseline_holds() -> None:
    t = WeightTuner(_cfg(max_rel_noise=0.1), CostWeights())
    steps = _window(t, [0.1, 2.0, 0.1, 2.0], 1.0)
    assert [s.action for s in steps] == ["hold"] and "too noisy" in steps[0].reason
    assert t.weights == CostWeights()


def test_samples_routed_under_other_weights_are_dropped() -> None:
    t = WeightTuner(_cfg(), CostWeights())
    _window(t, [1.0, 1.1, 0.9, 1.0], 5.0)  # switched at now = 5.0
    assert t.observe(4.0, 0.1, 100, 0, 0, 6.0) == []  # arrived at 4.0: not counted
    assert t.samples == 4


def test_bounds_clamp_and_skip() -> None:
    t = WeightTuner(_cfg(credit_load_scale_bounds=(1.0, 6.0)), CostWeights())
    _window(t, [1.0, 1.1, 0.9, 1.0], 1.0)
    assert t.weights.credit_load_scale == 6.0  # 4 x 2 clamped
    steps = _window(t, [0.5, 0.55, 0.45, 0.5], 2.0)
    # kept; up is at the bound now, so the next try goes down
    assert [s.action for s in steps] == ["keep", "try"]
    assert t.weights.credit_load_scale == 3.0


def test_every_weight_at_its_bounds_holds() -> None:
    cfg = _cfg(credit_load_scale_bounds=(4.0, 4.0))
    t = WeightTuner(cfg, CostWeights())
    steps = _window(t, [1.0, 1.1, 0.9, 1.0], 1.0)
    assert [s.action for s in steps] == ["hold"] and t.weights == CostWeights()


def test_feed_swaps_the_router_config() -> None:
    routing = RoutingConfig(autotune=_cfg())
    router = KvRouter(routing, KvIndex(120.0), random.Random(0), Policy.kv_aware)
    t = WeightTuner(routing.autotune, routing.weights)
    for _ in range(3):
        feed(t, router, 0.0, 1.0, 10, 0, 0, 1.0)
    assert router.cfg is routing
    feed(t, router, 0.0, 1.0, 10, 0, 0, 1.0)
    assert router.cfg.weights.credit_load_scale == 8.0 and router.cfg.weights is t.weights
    assert router.cfg.temperature == routing.temperature
    assert t.summary()["trying"] == "credit_load_scale"


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


def test_live_hook_feeds_exports_and_reports() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from thunderagent.control.autotune_hook import AutotuneHook

    routing = RoutingConfig(autotune=_cfg())
    router = KvRouter(routing, KvIndex(120.0), random.Random(0), Policy.kv_aware)
    reg = CollectorRegistry()
    hook = AutotuneHook(routing, router, reg)
    assert 'thunderagent_autotune_weight{name="credit_load_scale"} 4.0' in generate_latest(reg).decode()
    hook.finished(0.0, None, 10, 0, 0, 1.0)  # never produced a token: not a sample
    for _ in range(4):
        hook.finished(0.0, 0.5, 10, 0, 0, 1.0)
    assert router.cfg.weights.credit_load_scale == 8.0
    assert 'thunderagent_autotune_weight{name="credit_load_scale"} 8.0' in generate_latest(reg).decode()
    health = hook.health()["autotune"]
    assert health["weights"] == {"credit_load_scale": 8.0} and health["steps"][0]["action"] == "try"  # type: ignore[index]
    off = AutotuneHook(RoutingConfig(), router, CollectorRegistry())
    assert off.health() == {} and off.tuner is None
