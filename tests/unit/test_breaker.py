"""Slow-worker ejection and circuit breaking (control/breaker.py): exact state changes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from thunderagent.config import Config, OutlierConfig
from thunderagent.control.breaker import BreakerState, Breakers

CFG = OutlierConfig(window_s=60, factor=3, min_requests=3, min_itl_s=0.01, min_ttft_s=0.1, failure_threshold=3,
                    eject_s=10, max_eject_s=25, probe_requests=1, max_ejected_fraction=0.5)
FLEET = ["w0", "w1", "w2", "w3"]


def feed(b: Breakers, wid: str, n: int, now: float, ttft: float, itl: float) -> None:
    for _ in range(n):
        b.finished(wid, now, ok=True, ttft=ttft, itl=itl)


def test_a_slow_itl_outlier_is_ejected_then_probed_back():
    b = Breakers(CFG)
    for w in FLEET[:3]:
        feed(b, w, 3, 0.0, 0.2, 0.02)
    feed(b, "w3", 3, 0.0, 0.2, 0.09)  # 4.5x the others' ITL
    [change] = b.check(FLEET, 1.0)
    assert change.worker_id == "w3" and change.state is BreakerState.open
    assert change.reason == "ITL 90ms is 4.5x the fleet's median 20ms; out for 10s"
    assert b.blocked("w3") == "ejected (ITL 90ms is 4.5x the fleet's median 20ms)"
    assert [b.blocked(w) for w in FLEET[:3]] == [None, None, None]
    assert b.check(FLEET, 10.9) == []  # still out
    [half] = b.check(FLEET, 11.0)
    assert half.state is BreakerState.half_open and b.blocked("w3") is None
    b.launched("w3")  # one probe at a time
    assert b.blocked("w3") == "half-open: 1 probe(s) in flight"
    b.released("w3")  # that probe ended with no verdict on w3 (strict disaggregation: its prefill worker failed)
    assert b.blocked("w3") is None and b.state("w3") is BreakerState.half_open
    b.launched("w3")
    closed = b.finished("w3", 12.0, ok=True, ttft=0.2, itl=0.021)
    assert closed is not None and closed.state is BreakerState.closed and b.blocked("w3") is None


def test_a_slow_probe_ejects_again_for_twice_as_long_capped():
    b = Breakers(CFG)
    for w in FLEET[:3]:
        feed(b, w, 3, 0.0, 0.2, 0.02)
    feed(b, "w3", 3, 0.0, 1.0, 0.02)  # TTFT 5x
    assert b.check(FLEET, 0.0)[0].reason.startswith("TTFT 1s is 5.0x the fleet's median 0.2s")
    b.check(FLEET, 10.0)
    b.launched("w3")
    again = b.finished("w3", 10.5, ok=True, ttft=0.9, itl=0.02)
    assert again is not None and again.reason == "probe slow: TTFT 0.9s is 4.5x the fleet's median 0.2s; out for 20s"
    assert b.check(FLEET, 30.4) == [] and b.state("w3") is BreakerState.open
    assert b.check(FLEET, 30.5)[0].state is BreakerState.half_open
    b.launched("w3")
    third = b.finished("w3", 31.0, ok=False)
    assert third is not None and third.reason == "probe failed; out for 25s"  # 40 s capped at max_eject_s


def test_consecutive_failures_open_the_breaker_and_success_resets_the_count():
    b = Breakers(CFG)
    b.check(FLEET, 0.0)
    assert b.finished("w1", 1.0, ok=False) is None
    assert b.finished("w1", 1.0, ok=False) is None
    assert b.finished("w1", 1.0, ok=True, ttft=0.1) is None  # the run is broken
    assert b.finished("w1", 2.0, ok=False) is None
    assert b.finished("w1", 2.0, ok=False) is None
    opened = b.finished("w1", 2.0, ok=False)
    assert opened is not None and opened.reason == "3 errors in a row; out for 10s"


def test_a_fleet_slow_everywhere_ejects_nobody_and_small_numbers_are_noise():
    b = Breakers(CFG)
    for w in FLEET:
        feed(b, w, 3, 0.0, 2.0, 0.5)
    assert b.check(FLEET, 1.0) == []
    b2 = Breakers(CFG)
    for w in FLEET[:3]:
        feed(b2, w, 3, 0.0, 0.01, 0.001)
    feed(b2, "w3", 3, 0.0, 0.05, 0.009)  # 5x and 9x, but under min_ttft_s / min_itl_s
    assert b2.check(FLEET, 1.0) == []


def test_judging_needs_enough_requests_and_two_other_workers():
    b = Breakers(CFG)
    feed(b, "w0", 3, 0.0, 0.2, 0.02)
    feed(b, "w1", 3, 0.0, 0.2, 0.02)
    feed(b, "w3", 2, 0.0, 5.0, 0.5)  # under min_requests
    assert b.check(FLEET, 1.0) == []
    b2 = Breakers(CFG)
    feed(b2, "w0", 3, 0.0, 0.2, 0.02)
    feed(b2, "w3", 3, 0.0, 5.0, 0.5)  # one other worker only: no reference
    assert b2.check(FLEET, 1.0) == []


def test_old_samples_leave_the_window():
    b = Breakers(CFG)
    for w in FLEET[:3]:
        feed(b, w, 3, 100.0, 0.2, 0.02)
    feed(b, "w3", 3, 0.0, 5.0, 0.5)  # slow, but 100 s ago
    assert b.check(FLEET, 100.0) == []


def test_the_cap_keeps_most_of_the_fleet_in_and_ejects_the_worst_first():
    b = Breakers(CFG)  # 50 % of 6: three at most
    fleet = FLEET + ["w4", "w5"]
    for w in fleet[:3]:
        feed(b, w, 3, 0.0, 0.2, 0.02)
    feed(b, "w3", 3, 0.0, 0.2, 0.07)
    feed(b, "w4", 3, 0.0, 0.2, 0.09)
    feed(b, "w5", 3, 0.0, 0.2, 0.08)
    out = b.check(fleet, 1.0)
    assert [c.worker_id for c in out] == ["w4", "w5", "w3"]  # 50 % of 6 = 3, worst first
    b2 = Breakers(CFG.model_copy(update={"max_ejected_fraction": 0.34}))  # int(0.34 * 6) = 2
    for w in fleet[:3]:
        feed(b2, w, 3, 0.0, 0.2, 0.02)
    feed(b2, "w3", 3, 0.0, 0.2, 0.07)
    feed(b2, "w4", 3, 0.0, 0.2, 0.09)
    feed(b2, "w5", 3, 0.0, 0.2, 0.08)
    assert [c.worker_id for c in b2.check(fleet, 1.0)] == ["w4", "w5"]  # the least slow stays in
    assert b2.blocked("w3") is None
    assert b2.check(fleet, 2.0) == []  # the cap holds on later checks too


def test_disabled_does_nothing_and_knobs_need_the_switch():
    b = Breakers(OutlierConfig(enabled=False))
    for _ in range(10):
        b.finished("w0", 0.0, ok=False)
    assert b.check(FLEET, 1.0) == [] and b.blocked("w0") is None
    with pytest.raises(ValidationError, match="acts only with control_plane.outlier.enabled"):
        OutlierConfig(enabled=False, factor=5)
    with pytest.raises(ValidationError, match="max_eject_s"):
        OutlierConfig(eject_s=60, max_eject_s=30)
    assert Config().control_plane.outlier.enabled


def test_breakers_of_workers_that_left_are_forgotten_and_do_not_widen_the_ejection_cap():
    """A fleet whose workers come and go under new ids: breakers of departed workers counted in the
    cap's base, so a fleet of 4 with 6 departed could eject 3 of its 4 (max_ejected_fraction 0.5)."""
    from thunderagent.control.metrics import Metrics
    from thunderagent.control.outliers import OutlierWatch

    def run(forgotten: bool) -> list[BreakerState]:
        watch = OutlierWatch(CFG, Metrics())
        for i in range(6):  # served a while, then left
            watch.breakers.finished(f"old{i}", 0.0, ok=True, ttft=0.2, itl=0.02)
            if forgotten:
                watch.forget(f"old{i}")  # what Fleet.leave does
        watch.tick(FLEET, 1.0)
        for w in FLEET[:3]:
            for _ in range(3):
                watch.breakers.finished(w, 2.0, ok=False)
        return [watch.breakers.state(w) for w in FLEET]

    opened, closed = BreakerState.open, BreakerState.closed
    assert run(True) == [opened, opened, closed, closed]  # the cap: half of the 4 live workers
    assert run(False) == [opened, opened, opened, closed]  # departed ones kept: the cap counted 10 workers
