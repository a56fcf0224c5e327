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
