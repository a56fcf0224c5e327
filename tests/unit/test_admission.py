"""Admission under overload (issue 11 item 6): the scheduler dispatches only into free sequence slots,
and holds a request only while its predicted wait stays within (``admit_ttft_factor`` - 1) x the
measured service TTFT; bursts that fit the engines' slots go straight in."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from pydantic import ValidationError

from thunderagent.config import RoutingConfig, SchedulerConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.scheduler.queue import Held, HoldingQueue, QueueFull
from thunderagent.types import EngineRequest, LoadReport, WorkerState


def held(rid: str, at: float) -> Held:
    return Held(EngineRequest(rid, [1] * 32, [], 0, 4), "", 0, at, 32)


def worker(wid: str, running: int = 0, waiting: int = 0, slots: int = 4) -> WorkerState:
    return WorkerState(wid, 16, 8192, 64, LoadReport(wid, 0.0, running, waiting, 0, 0, 0, 0, 1000), "both", slots)


def dispatcher(workers: list[str], **sched: object) -> Dispatcher:
    index = KvIndex(prediction_ttl=60.0)
    for w in workers:
        index.add_worker(w)
    return Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16,
                      SchedulerConfig(enabled=True, **sched))  # type: ignore[arg-type]


@pytest.mark.parametrize(("running", "waiting", "depth", "slots", "can"), [
    (3, 0, 0, 4, True),  # a free slot: it starts at the engine's next pass
    (4, 0, 0, 4, False),  # all slots taken: it would wait in the engine for one
    (3, 1, 0, 4, False),  # the last slot is already promised to one waiting
    (4, 0, 1, 4, True),  # engine_queue_depth 1: one may wait for a slot
    (4, 1, 1, 4, False),
    (9, 0, 0, 0, True),  # slots not said: the engine queue's length is all there is
    (9, 1, 0, 0, False),  # ... and at least one may wait there
    (9, 1, 2, 0, True),
])
def test_a_worker_can_start_a_request_only_into_a_free_slot(running, waiting, depth, slots, can) -> None:
    d = dispatcher(["w0"], engine_queue_depth=depth)
    assert d.can_start([worker("w0", running, waiting, slots)]) is can


def test_a_burst_that_fits_the_slots_goes_straight_into_the_engines() -> None:
    # 100 concurrent requests on 3 workers of 256 slots: none is held, none refused (the previous
    # one-per-pass gate held all but three, and a tight time bound then refused them)
    ws = [worker(f"w{i}", slots=256) for i in range(3)]
    d = dispatcher([w.worker_id for w in ws])
    d.queue.observe_service(0.05)  # type: ignore[union-attr]  a tight bound is measured already
    for k in range(100):
        out = d.submit(d.prepare(f"r{k}", [k + 1] * 40, 8), "", ws, 0.0)
        assert out is not None, f"request {k} was held"
        i = next(i for i, w in enumerate(ws) if w.worker_id == out.decision.worker_id)
        ws[i] = replace(ws[i], load=replace(ws[i].load, waiting=ws[i].load.waiting + 1))
    assert sum(w.load.waiting for w in ws) == 100 and len(d.queue) == 0  # type: ignore[arg-type]


def test_a_request_predicted_to_wait_past_the_bound_gets_429_with_retry_after() -> None:
    q = HoldingQueue(SchedulerConfig(enabled=True, admit_ttft_factor=2.0, max_queue_delay_s=None))
    assert q.admit_bound() is None  # nothing measured: only the count bounds act
    q.push(held("a", 0.0), 0.0)
    q.take(q.next(0.05), 0.05)  # type: ignore[arg-type]  it waited 0.05 s at place 1
    q.observe_service(0.1)
    assert q.admit_bound() == pytest.approx(0.1)  # (2 - 1) x 0.1 s
    q.push(held("b", 1.0), 1.0)  # 0.05 s per place: 1 place, within 0.1 s
    q.push(held("c", 1.0), 1.0)  # 2 places: 0.1 s, not over it
    with pytest.raises(QueueFull, match="admit_ttft_factor") as err:
        q.push(held("d", 1.0), 1.0)  # 3 places: 0.15 s
    assert err.value.retry_after >= 1
    assert len(q) == 2


def test_a_millisecond_service_ttft_does_not_refuse_a_wait_of_a_few_ms() -> None:
    """In front of servers that answer in ~1 ms, (factor - 1) x the service TTFT would refuse any
    request that waits a millisecond for a slot; the bound has a floor, ``admit_min_wait_s``."""
    q = HoldingQueue(SchedulerConfig(enabled=True, admit_ttft_factor=2.0, max_queue_delay_s=None))
    q.push(held("a", 0.0), 0.0)
    q.take(q.next(0.004), 0.004)  # type: ignore[arg-type]  4 ms per place
    q.observe_service(0.001)
    assert q.admit_bound() == pytest.approx(0.05)  # not 0.001
    for i in range(12):  # up to 12 places x 4 ms = 48 ms: admitted
        q.push(held(f"b{i}", 1.0), 1.0)
    with pytest.raises(QueueFull, match=r"service TTFT \(0\.050s\)"):
        q.push(held("c", 1.0), 1.0)  # 13 x 4 ms = 52 ms
    strict = HoldingQueue(SchedulerConfig(enabled=True, admit_ttft_factor=2.0, admit_min_wait_s=0,
                                          max_queue_delay_s=None))
    strict.observe_service(0.001)
    assert strict.admit_bound() == pytest.approx(0.001)
    with pytest.raises(ValidationError, match="admit_min_wait_s"):
        SchedulerConfig(admit_min_wait_s=-1)
    with pytest.raises(ValidationError, match=r"admit_min_wait_s acts only with"):
        SchedulerConfig(enabled=True, admit_ttft_factor=None, admit_min_wait_s=0.2)


def test_what_held_requests_really_waited_calibrates_the_prediction() -> None:
    # slots freed in waves: dispatches come in quick runs (a small mean gap), but a request held just
    # after a wave waited for the next one; its wait per place is what the bound goes by
    q = HoldingQueue(SchedulerConfig(enabled=True, admit_ttft_factor=2.0, max_queue_delay_s=None))
    q.observe_service(0.2)
    q.push(held("a", 0.0), 0.0)
    q.take(q.next(0.5), 0.5)  # type: ignore[arg-type]  waited 0.5 s at place 1
    with pytest.raises(QueueFull, match=r"wait about 0\.500s"):
        q.push(held("b", 1.0), 1.0)
    off = HoldingQueue(SchedulerConfig(enabled=True, admit_ttft_factor=None, max_queue_delay_s=None))
    off.observe_service(0.2)
    off.push(held("a", 0.0), 0.0)
    off.take(off.next(0.5), 0.5)  # type: ignore[arg-type]
    off.push(held("b", 1.0), 1.0)  # null: off
    assert len(off) == 1


def test_the_dispatcher_feeds_the_service_time_to_the_bound() -> None:
    d = dispatcher(["w0"], admit_ttft_factor=3.0)
    d.first_token(0.2)
    assert d.queue.admit_bound() == pytest.approx(0.4)  # type: ignore[union-attr]
    d.first_token(0.3)  # smoothed: 0.9 x 0.2 + 0.1 x 0.3
    assert d.queue.admit_bound() == pytest.approx(2 * 0.21)  # type: ignore[union-attr]


def test_admit_ttft_factor_is_validated_with_its_name() -> None:
    with pytest.raises(ValidationError, match="admit_ttft_factor"):
        SchedulerConfig(admit_ttft_factor=1.0)
    with pytest.raises(ValidationError, match=r"scheduler\.admit_ttft_factor acts only with scheduler\.enabled"):
        SchedulerConfig(enabled=False, admit_ttft_factor=3.0)
    assert SchedulerConfig(enabled=False).admit_ttft_factor == 2.0  # the default loads either way
    assert SchedulerConfig(admit_ttft_factor=None).admit_ttft_factor is None



def test_the_calibration_counts_the_dispatches_a_request_waited_for_not_its_place() -> None:
    # whatever order the queue picks (priorities, short first), a request's wait is divided by the
    # dispatches that happened while it was held, itself included: here 0.1 s each
    q = HoldingQueue(SchedulerConfig(enabled=True, admit_ttft_factor=2.0, max_queue_delay_s=None))
    for rid in ("a", "b", "c"):
        q.push(held(rid, 0.0), 0.0)
    for t in (0.1, 0.2, 0.3):
        q.take(q.next(t), t)  # type: ignore[arg-type]
    q.observe_service(0.25)
    q.push(held("d", 1.0), 1.0)  # 1 x 0.1 s
    q.push(held("e", 1.0), 1.0)  # 2 x 0.1 s
    with pytest.raises(QueueFull):
        q.push(held("f", 1.0), 1.0)  # 3 x 0.1 s > 0.25 s


def test_the_overload_gate_engages_on_a_refusal_for_the_wait_and_releases_after_the_hold() -> None:
    # two workers with free slots; the bound measured tight (a request held waited 0.05 s per place,
    # service 0.1 s) so a third held request is refused
    ws = [worker("w0", slots=8), worker("w1", slots=8)]
    d = dispatcher(["w0", "w1"], overload_hold_s=5.0)
    q = d.queue
    assert q is not None and d.gate() is None
    q.push(held("x", 0.0), 0.0)
    q.take(q.next(0.05), 0.05)  # type: ignore[arg-type]
    q.observe_service(0.1)
    # not engaged: a worker may take any number of prompts in one pass (into free slots)
    a = d.submit(d.prepare("a", [1] * 40, 4), "", ws, 1.0)
    b = d.submit(d.prepare("b", [2] * 40, 4), "", ws, 1.0)
    c = d.submit(d.prepare("c", [3] * 40, 4), "", ws, 1.0)
    assert a is not None and b is not None and c is not None and d.gate() is None
    # a full fleet: two held, the third refused for its wait -> engaged
    full = [worker("w0", running=8, slots=8), worker("w1", running=8, slots=8)]
    assert d.submit(d.prepare("h1", [4] * 40, 4), "", full, 1.1) is None
    assert d.submit(d.prepare("h2", [5] * 40, 4), "", full, 1.1) is None
    with pytest.raises(QueueFull, match="admit_ttft_factor"):
        d.submit(d.prepare("h3", [6] * 40, 4), "", full, 1.1)
    assert d.gate() == 1
    # engaged: a, b, c have no first token yet, so neither worker can start another, slots or not
    assert not d.can_start(ws)
    assert d.pump(ws, 1.2) is None
    d.progressed("a", ok=True)
    d.progressed("b", ok=True)
    d.progressed("c", ok=True)
    first = d.pump(ws, 1.3)
    assert first is not None and first.request.request_id == "h1"
    second = d.pump(ws, 1.3)  # the other worker: the gate sends it where nothing is pending
    assert second is not None and second.decision.worker_id != first.decision.worker_id
    assert d.pump(ws, 1.3) is None and not d.can_start(ws)
    # released 5 s after the last refusal for the wait: free slots take anything again
    assert d.submit(d.prepare("late", [7] * 40, 4), "", ws, 6.2) is not None
    assert d.gate() is None


def test_the_overload_gate_settings_are_validated_with_their_names() -> None:
    with pytest.raises(ValidationError, match="overload_prefills_in_flight acts only with scheduler.enabled"):
        SchedulerConfig(enabled=False, overload_prefills_in_flight=2)
    with pytest.raises(ValidationError, match="overload_hold_s acts only"):
        SchedulerConfig(enabled=True, overload_prefills_in_flight=None, overload_hold_s=3.0)
    assert SchedulerConfig(enabled=False).overload_prefills_in_flight == 1  # the default is no error


def test_only_a_refusal_for_the_wait_counts_as_the_fleets_overload() -> None:
    q = HoldingQueue(SchedulerConfig(enabled=True, max_queued_per_key=1))
    q.push(held("k1", 0.0), 0.0)
    with pytest.raises(QueueFull, match="max_queued_per_key") as err:
        q.push(held("k2", 0.0), 0.0)  # one route key's quota: the fleet may be idle
    assert not err.value.wait


@pytest.mark.parametrize("hold", [True, False])
def test_the_wait_bounds_refuse_a_programs_first_request_but_hold_its_later_steps(hold: bool) -> None:
    # one worker with two slots; the bound measured tight (0.05 s per place, service 0.1 s): a second
    # held request is over it
    d = dispatcher(["w0"], hold_admitted_programs=hold)
    q = d.queue
    assert q is not None
    q.push(held("x", 0.0), 0.0)
    q.take(q.next(0.05), 0.05)  # type: ignore[arg-type]
    q.observe_service(0.1)
    free, full = [worker("w0", slots=2)], [worker("w0", running=2, slots=2)]
    step1 = d.submit(d.prepare("p1-a", [1] * 40, 4), "", free, 1.0, program="p1")
    assert step1 is not None and d.programs.get("p1").admitted  # type: ignore[union-attr]
    d.finished("p1", 44, 1.5, completed=True)
    for k in range(2):  # held: 1 and 2 places (0.1 s), within the bound
        assert d.submit(d.prepare(f"other{k}", [2 + k] * 40, 4), "", full, 2.0) is None
    with pytest.raises(QueueFull, match="admit_ttft_factor"):  # a new program's first request: refused
        d.submit(d.prepare("p2-a", [5] * 40, 4), "", full, 2.0, program="p2")
    assert d.programs.get("p2").in_flight == 0  # type: ignore[union-attr]  refused: no step of p2 in flight
    if hold:  # p1's next step waits for a slot instead of a 429 (the count bounds still apply)
        assert d.submit(d.prepare("p1-b", [1] * 48, 4), "", full, 2.0, program="p1") is None
        assert "p1-b" in q and len(q) == 3
        d.progressed("p1-a", ok=True)  # (the refusal engaged the overload gate: one prefill at a time)
        first = d.pump(free, 3.0)
        assert first is not None and first.request.request_id in ("other0", "other1", "p1-b")
    else:
        with pytest.raises(QueueFull, match="admit_ttft_factor"):
            d.submit(d.prepare("p1-b", [1] * 48, 4), "", full, 2.0, program="p1")
        assert "p1-b" not in q


def test_hold_admitted_programs_is_refused_where_it_would_not_act() -> None:
    with pytest.raises(ValidationError, match="hold_admitted_programs: false acts only with scheduler.enabled"):
        SchedulerConfig(enabled=False, hold_admitted_programs=False)
    with pytest.raises(ValidationError, match="a wait bound"):
        SchedulerConfig(enabled=True, hold_admitted_programs=False, max_queue_delay_s=None, admit_ttft_factor=None)
    assert not SchedulerConfig(enabled=True, hold_admitted_programs=False).hold_admitted_programs
    assert SchedulerConfig(enabled=False).hold_admitted_programs  # the default (on) is no error


def test_a_pinned_request_held_in_the_queue_goes_to_its_pin_when_pumped() -> None:
    # A stored response's read or continuation (a pin: only w1 stores it) held while every slot is taken: pumped,
    # it goes to w1, not where the router would send a new request (before: the queue's pump dropped the pin,
    # and the read reached a server that answered 404). ``pinned`` is the driver's wider set for a pin: w1
    # marked paused is out of the plain routable set, yet the pinned request still goes there.
    busy = [worker("w0", running=4), worker("w1", running=4)]
    d = dispatcher(["w0", "w1"])
    assert d.submit(d.prepare("first", [1] * 40, 8), "", busy, 0.0) is None  # held: no free slot
    assert d.submit(d.prepare("read", [2] * 40, 8), "", busy, 0.0, pin="w1") is None
    backlogged = WorkerState("w1", 16, 8192, 64, LoadReport("w1", 0.0, 40, 8, 200_000, 0, 0, 0, 1000), "both", 64)
    free = [worker("w0", slots=64), backlogged]  # the router alone sends both to w0 (w1: a long prefill backlog)
    out = [d.pump(free, 1.0), d.pump(free, 1.0)]
    assert [(o.request.request_id, o.decision.worker_id) for o in out if o] == [("first", "w0"), ("read", "w1")]
    d.submit(d.prepare("first2", [3] * 40, 8), "", busy, 2.0)
    d.submit(d.prepare("read2", [4] * 40, 8), "", busy, 2.0, pin="w1")
    unmarked = [worker("w0")]  # w1 marked paused: only w0 is routable for new work
    wider = {"w1": [worker("w0"), backlogged]}
    out = [d.pump(unmarked, 3.0, wider.__getitem__), d.pump(unmarked, 3.0, wider.__getitem__)]
    assert [(o.request.request_id, o.decision.worker_id) for o in out if o] == [("first2", "w0"), ("read2", "w1")]
