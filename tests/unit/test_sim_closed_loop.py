"""Closed-loop replay: exact arrival times on hand-made traces, open loop untouched, the figures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from thunderagent.config import NodeConfig, Policy, RoutingConfig
from thunderagent.sim.arrivals import ClosedLoop, OpenLoop, session_stats
from thunderagent.sim.driver import Simulator
from thunderagent.sim.traces import TraceRequest, load_trace

DATA = Path(__file__).resolve().parents[1] / "data"
SMALL = NodeConfig(kv_blocks=64, block_size=64)  # 4,096 tokens of KV: room for a few requests at once
CLOSED_KEYS = {"sessions", "steps_per_min", "session_completion_s", "jain_fairness_steps", "unissued_requests"}


def req(rid: str, t: float, first_block: int, n_in: int, n_out: int, session: str | None = None,
        think: float | None = None) -> TraceRequest:
    blocks = -(-n_in // 64)
    return TraceRequest(rid, t, n_in, n_out, list(range(first_block, first_block + blocks)), 64, session, think)


def two_sessions() -> list[TraceRequest]:
    """2 sessions x 3 requests, think times recorded; trace times far off the closed-loop ones
    (the sessions' later requests are recorded earlier than their predecessors could finish)."""
    return [
        req("a0", 0.0, 0, 640, 40, "A"), req("a1", 0.1, 0, 1280, 30, "A", 2.0), req("a2", 0.2, 0, 1920, 20, "A", 0.5),
        req("b0", 0.05, 100, 1000, 50, "B"), req("b1", 0.15, 100, 1500, 10, "B", 1.25),
        req("b2", 0.25, 100, 2000, 60, "B", 0.0),
    ]


def simulate(trace: list[TraceRequest], closed: bool, speedup: float = 1.0, node: NodeConfig = SMALL):
    return Simulator(node, RoutingConfig(seed=0), 1, Policy.round_robin).run(trace, speedup, closed_loop=closed)


def test_each_request_arrives_think_after_its_predecessor_finished():
    trace = two_sessions()
    out = simulate(trace, closed=True)
    t = out.times_by_id
    assert t["a0"][0] == 0.0 and t["b0"][0] == 0.05  # first requests: their trace times
    for prev, nxt, think in [("a0", "a1", 2.0), ("a1", "a2", 0.5), ("b0", "b1", 1.25), ("b1", "b2", 0.0)]:
        assert t[prev][1] > t[prev][0]
        assert t[nxt][0] == t[prev][1] + think, nxt  # exact: same float operations
    assert all(f > a for a, f in t.values())
    r = out.result
    assert r.requests == 6 and r.extra["incomplete_requests"] == 0 and r.extra["unissued_requests"] == 0
    assert r.extra["sessions"] == 2


def test_speedup_divides_think_times_too():
    trace = two_sessions()
    t = simulate(trace, closed=True, speedup=4.0).times_by_id
    assert t["b0"][0] == 0.05 / 4.0
    assert t["a1"][0] == t["a0"][1] + 2.0 / 4.0 and t["b1"][0] == t["b0"][1] + 1.25 / 4.0


def test_open_loop_is_unchanged():
    trace = two_sessions()
    default = Simulator(SMALL, RoutingConfig(seed=0), 1, Policy.round_robin).run(trace, 2.0)
    explicit = simulate(trace, closed=False, speedup=2.0)
    assert {k: a for k, (a, _) in default.times_by_id.items()} == {r.request_id: r.arrival_s / 2.0 for r in trace}
    assert default.times_by_id == explicit.times_by_id and default.ttft_by_id == explicit.ttft_by_id
    a, b = default.result, explicit.result
    assert (a.ttft_ms, a.itl_ms, a.e2e_ms, a.prefix_reuse, a.extra) == (b.ttft_ms, b.itl_ms, b.e2e_ms,
                                                                           b.prefix_reuse, b.extra)
    assert not CLOSED_KEYS & set(a.extra)
    # the trace's later requests are recorded before their predecessors finish: closed loop differs
    assert simulate(trace, closed=True).times_by_id["a1"][0] > default.times_by_id["a1"][0]


def test_without_think_time_the_trace_gap_counts_from_the_predecessors_arrival_never_before_it_finished():
    trace = [
        req("x0", 0.0, 0, 640, 20, "X"),
        req("x1", 30.0, 0, 1280, 20, "X"),  # gap 30 s >> response time: issued at x0's arrival + 30
        req("x2", 30.001, 0, 1920, 20, "X"),  # gap 1 ms << response time: issued when x1 finished
        req("y0", 5.0, 100, 512, 20, "Y"),
        req("y1", 5.5, 100, 1024, 20, "Y", 3.0),  # mixed: a recorded think time wins
    ]
    out = simulate(trace, closed=True, speedup=2.0)
    t = out.times_by_id
    assert t["x0"][0] == 0.0 and t["x1"][0] == 0.0 + 30.0 / 2.0
    assert t["x0"][1] < t["x1"][0]
    assert t["x2"][0] == t["x1"][1]  # max(finish, 15 + 0.0005) = finish
    assert t["y0"][0] == 2.5 and t["y1"][0] == t["y0"][1] + 3.0 / 2.0


def test_a_request_without_session_stays_open_loop():
    trace = [*two_sessions(), req("solo", 0.3, 300, 700, 15), req("solo2", 4.0, 400, 700, 15, None, 9.0)]
    t = simulate(trace, closed=True).times_by_id
    assert t["solo"][0] == 0.3 and t["solo2"][0] == 4.0  # think_s ignored without a session
    # a trace without sessions replays exactly as in open loop
    plain = [req(f"p{k}", 0.01 * k, 10 * k, 600 + 50 * k, 20) for k in range(8)]
    a, b = simulate(plain, closed=False), simulate(plain, closed=True)
    assert a.times_by_id == b.times_by_id and a.ttft_by_id == b.ttft_by_id
    assert b.result.extra["sessions"] == 0 and b.result.extra["steps_per_min"] == 0.0


def test_a_rejected_request_still_releases_its_successor():
    node = NodeConfig(kv_blocks=16, block_size=64)  # 1,024 tokens: a 2,048-token prompt can never fit
    trace = [req("r0", 0.0, 0, 2048, 10, "R"), req("r1", 0.5, 100, 512, 10, "R", 1.0),
             req("r2", 0.6, 200, 512, 10, "R", 0.25)]
    out = simulate(trace, closed=True, node=node)
    t = out.times_by_id
    assert "r0" not in out.ttft_by_id and t["r0"][1] >= 0.0  # finished without a token
    assert t["r1"][0] == t["r0"][1] + 1.0 and t["r2"][0] == t["r1"][1] + 0.25
    assert out.result.requests == 3 and out.result.extra["unissued_requests"] == 0


def test_a_successor_issued_at_its_predecessors_finish_joins_the_pass_starting_then():
    """Zero think time while the engine is busy with another request: the successor arrives at the
    pass boundary and joins that pass, exactly as an open-loop arrival at that instant would."""
    trace = [req("long", 0.0, 500, 600, 400), req("s0", 0.0, 0, 640, 3, "S"), req("s1", 0.001, 100, 640, 5, "S", 0.0)]
    closed = simulate(trace, closed=True)
    finish = closed.times_by_id["s0"][1]
    assert closed.times_by_id["s1"][0] == finish
    replay = [trace[0], trace[1], req("s1", finish, 100, 640, 5, "S", 0.0)]
    opened = simulate(replay, closed=False)
    assert opened.times_by_id == closed.times_by_id and opened.ttft_by_id == closed.ttft_by_id


def test_agentic_excerpt_in_closed_loop_loses_nothing():
    trace = load_trace(DATA / "kv-cache-tester")
    out = Simulator(NodeConfig(kv_blocks=16384, block_size=64), RoutingConfig(seed=0), 2, Policy.kv_aware).run(
        trace, 1.0, closed_loop=True)
    x = out.result.extra
    assert out.result.requests == len(trace) and x["incomplete_requests"] == 0 and x["unissued_requests"] == 0
    assert x["sessions"] == len({r.session for r in trace}) and x["session_completion_s"]["n"] == x["sessions"]
    assert 0 < x["jain_fairness_steps"] <= 1 and x["steps_per_min"] > 0


def test_arrival_sources_tie_break_by_trace_order():
    trace = [req("b", 1.0, 0, 64, 1), req("a", 1.0, 1, 64, 1, "S"), req("c", 0.5, 2, 64, 1, "T")]
    for src in (OpenLoop(trace, 1.0), ClosedLoop(trace, 1.0)):
        got = []
        while src.t != math.inf:
            got.append((src.t, src.pop().request_id))
        assert got == [(0.5, "c"), (1.0, "b"), (1.0, "a")]
        assert src.unissued == 0


def test_session_stats_exact():
    trace = [req("a0", 0, 0, 64, 1, "A"), req("a1", 0, 0, 64, 1, "A"), req("b0", 0, 0, 64, 1, "B"),
             req("c0", 0, 0, 64, 1, "C"), req("c1", 0, 0, 64, 1, "C"), req("n", 0, 0, 64, 1)]
    times = {"a0": (0.0, 30.0), "a1": (40.0, 60.0),  # A: 2 steps in 1 min -> 2/min, done in 60 s
             "b0": (10.0, 40.0),  # B: 1 step in 0.5 min -> 2/min, done in 30 s
             "c0": (0.0, 120.0), "c1": (130.0, -1.0),  # C: 1 step in 2 min, never completes
             "n": (0.0, 1.0)}  # no session: not counted
    s = session_stats(trace, times, duration_s=120.0)
    assert s["sessions"] == 3
    assert s["steps_per_min"] == pytest.approx(4 / 2.0)
    assert s["session_completion_s"] == {"n": 2, "mean": 45.0, "p50": 60.0, "p99": 60.0}
    rates = [2.0, 2.0, 0.5]
    assert s["jain_fairness_steps"] == pytest.approx(sum(rates) ** 2 / (3 * sum(x * x for x in rates)))
    empty = session_stats([], {}, 0.0)
    assert empty["sessions"] == 0 and math.isnan(empty["jain_fairness_steps"])
