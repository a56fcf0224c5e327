"""The simulator drives grouping through the one dispatcher: a burst of siblings prefills the prefix
once per worker used, and every request finishes."""

from __future__ import annotations

import random

import pytest

from thunderagent.config import GroupingConfig, NodeConfig, Policy, RoutingConfig, SchedulerConfig
from thunderagent.sim.driver import Simulator
from thunderagent.sim.traces import TraceRequest

BS = 64
PREFIX, SUFFIX, N = 4096, 256, 32


def burst(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    shared = list(range(PREFIX // BS))
    per = SUFFIX // BS
    reqs = [TraceRequest(f"r{i}", rng.uniform(0.0, 0.05), PREFIX + SUFFIX, 8, shared + list(range(1000 + i * per,
                         1000 + (i + 1) * per)), BS) for i in range(N)]
    return sorted(reqs, key=lambda r: r.arrival_s)


def simulate(seed: int, on: bool, **grouping: float) -> tuple[Simulator, dict[str, object], list[int]]:
    cfg = SchedulerConfig(enabled=False, grouping=GroupingConfig(enabled=on, coalesce=on, **grouping))
    sim = Simulator(NodeConfig(), RoutingConfig(seed=seed), 4, Policy.kv_aware, seed=seed, scheduler=cfg)
    out = sim.run(burst(seed))
    assert out.result.requests == N and out.result.extra["incomplete_requests"] == 0
    return sim, out.result.extra, out.requests_per_worker


@pytest.mark.parametrize("seed", [1, 2])
def test_burst_prefills_the_prefix_once_per_worker_used(seed: int) -> None:
    sim, extra, per_worker = simulate(seed, True)
    used = sum(1 for c in per_worker if c)
    assert per_worker == [8, 8, 8, 8]  # an idle worker starts its own copy; followers balance across groups
    assert extra["computed_prefill_tokens"] == PREFIX * used + N * SUFFIX  # exactly once per worker
    assert extra["grouping"] == {"followers": 28, "coalesced": 0, "windows": 0, "stored": 0, "leader": 28,
                                 "timeout": 0, "leaders": 4}  # distinct suffixes: none coalesced
    assert sim.dispatcher.held() == 0


def test_burst_ttft_better_than_without_grouping() -> None:
    import statistics

    def p50(on: bool) -> float:
        sim = Simulator(NodeConfig(), RoutingConfig(seed=1), 4, Policy.kv_aware, seed=1,
                        scheduler=SchedulerConfig(enabled=False, grouping=GroupingConfig(enabled=on, coalesce=on)))
        return statistics.median(sim.run(burst(1)).ttft_ms)

    assert p50(False) / p50(True) > 1.25


def test_followers_are_released_by_the_bound_when_the_leader_is_slow() -> None:
    # a bound shorter than the leader's prefill (~90 ms): followers go on their own, nothing is lost
    sim, extra, _ = simulate(1, True, follower_max_wait_ms=20.0)
    grouping = extra["grouping"]
    assert isinstance(grouping, dict) and grouping["timeout"] > 0
    assert sim.dispatcher.held() == 0
