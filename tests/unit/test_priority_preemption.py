"""Preemption only when it pays (``routing.preempt_enabled``): the pure decision with exact numbers,
then the simulated engine (which request is evicted, when, and that it completes), the simulator and
the serve factory honouring the switch."""

from __future__ import annotations

import dataclasses

import pytest

from support.engine_run import Run
from support.callbacks import Recorder
from thunderagent.config import Config, NodeConfig, Policy, RoutingConfig, parse_config
from thunderagent.engine.preemption import (
    PreemptKnobs,
    PriorityPreemption,
    RunningView,
    decide,
    knobs_from,
    natural_wait_s,
    pick_victims,
)
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.engine.timing import PolynomialTiming
from thunderagent.execution.factories import simulated_factory
from thunderagent.kv.hashing import BASE_SEED, block_hashes
from thunderagent.sim.driver import Simulator
from thunderagent.sim.generators import shared_prefix
from thunderagent.types import EngineRequest, FinishReason

BS = 16
TIMING = PolynomialTiming()


# ------------------------------------------------------------------------------ the pure decision
def rv(priority: int, remaining: int, computed: int, blocks: int) -> RunningView:
    return RunningView(priority, remaining, computed, blocks)


def linear_prefill(n: int) -> float:
    return n * 0.001  # 1 ms per token: round numbers


def verdict(priority: int, running: list[RunningView], deficit: int, need_slot: bool = False, **knobs: float):
    return decide(priority, running, deficit, need_slot, pass_s=0.01, prefill_s=linear_prefill, pool_blocks=64,
                  knobs=PreemptKnobs(**knobs))


def test_gain_and_cost_with_exact_numbers() -> None:
    running = [rv(1, 50, 100, 4), rv(0, 200, 1000, 10), rv(0, 100, 500, 6)]
    v = verdict(1, running, 5, tier_weight=2.0)
    assert v is not None
    assert v.victims == (2,)  # the last admitted of the lowest tier frees enough
    # without preemption: the request with 50 tokens left frees 4 blocks (short of 5), the one with
    # 100 left frees 6 more: 100 passes of 10 ms
    assert v.wait_s == pytest.approx(1.0)
    assert v.gain_s == pytest.approx(1.0 * 2.0 * 1)
    # recompute 500 tokens (0.5 s) + 0.5 s x 6/64 of the pool
    assert v.cost_s == pytest.approx(0.5 + 0.5 * 6 / 64)
    assert v.pays


def test_nearly_done_victim_does_not_pay() -> None:
    # the victim finishes in 3 passes (30 ms): recomputing its 500 tokens costs more
    v = verdict(1, [rv(0, 3, 500, 6)], 5)
    assert v is not None and v.victims == (0,)
    assert v.gain_s == pytest.approx(0.03) and v.cost_s == pytest.approx(0.5 + 0.5 * 6 / 64)
    assert not v.pays
    # the same victim with 60 passes left: 0.6 s saved > 0.547 s
    assert verdict(1, [rv(0, 60, 500, 6)], 5).pays


def test_equal_or_higher_priorities_are_never_victims() -> None:
    assert verdict(0, [rv(0, 1000, 10, 6)], 5) is None
    assert verdict(1, [rv(2, 1000, 10, 6), rv(1, 1000, 10, 6)], 5) is None
    assert pick_victims(1, [rv(0, 9, 9, 2), rv(1, 9, 9, 9)], 1) is None  # the tail is not lower: stop there


def test_victims_span_tiers_and_the_smallest_difference_counts() -> None:
    running = [rv(2, 100, 10, 3), rv(1, 100, 10, 3), rv(0, 100, 10, 3)]
    v = verdict(2, running, 5)
    assert v is not None and v.victims == (2, 1)
    assert v.gain_s == pytest.approx(100 * 0.01 * 1)  # 2 - 1: the priority-1 victim sets the gain
    assert v.cost_s == pytest.approx(2 * 0.010 + 0.5 * 6 / 64)
    assert pick_victims(2, running, 7) is None  # the two lower ones free 6 blocks only


def test_a_missing_slot_needs_one_victim_and_the_first_finisher() -> None:
    running = [rv(0, 300, 10, 2), rv(0, 40, 20, 2)]
    v = verdict(1, running, 0, need_slot=True, memory_cost_s=0.0)
    assert v is not None and v.victims == (1,)
    assert v.wait_s == pytest.approx(0.40)  # the first to finish frees a slot
    assert v.cost_s == pytest.approx(0.020)
    assert verdict(1, running, 0, need_slot=False) is None  # it fits: nothing to decide
    assert natural_wait_s(running, 3, 0.01) == pytest.approx(3.0)  # needs both to finish


def test_prefill_time_of_a_recompute_is_chunked_by_the_token_budget() -> None:
    pp = PriorityPreemption(PreemptKnobs(), TIMING, 1024, 100)
    assert pp.prefill_s(250) == pytest.approx((2 * TIMING.prefill_ms(100) + TIMING.prefill_ms(50)) / 1e3)
    assert pp.prefill_s(0) == 0.0


def test_knobs_follow_the_switch() -> None:
    assert knobs_from(RoutingConfig()) is None
    on = RoutingConfig(preempt_enabled=True, preempt_tier_weight=3.0, preempt_memory_cost_s=0.25)
    assert knobs_from(on) == PreemptKnobs(3.0, 0.25)


# ------------------------------------------------------------------------------ the simulated engine
def mk(rid: str, tokens: list[int], max_tokens: int, priority: int = 0) -> EngineRequest:
    return EngineRequest(rid, tokens, block_hashes(tokens, BS), BASE_SEED, max_tokens, True, priority)


def engine(preempt: bool = True, **node: int) -> SimulatedEngine:
    return SimulatedEngine("w0", NodeConfig(block_size=BS, **node), preempt=PreemptKnobs() if preempt else None)


LOW = list(range(64))
HIGH = list(range(100, 164))


def alone(node: dict[str, int], req: EngineRequest) -> Run:
    return Run(engine(False, **node)).run([(0.0, dataclasses.replace(req))])


@pytest.mark.parametrize("node, high", [
    ({"max_batch_size": 1, "kv_blocks": 256}, HIGH),  # no sequence slot for the newcomer
    # no KV blocks for it: L holds 48 of the 68 blocks after 700 tokens, H needs 25
    ({"max_batch_size": 8, "kv_blocks": 68}, (HIGH * 7)[:400]),
], ids=["slot", "blocks"])
def test_a_high_priority_request_evicts_a_long_low_priority_decode(node: dict[str, int], high: list[int]) -> None:
    ref = alone(node, mk("L", LOW, 1000))
    arrive = ref.of("L")[699].time + 1e-6  # L has 300 tokens to go
    eng = engine(**node)
    r = Run(eng).run([(0.0, mk("L", LOW, 1000)), (arrive, mk("H", high, 4, priority=1))])
    assert (eng.priority_preemptions, eng.preemptions) == (1, 0)
    # evicted at the first pass after H arrived: that pass is H's prefill alone (L's decode undone)
    evicting = r.passes.index(r.pass_ending_after(arrive)) + 1
    p = r.passes[evicting]
    assert (p.prefill_tokens, p.num_decodes) == (len(high), 0)
    assert r.of("H")[0].time == pytest.approx(p.start + TIMING.prefill_ms(len(high)) / 1e3, abs=1e-9)
    h_end = r.of("H")[-1].time
    assert len(r.tokens("H")) == 4 and r.of("H")[-1].finish_reason is FinishReason.LENGTH
    assert not [o for o in r.of("L") if p.start < o.time <= h_end]  # L waits while H runs
    # L recomputes and finishes its 1000 tokens, the very tokens it produces undisturbed
    assert r.tokens("L") == ref.tokens("L") and len(r.tokens("L")) == 1000
    assert r.of("L")[-1].finish_reason is FinishReason.LENGTH


def test_a_nearly_done_victim_is_left_to_finish() -> None:
    node = {"max_batch_size": 1, "kv_blocks": 256}
    ref = alone(node, mk("L", LOW, 160))
    # H arrives as L has 3 tokens left: 3 decode passes (~20 ms) save less than recomputing L
    arrive = ref.of("L")[156].time + 1e-6
    eng = engine(**node)
    r = Run(eng).run([(0.0, mk("L", LOW, 160)), (arrive, mk("H", HIGH, 4, priority=1))])
    assert (eng.priority_preemptions, eng.preemptions) == (0, 0)
    assert r.of("L")[-1].time == ref.of("L")[-1].time
    assert r.of("H")[0].time > r.of("L")[-1].time
    # 50 tokens left: it pays
    arrive = ref.of("L")[109].time + 1e-6
    eng = engine(**node)
    Run(eng).run([(0.0, mk("L", LOW, 160)), (arrive, mk("H", HIGH, 4, priority=1))])
    assert eng.priority_preemptions == 1


def test_equal_priorities_never_preempt_each_other() -> None:
    node = {"max_batch_size": 1, "kv_blocks": 256}
    for prio in (0, 3):
        eng = engine(**node)
        r = Run(eng).run([(0.0, mk("L", LOW, 1000, prio)), (1.0, mk("H", HIGH, 4, prio))])
        assert (eng.priority_preemptions, eng.preemptions) == (0, 0)
        assert r.of("H")[0].time > r.of("L")[-1].time


def test_switched_off_the_engine_waits() -> None:
    eng = engine(False, max_batch_size=1, kv_blocks=256)
    r = Run(eng).run([(0.0, mk("L", LOW, 1000)), (1.0, mk("H", HIGH, 4, priority=1))])
    assert eng.priority_preemptions == 0
    assert r.of("H")[0].time > r.of("L")[-1].time


# ------------------------------------------------------------------------------ simulator and serve
NODE = NodeConfig(kv_blocks=512, block_size=64, max_batch_size=16)


def _trace(priorities: bool) -> list:
    reqs = shared_prefix(20, 256, (128, 1024), 300, 40.0, (32, 256), seed=5)
    return [dataclasses.replace(r, priority=(i % 5 == 0) if priorities else 0) for i, r in enumerate(reqs)]


def test_simulator_without_priorities_does_not_move() -> None:
    trace = _trace(False)
    off = Simulator(NODE, RoutingConfig(seed=0), 2, Policy.kv_aware).run(trace, 1.0)
    on = Simulator(NODE, RoutingConfig(seed=0, preempt_enabled=True), 2, Policy.kv_aware).run(trace, 1.0)
    assert on.ttft_by_id == off.ttft_by_id and on.times_by_id == off.times_by_id
    assert on.result.extra.pop("priority_preemptions") == 0
    assert "priority_preemptions" not in off.result.extra
    on.result.extra.pop("duration_s"), off.result.extra.pop("duration_s")
    assert on.result.extra == off.result.extra


def test_simulator_counts_priority_preemptions_apart() -> None:
    trace = _trace(True)
    out = Simulator(NODE, RoutingConfig(seed=0, preempt_enabled=True), 2, Policy.kv_aware).run(trace, 1.0)
    assert out.result.requests == len(trace)
    assert out.result.extra["priority_preemptions"] > 0


async def test_serve_builds_engines_with_the_switch() -> None:
    for enabled in (False, True):
        cfg = parse_config({"routing": {"preempt_enabled": enabled}}, "x.yaml")
        worker = simulated_factory(cfg, None)(cfg.execution_group.nodes[0], "w0", 0, Recorder().callbacks())
        pp = worker.engine._pp  # type: ignore[attr-defined]
        assert (pp is not None) is enabled
        if enabled:
            assert pp.knobs == PreemptKnobs(1.0, 0.5)
    assert Config().routing.preempt_enabled is False
