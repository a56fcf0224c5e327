from __future__ import annotations

import pytest

from thunderagent.config import RoutingConfig
from thunderagent.control.registry import Health, WorkerRegistry
from thunderagent.types import WorkerInfo
from thunderagent.types import LoadReport


def info(wid: str) -> WorkerInfo:
    return WorkerInfo(wid, "both", 64, 8192, 64, 100)


def rep(wid: str, t: float, waiting: int = 0) -> LoadReport:
    return LoadReport(wid, t, 0, waiting, 0, 0, 0, 0, 100)


def test_missed_heartbeats_leave_routing_and_return():
    reg = WorkerRegistry(heartbeat_interval=1.0, misses=3)
    reg.register(info("a"), 0.0)
    reg.register(info("b"), 0.0)
    reg.heartbeat("a", rep("a", 2.5), 2.5)
    reg.heartbeat("b", rep("b", 2.5, waiting=4), 2.5)
    assert reg.check(5.5) == []  # exactly 3 intervals late is still on time
    reg.heartbeat("a", rep("a", 5.0), 5.0)
    changes = reg.check(5.6)
    assert [(c.worker_id, c.health) for c in changes] == [("b", Health.unhealthy)]
    assert [w.worker_id for w in reg.routable()] == ["a"]
    reg.heartbeat("b", rep("b", 6.0), 6.0)
    assert [(c.worker_id, c.health) for c in reg.check(6.1)] == [("b", Health.healthy)]
    assert [w.worker_id for w in reg.routable()] == ["a", "b"]
    assert reg.routable()[1].load.waiting == 0


def test_unknown_heartbeat_and_bad_settings():
    reg = WorkerRegistry(1.0, 1)
    with pytest.raises(KeyError):
        reg.heartbeat("x", rep("x", 0), 0)
    with pytest.raises(ValueError):
        WorkerRegistry(0, 1)


def test_routable_workers_carry_their_role():
    reg = WorkerRegistry(heartbeat_interval=1.0, misses=3)
    reg.register(WorkerInfo("p", "prefill", 64, 8192, 64, 100), 0.0)
    reg.register(info("b"), 0.0)
    assert [(w.worker_id, w.role) for w in reg.routable()] == [("p", "prefill"), ("b", "both")]


@pytest.mark.parametrize("routing", [None, RoutingConfig()])
def test_a_stale_load_is_read_once_at_the_next_read(routing):
    reg = WorkerRegistry(1.0, 3, routing)
    reg.register(info("a"), 0.0)
    reg.register(info("b"), 0.0)
    reads: list[int] = []

    def reader(waiting: int):
        def read() -> LoadReport:
            reads.append(waiting)
            return rep("a", 1.0, waiting)
        return read

    # submitted, started, ended: three changes before anyone reads, one report built
    for waiting in (1, 2, 3):
        reg.stale("a", reader(waiting))
    assert reads == []
    assert [w.load.waiting for w in reg.routable()] == [3, 0]  # the read sees the latest load
    assert reads == [3]
    assert [w.load.waiting for w in reg.routable()] == [3, 0] and reads == [3]  # not read again
    reg.stale("a", reader(5))
    assert reg.loads()["a"].waiting == 5 and reads == [3, 5]
    reg.stale("a", reader(6))
    reg.heartbeat("a", rep("a", 2.0, 7), 2.0)  # a report as fresh as the reader's: the reader is dropped
    assert reg.loads()["a"].waiting == 7 and reads == [3, 5]
    reg.stale("b", reader(8))
    reg.deregister("b")
    reg.stale("b", reader(9))  # unknown worker: ignored
    assert list(reg.loads()) == ["a"] and reads == [3, 5]


def test_a_view_less_some_workers_is_kept_fed_and_rebuilt_only_when_needed():
    """Workers out of routing (unavailable, a breaker open) leave the router a view of the rest, not a
    filtered list: its fast path (a FleetView) holds for every decision while they are out."""
    from thunderagent.router.candidates import FleetView

    reg = WorkerRegistry(1.0, 3, RoutingConfig())
    for wid in ("a", "b", "c"):
        reg.register(info(wid), 0.0)
    whole = reg.routable()
    assert reg.routable(frozenset()) is whole and reg.routable(frozenset({"zz"})) is whole  # unknown: no-op
    rest = reg.routable(frozenset({"b"}))
    assert isinstance(rest, FleetView) and [w.worker_id for w in rest] == ["a", "c"]
    assert reg.routable(frozenset({"b"})) is rest  # same exclusions, same membership: the same view
    reg.heartbeat("c", rep("c", 0.5, waiting=64), 0.5)  # c's queue reaches the busy threshold
    assert [w.load.waiting for w in rest] == [0, 64]
    assert rest.busy_positions == {1} and rest.free_count == 1  # the view's own order follows the load
    reg.register(info("d"), 1.0)  # membership changed: rebuilt
    rest2 = reg.routable(frozenset({"b"}))
    assert rest2 is not rest and [w.worker_id for w in rest2] == ["a", "c", "d"]
    assert [w.worker_id for w in reg.routable(frozenset({"a", "c"}))] == ["b", "d"]
    plain = WorkerRegistry(1.0, 3)  # no view kept: a filtered list
    for wid in ("a", "b"):
        plain.register(info(wid), 0.0)
    assert [w.worker_id for w in plain.routable(frozenset({"a"}))] == ["b"]


def test_the_router_never_mistakes_one_partial_view_for_another():
    """Views of part of the fleet come and go as workers leave and rejoin routing; two of the same size
    have the same version, and a freed one's id() can be reused. The router's per-view bookkeeping (each
    position's index bit) must follow the view it is handed: here the blocks held by worker w2 must
    route to w2 whichever partial view comes in."""
    import random

    from thunderagent.kv.index import KvIndex
    from thunderagent.router.router import KvRouter
    from thunderagent.types import BlockStored, RouteRequest

    cfg = RoutingConfig(candidate_limit=1, whole_scan_max_workers=0)  # the fast path (a view larger than the limit)
    reg = WorkerRegistry(1.0, 3, cfg)
    index = KvIndex(prediction_ttl=0.0)
    ids = [f"w{i}" for i in range(6)]
    for wid in ids:
        reg.register(info(wid), 0.0)
        index.add_worker(wid)
    hashes = [11, 12, 13, 14]
    index.apply_event(BlockStored("w2", 0, tuple(hashes)), 0.0)
    router = KvRouter(cfg, index, random.Random(0))
    others = [w for w in ids if w != "w2"]
    for k in range(60):
        # the exclusions change between two decisions, sometimes twice (a view built, never routed on)
        for j in range(1 + k % 2):
            out = frozenset({others[(k + j) % len(others)]})  # one worker out, never w2
            view = reg.routable(out)
        d = router.route(RouteRequest(f"r{k}", 4 * 64, hashes), view, 1.0, predict=False)
        assert d.worker_id == "w2" and d.overlap_blocks == 4, (k, sorted(out))
        # the per-position index bits it used are this view's (a stale copy once survived here)
        assert router._bits == [index.bit_of(w.worker_id) for w in view], (k, sorted(out))


def test_restate_keeps_load_and_health_and_refreshes_the_view():
    from dataclasses import replace

    reg = WorkerRegistry(1.0, 3, RoutingConfig())
    reg.register(info("a"), 0.0)
    reg.register(info("b"), 0.0)
    reg.heartbeat("a", rep("a", 1.0, waiting=2), 1.0)
    view = reg.routable()
    assert view.seq_floor == 1 << 62  # nobody stated a limit
    assert reg.restate(replace(info("a"), max_seq_tokens=2048))
    view = reg.routable()
    a = view[view.position("a")]
    assert (a.max_seq_tokens, a.load.waiting) == (2048, 2) and view.seq_floor == 2048
    assert reg.info("a").max_seq_tokens == 2048 and reg.health("a") is Health.healthy
    assert not reg.restate(info("zz"))  # not registered: nothing to restate
    reg.check(10.0)  # both out of routing (silent): restating keeps it out of the view
    assert reg.restate(replace(info("b"), max_seq_tokens=512))
    assert len(reg.routable()) == 0
    reg.heartbeat("b", rep("b", 10.5), 10.5)
    reg.check(10.6)
    assert [(w.worker_id, w.max_seq_tokens) for w in reg.routable()] == [("b", 512)]
