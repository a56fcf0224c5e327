"""Hot-prefix replicas (router/hot.py through KvRouter.route): exact choices on hand-built worker states.

Setting: blocks of 16 tokens, passes of 1,024 tokens; a 2,048-token prefix P (128 blocks) held by
worker a, each request P + 2 unique blocks (2,080 tokens). With 1,100 queued tokens a is past one pass
(overloaded), yet the plain cost still prefers it (cost 1,566) to an idle non-holder (2,080): without
replicas, P's requests pile up on a.
"""

from __future__ import annotations

import random

import pytest

from thunderagent.config import HotPrefixConfig, Policy, RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.types import BlockStored, HotPrefixNote, LoadReport, RouteRequest, WorkerState

BS = 16
P = list(range(1, 129))  # 128 blocks = 2,048 tokens
KEY = P[-1]  # a prefix is keyed by the hash of its last block
IDS = ("a", "b", "c", "d")


def worker(wid: str, queued: int = 0, waiting: int = 0) -> WorkerState:
    return WorkerState(wid, BS, max_num_batched_tokens=1024, queue_depth_threshold=8,
                       load=LoadReport(wid, 0.0, 0, waiting, queued, 0, 0, 0, 1000))


def fleet(**queued: int) -> list[WorkerState]:
    return [worker(w, queued.get(w, 0)) for w in IDS]


def make(enabled: bool = True, policy: Policy | None = None, **hot: object) -> tuple[KvRouter, KvIndex]:
    index = KvIndex(prediction_ttl=100.0)
    for w in IDS:
        index.add_worker(w)
    index.apply_event(BlockStored("a", 0, tuple(P)), 0.0)
    knobs = {"min_prefix_tokens": 1024, **hot} if enabled else {}
    cfg = RoutingConfig(hot_prefix=HotPrefixConfig(enabled=enabled, **knobs))  # type: ignore[arg-type]
    return KvRouter(cfg, index, random.Random(0), policy), index


def req(i: int, prefix: list[int] = P) -> RouteRequest:
    hashes = prefix + [10_000 + 2 * i, 10_001 + 2 * i]
    return RouteRequest(f"r{i}", len(hashes) * BS, hashes)


# a overloaded (>= 1 pass), b idle, c with room (< 0.5 pass), d without room
HOT = {"a": 1100, "b": 0, "c": 100, "d": 600}


def test_without_the_feature_the_overloaded_holder_keeps_the_prefix() -> None:
    router, _ = make(enabled=False)
    assert [router.route(req(i), fleet(**HOT), float(i)).worker_id for i in range(3)] == ["a", "a", "a"]
    assert router.hot is None


def test_hot_prefix_warms_a_replica_after_min_requests_and_explains_it() -> None:
    router, _ = make()
    d1 = router.route(req(1), fleet(**HOT), 1.0)
    assert (d1.worker_id, d1.hot_prefix) == ("a", None)  # one request that finds a backlogged is not demand
    d2 = router.route(req(2), fleet(**HOT), 2.0)
    assert d2.worker_id == "b"  # lowest-cost worker with room; d has none
    assert d2.hot_prefix == HotPrefixNote(128, ("a",), ("b",), True)
    assert d2.reason == ("hot prefix (2048 tokens): all 1 holders (a) backlogged >= 1 passes while b has room: "
                         "new replica 1/2")
    assert d2.explain()["hot_prefix"] == {"prefix_blocks": 128, "holders": ["a"], "replicas": ["b"], "added": True}
    assert router.hot is not None and router.hot.replicas(KEY, 2.0) == ("b",)
    # b holds P now (predicted): the prefix is no longer hot, the cost picks the warm replica and says so
    d3 = router.route(req(3), fleet(**HOT), 3.0)
    assert d3.worker_id == "b" and d3.hot_prefix == HotPrefixNote(128, (), ("b",), False)
    assert d3.reason.startswith("replica of a hot prefix (2048 tokens, replicas b); lowest cost")
    assert "hot_prefix" not in d1.explain()
    assert (router.hot.added, router.hot.to_replicas) == (1, 2)


def test_second_replica_only_when_all_copies_are_overloaded_and_the_cap_holds() -> None:
    router, _ = make()
    for i in (1, 2):
        router.route(req(i), fleet(**HOT), float(i))  # b becomes replica 1
    d = router.route(req(3), fleet(a=1100, b=1500, c=100, d=600), 3.0)
    assert d.worker_id == "c" and d.hot_prefix == HotPrefixNote(128, ("a", "b"), ("b", "c"), True)
    # all three copies overloaded, d has room, but the cap (2) is reached: the cost decides (a, 1,566)
    d = router.route(req(4), fleet(a=1100, b=1500, c=1200, d=0), 4.0)
    assert d.worker_id == "a" and d.hot_prefix is None
    assert router.hot is not None and router.hot.replicas(KEY, 4.0) == ("b", "c")


def test_max_replicas_one() -> None:
    router, _ = make(max_replicas=1)
    for i in (1, 2):
        router.route(req(i), fleet(**HOT), float(i))
    d = router.route(req(3), fleet(a=1100, b=1500, c=100, d=600), 3.0)
    assert d.worker_id == "a" and d.hot_prefix is None
    assert router.hot is not None and router.hot.replicas(KEY, 3.0) == ("b",)


def test_replicas_retire_newest_first_one_per_period_then_the_prefix_is_forgotten() -> None:
    router, _ = make(retire_after_s=10.0)
    for i in (1, 2):
        router.route(req(i), fleet(**HOT), float(i))
    router.route(req(3), fleet(a=1100, b=1500, c=100, d=600), 3.0)  # replicas (b, c), last hot at 3.0
    hot = router.hot
    assert hot is not None
    assert [hot.replicas(KEY, t) for t in (12.9, 13.0, 22.9, 23.0)] == [("b", "c"), ("b",), ("b",), ()]
    assert hot.tracked() == 1
    # a request of P after that (holders with room: not hot) finds it retired and forgets it
    d = router.route(req(4), fleet(), 23.0)
    assert d.hot_prefix is None and hot.tracked() == 0


def test_hot_again_keeps_live_replicas_and_refills_a_retired_slot() -> None:
    router, _ = make(retire_after_s=10.0, min_requests=1)
    router.route(req(1), fleet(**HOT), 1.0)  # (b,)
    router.route(req(3), fleet(a=1100, b=1500, c=100, d=600), 3.0)  # (b, c), last hot at 3.0
    # 13.0: c retired; P hot again with d the only worker with room: d takes c's slot, b stays
    d = router.route(req(4), fleet(a=1100, b=1500, c=1500, d=0), 13.0)
    assert d.worker_id == "d" and d.hot_prefix == HotPrefixNote(128, ("a", "b", "c"), ("b", "d"), True)


def test_demand_lapses_after_retire_after_s_between_hot_requests() -> None:
    router, _ = make(retire_after_s=10.0)
    router.route(req(1), fleet(**HOT), 1.0)
    d = router.route(req(2), fleet(**HOT), 11.0)  # the first sighting is 10 s old: counting restarts
    assert d.worker_id == "a" and d.hot_prefix is None
    d = router.route(req(3), fleet(**HOT), 12.0)
    assert d.worker_id == "b" and d.hot_prefix is not None and d.hot_prefix.added


def test_busy_holder_counts_as_overloaded() -> None:
    router, _ = make(min_requests=1)
    ws = [worker("a", 0, waiting=8), worker("b", 700), worker("c", 100), worker("d", 600)]
    d = router.route(req(1), ws, 1.0)
    assert d.worker_id == "c" and d.hot_prefix == HotPrefixNote(128, ("a",), ("c",), True)
    assert d.reason.startswith("1 busy filtered; hot prefix")


@pytest.mark.parametrize("queued, why", [
    ({"a": 1000, "b": 0, "c": 100, "d": 600}, "holder under one pass"),
    ({"a": 1100, "b": 600, "c": 512, "d": 600}, "nobody with room (below half a pass)"),
])
def test_not_hot(queued: dict[str, int], why: str) -> None:
    on, _ = make(min_requests=1)
    off, _ = make(enabled=False)
    for i in range(3):
        d_on, d_off = on.route(req(i), fleet(**queued), float(i)), off.route(req(i), fleet(**queued), float(i))
        assert (d_on.worker_id, d_on.reason, d_on.hot_prefix) == (d_off.worker_id, d_off.reason, None), why
    assert on.hot is not None and on.hot.tracked() == 0


def test_cold_and_short_prefixes_are_unaffected() -> None:
    on, index_on = make(min_requests=1)
    off, index_off = make(enabled=False)
    short = list(range(500, 532))  # 32 blocks = 512 tokens < min_prefix_tokens (1,024)
    for index in (index_on, index_off):
        index.apply_event(BlockStored("a", 1, tuple(short)), 0.0)
    cold = list(range(900, 1028))  # held by nobody
    for i, prefix in enumerate((short, short, cold, cold)):
        d_on = on.route(req(i, prefix), fleet(**HOT), float(i))
        d_off = off.route(req(i, prefix), fleet(**HOT), float(i))
        assert (d_on.worker_id, d_on.reason, d_on.hot_prefix) == (d_off.worker_id, d_off.reason, None)
    assert on.hot is not None and on.hot.tracked() == 0


def test_replica_that_lost_the_prefix_is_warmed_again_within_the_cap() -> None:
    router, index = make(min_requests=1)
    router.route(req(1), fleet(**HOT), 1.0)  # (b,)
    index.report_missing("b", P)  # b found P gone (evicted)
    d = router.route(req(2), fleet(**HOT), 2.0)
    assert d.worker_id == "b" and d.hot_prefix == HotPrefixNote(128, ("a",), ("b",), False)
    assert d.reason.endswith("while b has room: its replica warmed again (it lost the prefix)")
    assert router.hot is not None and (router.hot.added, router.hot.replicas(KEY, 2.0)) == (1, ("b",))


def test_replica_that_left_routing_is_dropped_from_the_set() -> None:
    router, _ = make()
    for i in (1, 2):
        router.route(req(i), fleet(**HOT), float(i))  # (b,)
    ws = [w for w in fleet(a=1100, c=100, d=600) if w.worker_id != "b"]
    d = router.route(req(3), ws, 3.0)
    assert d.worker_id == "c" and d.hot_prefix == HotPrefixNote(128, ("a",), ("c",), True)


def test_table_is_bounded_least_recently_hot_forgotten() -> None:
    router, index = make(max_prefixes=1, min_requests=1)
    q = list(range(3000, 3128))
    index.apply_event(BlockStored("a", 1, tuple(q)), 0.0)
    router.route(req(1), fleet(**HOT), 1.0)  # P: replica b
    d = router.route(req(2, q), fleet(a=1100, b=1500, c=100, d=600), 2.0)  # Q: replica c, P forgotten
    assert d.worker_id == "c"
    hot = router.hot
    assert hot is not None and hot.tracked() == 1 and hot.replicas(KEY, 2.0) == () and hot.replicas(q[-1], 2.0) == ("c",)


@pytest.mark.parametrize("knobs, queued, worker", [
    ({}, {"a": 1000, "b": 0, "c": 100, "d": 600}, "a"),  # a under one pass: not overloaded
    ({"hot_backlog_passes": 0.9}, {"a": 1000, "b": 0, "c": 100, "d": 600}, "b"),  # now it is
    ({}, {"a": 1100, "b": 600, "c": 300, "d": 600}, "c"),  # c has room (300 < 512)
    ({"room_backlog_passes": 0.25}, {"a": 1100, "b": 600, "c": 300, "d": 600}, "a"),  # now it has not
])
def test_thresholds_act(knobs: dict[str, float], queued: dict[str, int], worker: str) -> None:
    router, _ = make(min_requests=1, **knobs)
    assert router.route(req(1), fleet(**queued), 1.0).worker_id == worker


def test_only_with_kv_aware() -> None:
    router, _ = make(policy=Policy.round_robin)
    assert router.hot is None


def test_steering_counts_as_recent_traffic_of_the_replica() -> None:
    router, _ = make(min_requests=1)
    router.route(req(1), fleet(**HOT), 1.0)
    recent = router.policy.recent  # type: ignore[attr-defined]
    assert recent.rate("b", 1.0) == pytest.approx(2080)
