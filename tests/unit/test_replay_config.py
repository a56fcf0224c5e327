"""Replays run without the double-hash guard unless the routing config sets it (sim/replay_config.py),
and the guard changes nothing in a replay but its cost: the same decisions and latencies either way."""

from __future__ import annotations

from thunderagent.config import Config, NodeConfig, Policy, parse_config
from thunderagent.sim.driver import Simulator
from thunderagent.sim.generators import multi_turn_chat
from thunderagent.sim.replay_config import replay_routing


def test_the_guard_is_off_in_replays_unless_the_config_sets_it() -> None:
    default = Config().routing
    assert default.double_hash  # serving keeps it on
    assert replay_routing(default).double_hash is False
    for value in (True, False):  # set in the file: followed either way
        routing = parse_config({"routing": {"double_hash": value}}, "test").routing
        assert replay_routing(routing).double_hash is value
    node = NodeConfig(block_size=16, kv_blocks=256)
    assert Simulator(node, default, 2, Policy.kv_aware).index.checks is None
    on = parse_config({"routing": {"double_hash": True}}, "test").routing
    assert Simulator(node, on, 2, Policy.kv_aware).index.checks is not None


def test_a_replay_decides_the_same_with_and_without_the_guard() -> None:
    reqs = multi_turn_chat(12, 4, seed=3, block_size=16)
    node = NodeConfig(block_size=16, kv_blocks=128)  # small: evictions and misses happen
    runs = []
    for value in (True, False):
        routing = parse_config({"routing": {"double_hash": value, "seed": 1}}, "test").routing
        sim = Simulator(node, routing, 3, Policy.kv_aware, seed=1)
        assert (sim.index.checks is not None) is value
        out = sim.run(reqs, 1.0)
        runs.append((out.ttft_by_id, out.times_by_id, out.result.prefix_reuse))
    assert runs[0] == runs[1]
    assert 0 < runs[0][2] < 1  # some reuse, some misses: the comparison covers both
