"""Leases judged on our own loop's on-time seconds (control/liveness.py): a late frontend never
declares workers dead; a silent worker still is."""

from __future__ import annotations

from thunderagent.control.liveness import LoopLag
from thunderagent.control.registry import Health, WorkerRegistry
from thunderagent.types import LoadReport, WorkerInfo


def _registry() -> WorkerRegistry:
    reg = WorkerRegistry(heartbeat_interval=1.0, misses=3)  # 3 s lease
    for wid in ("a", "b"):
        reg.register(WorkerInfo(wid, "both", 16, 8192, 64, 100), 0.0)
    return reg


def _beat(reg: WorkerRegistry, wid: str, now: float) -> None:
    reg.heartbeat(wid, LoadReport(wid, now, 0, 0, 0, 0, 0, 0, 100), now)


def test_lag_is_recorded_and_excused_after_an_instant() -> None:
    lag = LoopLag(horizon_s=20.0)
    assert lag.tick(expected=0.5, woke=0.501) == 0.0  # jitter
    assert lag.tick(expected=1.0, woke=5.0) == 4.0
    assert lag.tick(expected=5.5, woke=5.5) == 0.0
    assert lag.excused_since(0.9) == 4.0 and lag.excused_since(5.0) == 0.0
    assert lag.silent_for(0.9, 6.0) == 6.0 - 0.9 - 4.0
    assert lag.max_lag == 4.0
    lag.tick(expected=40.0, woke=40.0)  # past the horizon: forgotten
    assert lag.excused_since(0.0) == 0.0


def test_one_stall_seen_by_two_waits_is_counted_once() -> None:
    """The health loop and the PD flow's watch both wake late from the same stall: the union of
    their late spans is excused, not the sum; a later, separate stall is a record of its own."""
    lag = LoopLag(horizon_s=20.0)
    assert lag.tick(expected=1.0, woke=5.0) == 4.0
    assert lag.tick(expected=2.0, woke=5.2) == 3.2  # inside the first stall, and a little past it
    assert lag.excused_since(0.5) == 5.2 - 1.0 and lag.total_lag == 5.2 - 1.0 and lag.max_lag == 5.2 - 1.0
    assert lag.tick(expected=0.5, woke=4.9) == 4.4  # starts earlier, ends inside
    assert lag.excused_since(0.0) == 5.2 - 0.5
    assert lag.tick(expected=8.0, woke=9.0) == 1.0
    assert lag.excused_since(0.0) == 5.2 - 0.5 + 1.0 and lag.excused_since(6.0) == 1.0


def test_a_stalled_loop_does_not_expire_leases() -> None:
    reg, lag = _registry(), LoopLag(horizon_s=20.0)
    _beat(reg, "a", 1.0)
    _beat(reg, "b", 1.0)
    # our loop stalls 5 s: the health loop, due at 1.5, wakes at 6.5; the workers' heartbeats were as late
    lag.tick(1.5, 6.5)
    assert reg.check(6.5, lag.silent_for) == []
    assert reg.check(6.5) != []  # judged on the wall clock alone, both would have been dropped
    assert [w.worker_id for w in reg.routable()] == []  # (that call marked them: the fleet never makes it)


def test_a_silent_worker_still_expires_while_the_loop_is_on_time() -> None:
    reg, lag = _registry(), LoopLag(horizon_s=20.0)
    _beat(reg, "a", 1.0)
    _beat(reg, "b", 1.0)
    lag.tick(1.5, 6.5)  # a stall first: excused
    _beat(reg, "a", 6.6)  # a heartbeats again, b never does
    t = 6.5
    while t < 8.9:  # on-time ticks up to 9.0: b silent 8 s, 3 of them on time
        lag.tick(t + 0.5, t + 0.5)
        t += 0.5
        assert reg.check(t, lag.silent_for) == []
    _beat(reg, "a", 9.5)
    lag.tick(10.0, 10.0)
    changes = reg.check(10.0, lag.silent_for)  # b: 9 s of wall time, 4 on time > the 3 s lease
    assert [(c.worker_id, c.health) for c in changes] == [("b", Health.unhealthy)]
    assert [w.worker_id for w in reg.routable()] == ["a"]
