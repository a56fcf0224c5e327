"""Cache migration in the simulator: copies fire under injected skew (and pay), not without it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from thunderagent.config import DisaggConfig, KvTransferConfig, MigrationConfig, NodeConfig, Policy, RoutingConfig
from thunderagent.sim.driver import PdSetup, Simulator
from thunderagent.sim.results import Dist
from thunderagent.sim.traces import TraceRequest

BS = 64
NODE = NodeConfig()
ON = RoutingConfig(migration=MigrationConfig(enabled=True, link=KvTransferConfig(enabled=True, bandwidth_gbps=200.0)))


def workload(pileup: bool, rate: float, prefix_tokens: int = 16384, burst_s: float = 8.0) -> list[TraceRequest]:
    """4 prefixes sharing a 4 K root (``pileup``: each requested once first, 0.5 s apart, so they land on
    one worker), then a Poisson burst over them."""
    rng = random.Random(0)
    n = 0

    def new(tokens: int) -> list[int]:
        nonlocal n
        n += tokens // BS
        return list(range(n - tokens // BS, n))

    root = new(4096)
    prefixes = [root + new(prefix_tokens - 4096) for _ in range(4)]
    out: list[TraceRequest] = []
    t = 0.0

    def add(tag: str, p: list[int]) -> None:
        suffix = rng.randint(256, 1024)
        out.append(TraceRequest(f"{tag}:{len(out)}", t, len(p) * BS + suffix, rng.randint(32, 256),
                                p + new(-(-suffix // BS) * BS), BS))

    if pileup:
        for p in prefixes:
            add("warm", p)
            t += 0.5
    t += 2.0
    end = t + burst_s
    while t < end:
        add("burst", prefixes[rng.randrange(4)])
        t += rng.expovariate(rate)
    return out


def run(reqs: list[TraceRequest], routing: RoutingConfig, workers: int = 4) -> tuple[Simulator, Dist, dict]:
    sim = Simulator(NODE, routing, workers, Policy.kv_aware, seed=0)
    out = sim.run(reqs, 1.0)
    assert out.result.requests == len(reqs) and out.result.extra["incomplete_requests"] == 0
    burst = Dist.of([v for k, v in out.ttft_by_id.items() if k.startswith("burst:")])
    return sim, burst, out.result.extra


def test_migration_fires_under_a_pileup_and_cuts_the_ttft_tail():
    reqs = workload(True, 8.0, prefix_tokens=32768, burst_s=12.0)
    _, off, extra_off = run(reqs, RoutingConfig())
    assert "migration" not in extra_off
    sim, on, extra = run(reqs, ON)
    m = extra["migration"]
    assert m["landed"] >= 3 and m["completed"] == m["planned"] == m["landed"] and m["failed"] == 0
    assert m["bytes_moved"] == m["blocks_moved"] * BS * 131072
    # every copy ended: nothing pinned on a source, nothing on the plane
    assert sim.mig is not None and not sim.mig.heap and not sim.mig.plane.inflight
    assert all(e.pinned_transfers == 0 for e in sim.engines)
    # a target may have computed part of a prefix itself while its copy moved: it imports the rest
    assert 0 < sum(e.kv_imported_blocks for e in sim.engines) <= m["blocks_moved"]
    assert off.p99 > 2 * on.p99


def test_no_copies_without_skew():
    _, _, extra = run(workload(False, 2.0), ON)
    assert extra["migration"]["planned"] == 0


def test_the_link_must_be_configured_without_a_prefill_group_and_shared_with_one():
    with pytest.raises(ValueError, match="routing.migration.link.enabled"):
        Simulator(NODE, RoutingConfig(migration=MigrationConfig(enabled=True)), 2, Policy.kv_aware)
    pd = PdSetup(1, 2, DisaggConfig(), KvTransferConfig(enabled=True))
    with pytest.raises(ValueError, match="routing.migration.link.enabled"):
        Simulator(NODE, ON, 3, Policy.kv_aware, pd=pd)
    shared = Simulator(NODE, RoutingConfig(migration=MigrationConfig(enabled=True)), 3, Policy.kv_aware, pd=pd)
    assert shared.mig is not None and shared.pd is not None and shared.mig.plane is shared.pd.plane


def test_other_policies_refuse_it():
    with pytest.raises(ValueError, match="kv_aware only"):
        Simulator(NODE, ON, 2, Policy.round_robin)


def test_with_disaggregation_copies_share_the_prefill_decode_plane():
    pd = PdSetup(1, 4, DisaggConfig(mode="always"), KvTransferConfig(enabled=True, bandwidth_gbps=200.0))
    routing = RoutingConfig(migration=MigrationConfig(enabled=True))
    sim = Simulator(NODE, routing, 5, Policy.kv_aware, seed=0, pd=pd)
    reqs = workload(True, 6.0, prefix_tokens=32768, burst_s=8.0)
    out = sim.run(reqs, 1.0)
    assert out.result.requests == len(reqs) and out.result.extra["incomplete_requests"] == 0
    m = out.result.extra["migration"]
    assert sim.mig is not None and sim.pd is not None
    assert m["landed"] >= 1 and sim.mig.plane.stats.started == sim.pd.remote + m["planned"] - m["source_lost"]
    assert not sim.mig.plane.inflight and not sim.mig.plane.queue
    assert all(e.pinned_transfers == 0 for e in sim.engines)


def _parts(source_has_it: bool):
    from thunderagent.engine.simulated import SimulatedEngine
    from thunderagent.engine.timing import PolynomialTiming
    from thunderagent.kv.index import KvIndex
    from thunderagent.sim.migrate import MigrationSim
    from thunderagent.transfer.migration import Migrator
    from thunderagent.transfer.plane import TransferPlane
    from thunderagent.types import WorkerState

    engines = [SimulatedEngine(f"w{i}", NODE) for i in range(2)]
    for e in engines:
        e.pin_transfers = True
    prefix = list(range(1, 65))  # 4 K tokens
    index = KvIndex(prediction_ttl=120.0)
    for e in engines:
        index.add_worker(e.worker_id)
    index.resync("w0", prefix, 0)
    if source_has_it:
        assert engines[0].import_blocks(prefix)
        engines[0].drain_events()
    mig = Migrator(ON, TransferPlane(ON.migration.link), PolynomialTiming(), BS)
    for _ in range(2):
        mig.observe(prefix + [999], len(prefix), 0.0)
    imported: list[int] = []
    ms = MigrationSim(mig, engines, {"w0": 0, "w1": 1}, index, None, lambda j, now: imported.append(j))
    hot = engines[0].load(0.0)
    states = [WorkerState("w0", BS, NODE.max_num_batched_tokens, NODE.queue_depth_threshold,
                          replace(hot, waiting=NODE.queue_depth_threshold)),  # injected: busy
              WorkerState("w1", BS, NODE.max_num_batched_tokens, NODE.queue_depth_threshold, engines[1].load(0.0))]
    return engines, index, prefix, mig, ms, states, imported


def test_a_copy_pins_the_source_moves_on_the_clock_and_lands_in_the_target_cache():
    engines, index, prefix, mig, ms, states, imported = _parts(True)
    assert ms.step(0.0, states, look=True) == [] and ms.next_time() == float("inf")  # not sustained yet
    assert ms.step(0.3, states, look=True) == []
    assert engines[0].pinned_transfers == 1 and mig.inflight == 1
    nbytes = 64 * BS * 131072
    end = 0.3 + nbytes / (200e9 / 8) + 0.001  # bytes / bandwidth + latency
    assert ms.next_time() == pytest.approx(end)
    assert ms.step(end, states, look=False) == [1] and imported == [1]
    assert engines[0].pinned_transfers == 0 and engines[1].kv_imported_blocks == 64
    assert index.find_matches(prefix, end) == {"w0": 64, "w1": 64}
    assert ms.stats()["landed"] == 1 and mig.plane.stats.completed == 1 and not mig.plane.inflight


def test_a_source_that_lost_the_prefix_fails_the_copy():
    engines, _, _, mig, ms, states, imported = _parts(False)
    ms.step(0.0, states, look=True)
    ms.step(0.3, states, look=True)
    assert ms.source_lost == 1 and mig.failed == 1 and mig.inflight == 0 and imported == []
    assert engines[0].pinned_transfers == 0 and not mig.plane.inflight and ms.next_time() == float("inf")
