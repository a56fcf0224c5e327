"""The simulator with prefill/decode disaggregation: the Mooncake excerpt on 1 prefill + 3 decode
workers in each mode, injected failures (every request completes, fallbacks counted by cause), and the
in-flight cap under a burst."""

from __future__ import annotations

from pathlib import Path

import pytest

from thunderagent.config import DisaggConfig, KvTransferConfig, NodeConfig, Policy, RoutingConfig
from thunderagent.sim.driver import PdSetup, Simulator
from thunderagent.sim.pd import PdFaults
from thunderagent.sim.traces import TraceRequest, load_trace

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake_excerpt.jsonl"
NODE = NodeConfig(kv_blocks=16384, block_size=64)
FAST = KvTransferConfig(enabled=True, bandwidth_gbps=400.0)


def run(mode: str, faults: PdFaults = PdFaults(), transfer: KvTransferConfig = FAST, reqs=None, p: int = 1,
        d: int = 3, **disagg: object):
    reqs = reqs if reqs is not None else load_trace(EXCERPT)
    sim = Simulator(NODE, RoutingConfig(seed=0), 4, Policy.kv_aware, seed=0,
                    pd=PdSetup(p, d, DisaggConfig(mode=mode, **disagg), transfer, faults))
    out = sim.run(reqs, 4.0)
    assert sim.pd is not None
    return out.result, sim.pd


@pytest.mark.parametrize("mode", ["always", "conditional", "never"])
def test_every_mode_completes_the_excerpt(mode):
    r, pd = run(mode)
    assert r.requests == 200 and r.extra["incomplete_requests"] == 0
    stats = r.extra["pd"]
    assert stats["remote_prefills"] == pd.remote == stats["plane"]["completed"]
    assert not pd.jobs and not pd.heap and not pd.plane.inflight and not pd.plane.queue
    assert all(e.pinned_transfers == 0 for e in pd.engines)  # every prefill side released its blocks
    if mode == "never":
        assert pd.remote == 0 and stats["decisions"] == {"never": 200}
    else:
        assert pd.remote > 0 and stats["kv_imported_blocks"] > 0
    if mode == "always":  # 16 prompts over 16 GiB are not moved, the rest are
        assert stats["decisions"]["remote"] == pd.remote and pd.remote > 150
    assert r.itl_ms.p99 > 0
    # moved KV is not a cache hit: reuse stays within what the prompts can share
    assert r.prefix_reuse < 0.2


def test_decode_workers_only_decode_in_always_mode():
    r, pd = run("always")
    prefill_engine = pd.engines[0]
    assert prefill_engine.prefill_tokens > 0
    # the decode engines computed only the tokens past each moved prompt's last full block, and the
    # prompts too large to move
    assert sum(e.prefill_tokens for e in pd.engines[1:]) < prefill_engine.prefill_tokens / 3


def test_slow_link_times_out_and_falls_back():
    r, pd = run("always", PdFaults(slow_link=50.0))
    fails = pd.plane.stats.failures
    assert r.requests == 200 and r.extra["incomplete_requests"] == 0
    assert fails == {"timeout": pd.plane.stats.started} and pd.plane.stats.fallbacks == fails
    assert pd.remote == 0


def test_interrupted_transfers_fall_back():
    r, pd = run("always", PdFaults(interrupt_p=0.5, seed=3))
    st = pd.plane.stats
    assert r.requests == 200 and r.extra["incomplete_requests"] == 0
    assert st.failures["interrupted"] == st.fallbacks["interrupted"] > 50
    assert st.completed == pd.remote == st.started - st.failures["interrupted"]


def test_full_target_falls_back():
    r, pd = run("always", PdFaults(target_full_p=1.0))
    st = pd.plane.stats
    assert r.requests == 200 and r.extra["incomplete_requests"] == 0
    assert st.started == 0 and st.fallbacks == {"target_full": r.extra["pd"]["decisions"]["remote"]}


@pytest.mark.parametrize(("cap_bytes", "binding"), [(5 << 30, 2), (7 << 30, 3)])
def test_burst_of_64_long_prompts_never_exceeds_the_in_flight_cap(cap_bytes, binding):
    """64 prompts of 16,384 tokens (2 GiB of KV each) at once: at most 3 transfers and ``cap_bytes`` move
    at any step (the plane asserts it at every start; the trace records every change)."""
    burst = [TraceRequest(f"b{k}", 0.0, 16384, 4, list(range(1000 * k, 1000 * k + 32)), 512) for k in range(64)]
    cap = KvTransferConfig(enabled=True, bandwidth_gbps=25.0, max_inflight=3, max_inflight_bytes=cap_bytes)
    r, pd = run("always", transfer=cap, reqs=burst, p=4, d=4)
    assert r.requests == 64 and r.extra["incomplete_requests"] == 0 and pd.remote == 64
    assert max(pd.inflight_trace) == binding  # the byte cap binds first at 5 GiB, the count cap at 7 GiB
    assert pd.plane.stats.peak_inflight == binding and pd.plane.stats.peak_inflight_bytes == binding * (2 << 30)
    assert pd.plane.stats.waited > 0


def test_the_prefill_group_keeps_its_own_batch_limits():
    pnode = NodeConfig(kv_blocks=16384, block_size=64, max_batch_size=32, queue_depth_threshold=8)
    sim = Simulator(NODE, RoutingConfig(seed=0), 4, Policy.kv_aware, seed=0,
                    pd=PdSetup(1, 3, DisaggConfig(mode="always"), FAST, prefill_node=pnode))
    assert [e.node.max_batch_size for e in sim.engines] == [32, 256, 256, 256]
    assert [(s.role, s.queue_depth_threshold) for s in sim._states] == [("prefill", 8)] + [("decode", 64)] * 3


def run_strict(faults: PdFaults, p: int = 1, d: int = 3, reqs=None):
    reqs = reqs if reqs is not None else load_trace(EXCERPT)
    routing = RoutingConfig.model_validate({"seed": 0, "fallback_to_local": False,
                                            "disaggregation": {"mode": "always"}})
    sim = Simulator(NODE, routing, 4, Policy.kv_aware, seed=0,
                    pd=PdSetup(p, d, DisaggConfig(mode="always"), FAST, faults))
    out = sim.run(reqs, 4.0)
    assert sim.pd is not None
    return out, sim


def test_strict_never_prefills_on_a_decode_worker():
    """routing.fallback_to_local false: a failed transfer is routed again without the decode worker at fault
    (never prefilled there), at most once per decode worker; a request every decode worker failed is refused
    (it ends without a token, as a live 503 / UNAVAILABLE), and nothing is lost."""
    out, sim = run_strict(PdFaults(interrupt_p=0.5, seed=3))
    r, pd = out.result, sim.pd
    st = pd.plane.stats
    assert r.requests == 200 and r.extra["incomplete_requests"] == 0
    assert st.fallbacks == {} and st.failures["interrupted"] == pd.rerouted["interrupted"] > 100
    refused = r.extra["refused_requests"]
    assert refused == r.extra["rejected_requests"] == 200 - pd.remote > 0  # the rest decoded a moved KV
    assert len(out.ttft_by_id) == pd.remote
    # each refused request was tried on all 3 decode workers; a request is never tried twice on one
    assert pd.rerouted["interrupted"] >= 3 * refused
    assert all(len(t) == len(set(t)) <= 3 for t in sim._tried.values())
    assert sum(len(t) == 3 for t in sim._tried.values()) == refused
    # the decode engines computed only each prompt's last partial block: no prompt was prefilled there
    assert sum(e.prefill_tokens for e in pd.engines[1:]) < 200 * NODE.block_size
    assert not pd.jobs and all(e.pinned_transfers == 0 for e in pd.engines)


def test_strict_with_a_dead_link_refuses_everything_and_loses_nothing():
    out, sim = run_strict(PdFaults(slow_link=50.0))
    r, pd = out.result, sim.pd
    assert r.requests == 200 and r.extra["refused_requests"] == 200 and pd.remote == 0
    assert pd.rerouted == {"timeout": 600} and pd.plane.stats.fallbacks == {}  # 3 decode workers each


def test_strict_needs_prefill_and_decode_workers_in_mode_always():
    routing = RoutingConfig.model_validate({"fallback_to_local": False, "disaggregation": {"mode": "always"}})
    with pytest.raises(ValueError, match="strict disaggregation"):
        Simulator(NODE, routing, 4, Policy.kv_aware)
    with pytest.raises(ValueError, match="mode always"):
        Simulator(NODE, routing, 4, Policy.kv_aware, pd=PdSetup(1, 3, DisaggConfig(mode="conditional"), FAST))


def test_strict_refuses_an_arrival_the_decode_workers_have_no_room_for():
    """Decode workers of 1,200 blocks (a target watermark of 0.7): strict dispatches that would overfill the
    target raise, and the arrival is refused (ends at once without a token, as a live 503) where the default
    prefills it locally; every request still ends."""
    routing = RoutingConfig.model_validate({"seed": 0, "fallback_to_local": False,
                                            "disaggregation": {"mode": "always"}})
    small = NodeConfig(kv_blocks=1200, block_size=64)
    sim = Simulator(small, routing, 4, Policy.kv_aware, seed=0, pd=PdSetup(1, 3, DisaggConfig(mode="always"), FAST))
    r = sim.run(load_trace(EXCERPT), 4.0).result
    pd = sim.pd
    assert pd is not None
    decisions = r.extra["pd"]["decisions"]
    assert decisions["refused_target_full"] > 50 and r.extra["incomplete_requests"] == 0
    # refused at arrival, or after every decode worker refused its transfer
    tried_all = sum(len(t) == 3 for t in sim._tried.values())
    assert r.extra["refused_requests"] == decisions["refused_target_full"] + tried_all
    assert pd.remote + r.extra["refused_requests"] == 200 and pd.plane.stats.fallbacks == {}


def test_strict_with_the_scheduler_held_requests_that_cannot_go_are_refused_and_nothing_is_lost():
    """The holding queue on, strict, decode workers of 1,200 blocks: requests wait for the prefill tier; one
    whose KV never fits its decode worker (even empty) is refused when it comes up, one that waits for room
    is refused once it has waited max_wait_s, and every request ends: served from a moved KV, or refused.
    (Before, the first that never fit stayed first in line for good: 102 of 200 never ended.)"""
    from thunderagent.config import SchedulerConfig

    routing = RoutingConfig.model_validate({"seed": 0, "fallback_to_local": False,
                                            "disaggregation": {"mode": "always"}})
    small = NodeConfig(kv_blocks=1200, block_size=64)
    sim = Simulator(small, routing, 4, Policy.kv_aware, seed=0, scheduler=SchedulerConfig(enabled=True),
                    pd=PdSetup(1, 3, DisaggConfig(mode="always"), FAST))
    out = sim.run(load_trace(EXCERPT), 4.0)
    r, pd = out.result, sim.pd
    assert pd is not None
    assert r.extra["incomplete_requests"] == 0 and r.extra.get("held_at_end", 0) == 0
    refused = r.extra["refused_requests"]
    assert pd.remote + refused == 200 and len(out.ttft_by_id) == pd.remote and refused > 0
    assert r.extra["queue_wait_ms"]["max"] >= 30_000 * 0.99  # someone waited out max_wait_s
    assert sum(e.prefill_tokens for e in pd.engines[1:]) < 200 * small.block_size  # no prompt prefilled there
    assert pd.plane.stats.fallbacks == {}


def test_always_a_flood_of_high_priority_requests_is_held_and_every_count_is_released():
    """Every request at priority 1, faster than the one prefill worker prefills: the scheduler holds them behind
    the high-priority work it sent there (before, a flood above the default priority was never held), every
    request completes, and the gate's count of what it sent is back to zero at the end (no leak)."""
    import random

    from thunderagent.config import SchedulerConfig

    rng = random.Random(0)
    reqs, t = [], 0.0
    for k in range(150):
        t += rng.expovariate(16.0)
        n = rng.randint(1024, 6144)
        reqs.append(TraceRequest(f"r{k}", t, n, 50, [rng.getrandbits(30) for _ in range(n // 512)], 512, priority=1))
    sim = Simulator(NODE, RoutingConfig(seed=0), 4, Policy.kv_aware, seed=0, scheduler=SchedulerConfig(enabled=True),
                    pd=PdSetup(1, 3, DisaggConfig(mode="always"), FAST))
    out = sim.run(reqs, 1.0)
    r = out.result
    assert r.requests == 150 and r.extra["incomplete_requests"] == 0 and len(out.ttft_by_id) == 150
    assert r.extra["queue_wait_ms"]["mean"] > 100  # held here, not in the prefill engine's queue
    gate = sim.dispatcher.prefill_gate
    assert gate is not None and gate.pending() == 0
