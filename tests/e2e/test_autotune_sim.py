"""The simulator with routing.autotune on: the tuner sees every finished request, steps, and the router
routes with the weights it holds."""

from __future__ import annotations

from thunderagent.config import Config, Policy
from thunderagent.config.autotune import AutotuneConfig
from thunderagent.sim.driver import Simulator
from thunderagent.sim.generators import shared_prefix


def test_sim_with_autotune() -> None:
    reqs = shared_prefix(2, 1024, (64, 256), 400, 40.0, 16, seed=3)
    cfg = Config()
    tune = AutotuneConfig(enabled=True, window=20, min_samples=10, z=0.0, max_rel_noise=10.0)
    routing = cfg.routing.model_validate({**cfg.routing.model_dump(), "autotune": tune.model_dump()})
    sim = Simulator(cfg.execution_group.nodes[0], routing, 4, Policy.kv_aware, seed=0)
    out = sim.run(reqs, 1.0)
    tuner = sim.tuner
    assert tuner is not None
    assert out.result.requests == 400
    assert tuner.samples > 0 and tuner.samples <= 400
    acts = [s.action for s in tuner.steps]
    assert "try" in acts and ("keep" in acts or "revert" in acts)
    assert sim.dispatcher.router.cfg.weights is tuner.weights  # the router routes with the tuner's weights
    lo, hi = tune.credit_load_scale_bounds
    assert lo <= tuner.weights.credit_load_scale <= hi
    lo, hi = tune.contention_bounds
    assert lo <= tuner.weights.contention <= hi


def test_sim_without_autotune_has_no_tuner() -> None:
    cfg = Config()
    sim = Simulator(cfg.execution_group.nodes[0], cfg.routing, 2, Policy.kv_aware)
    assert sim.tuner is None
