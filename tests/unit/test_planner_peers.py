"""The planner's counters shared by the frontends of a bus (control/planner_peers.py): exact sums, and sums
that never go down (the planner takes differences of them)."""

from __future__ import annotations

from thunderagent.bus.wire import PlannerCounters, WorkerCounters, decode_planner_counters, encode
from thunderagent.control.planner_peers import HEADROOM, SharedCounters, add, messages


def wc(wid: str, routed: int, hits: int = 0, count: int = 0, total: float = 0.0,
       buckets: list[tuple[float, int]] | None = None) -> WorkerCounters:
    return WorkerCounters(wid, routed, hits, count, total, buckets or [])


def test_the_others_counters_are_added_to_ours_worker_by_worker():
    sc = SharedCounters("me")
    sc.absorb("b", [wc("w0", 10, 4, 9, 1.5), wc("w1", 3, 1, 3, 0.25)], now=1.0)
    sc.absorb("c", [wc("w0", 5, 5, 5, 0.5)], now=1.0)
    sc.absorb("me", [wc("w0", 1000)], now=1.0)  # our own message echoed by the bus: not counted twice
    out = sc.merged({"w0": wc("w0", 1, 1, 1, 0.125), "w2": wc("w2", 7)})
    assert out == {"w0": wc("w0", 16, 10, 15, 2.125), "w1": wc("w1", 3, 1, 3, 0.25), "w2": wc("w2", 7)}
    assert sc.origins() == ["b", "c"]


def test_histograms_are_summed_bucket_by_bucket():
    a = wc("w0", 2, 0, 2, 1.0, [(0.5, 1), (1.0, 2)])
    b = wc("w0", 3, 0, 3, 1.0, [(0.5, 0), (1.0, 1), (2.0, 3)])
    assert add(a, b).ttft_buckets == [(0.5, 1), (1.0, 3), (2.0, 3)]
    assert add(a, wc("w0", 1)).ttft_buckets == [(0.5, 1), (1.0, 2)]  # a side without a histogram adds nothing


def test_sums_never_go_down_when_a_peer_stops_resets_or_is_forgotten():
    sc = SharedCounters("me", forget_s=100.0)
    sc.absorb("b", [wc("w0", 10, 2, 10, 1.0)], now=0.0)
    assert sc.merged({})["w0"].routed == 10
    sc.absorb("b", [], now=1.0)  # b stopped listing w0 (its fleet dropped it): its last counts stay
    assert sc.merged({})["w0"].routed == 10
    sc.absorb("b", [wc("w0", 4, 1, 4, 0.5)], now=2.0)  # b's counter for w0 went down (reset): the old is a base
    assert sc.merged({})["w0"] == wc("w0", 14, 3, 14, 1.5)
    sc.absorb("c", [wc("w0", 1)], now=150.0)  # b silent past forget_s: folded into the base, same sum
    assert sc.merged({})["w0"] == wc("w0", 15, 3, 14, 1.5) and sc.origins() == ["c"]


def test_the_message_round_trips():
    msg = PlannerCounters("fa", [wc("w0", 3, 2, 1, 0.5, [(0.5, 1)])])
    assert decode_planner_counters(encode(msg)) == msg


def test_counters_past_one_message_go_in_several_each_a_subset():
    workers = [wc(f"worker-{i:05d}", i, i // 2, i, 0.25 * i, [(0.5, i), (1.0, i + 1)]) for i in range(3000)]
    one = encode(PlannerCounters("fa", workers))
    assert messages("fa", workers, len(one) + HEADROOM) == [one]  # it fits: one message, as before
    limit = 32 * 1024
    bodies = messages("fa", workers, limit)
    assert len(bodies) > len(one) // limit and all(len(b) <= limit - HEADROOM for b in bodies)
    got = [decode_planner_counters(b) for b in bodies]
    assert [w for g in got for w in g.workers] == workers and {g.origin for g in got} == {"fa"}
    sc = SharedCounters("fb")
    for g in got:
        sc.absorb(g.origin, g.workers, now=1.0)
    assert sc.merged({}) == {w.worker_id: w for w in workers}  # whatever message each worker came in
