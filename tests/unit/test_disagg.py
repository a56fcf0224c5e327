"""Roles and the per-request prefill/decode decision (scheduler/disagg.py through the Dispatcher)."""

from __future__ import annotations

import random

import pytest

from thunderagent.config import DisaggConfig, KvTransferConfig, RoutingConfig, SchedulerConfig, TimingConfig
from thunderagent.engine.timing import PolynomialTiming
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter, NoWorkerAvailable
from thunderagent.scheduler.disagg import Disaggregator
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import LoadReport, WorkerState

BS = 64
TOTAL = 16384


def worker(wid: str, role: str, *, queued: int = 0, active: int = 0, waiting: int = 0) -> WorkerState:
    return WorkerState(wid, BS, 8192, 64, LoadReport(wid, 0.0, 0, waiting, queued, 0, active, active, TOTAL), role)


def dispatcher(mode: str = "conditional", disagg: bool = True, strict: bool = False,
               scheduler: SchedulerConfig | None = None, **transfer: object) -> Dispatcher:
    index = KvIndex(prediction_ttl=60.0)
    for wid in ("p0", "p1", "d0", "d1", "b0"):
        index.add_worker(wid)
    router = KvRouter(RoutingConfig(seed=1), index, random.Random(1))
    dis = None
    if disagg:
        plane = TransferPlane(KvTransferConfig(enabled=True, **transfer))
        cfg = DisaggConfig(mode=mode, min_uncached_tokens=512, max_prefill_queue_passes=2.0, max_ttft_cost_s=0.05)
        dis = Disaggregator(cfg, plane, PolynomialTiming(TimingConfig()), BS, strict=strict)
    return Dispatcher(router, BS, scheduler, dis)


def go(d: Dispatcher, workers: list[WorkerState], n: int, rid: str = "r", base: int = 0):
    req = d.prepare(rid, list(range(base, base + n)), 16)
    return d.dispatch(req, workers, 0.0)


FLEET = [worker("p0", "prefill"), worker("d0", "decode"), worker("d1", "decode")]
FAST = {"bandwidth_gbps": 400.0}


def test_prefill_workers_never_serve_end_to_end():
    d = dispatcher(disagg=False)
    fleet = [worker("p0", "prefill"), worker("d0", "decode", queued=50_000, waiting=10),
             worker("b0", "both", queued=40_000, waiting=10)]
    for k in range(10):
        out = go(d, fleet, 300, f"r{k}", base=1000 * k)
        assert out.decision.worker_id in ("d0", "b0") and out.pd is None
    assert all(c.worker_id != "p0" for c in out.decision.candidates)


def test_the_fleet_view_counts_prefill_workers_so_the_pools_split_without_a_scan():
    from thunderagent.router.candidates import FleetView
    from thunderagent.scheduler.disagg import split_pools

    view = FleetView(RoutingConfig(), [worker("d0", "decode"), worker("b0", "both")])
    assert view.prefill_workers == 0 and split_pools(view) == (view, [])  # the view itself: no copy
    view.add(worker("p0", "prefill"))
    assert view.prefill_workers == 1
    serving, pool = split_pools(view)
    assert [w.worker_id for w in serving] == ["d0", "b0"] and [w.worker_id for w in pool] == ["p0"]
    view.remove("p0")
    assert view.prefill_workers == 0 and split_pools(view)[1] == []
    d = dispatcher(disagg=False)  # a view with a prefill worker: it never serves end to end
    view.add(worker("p1", "prefill"))
    assert go(d, view, 300).decision.worker_id in ("d0", "b0")


def test_only_prefill_workers_is_no_worker():
    with pytest.raises(NoWorkerAvailable, match="no decode"):
        go(dispatcher(), [worker("p0", "prefill")], 300)


def test_never_prefills_locally():
    out = go(dispatcher("never", **FAST), FLEET, 4096)
    assert out.pd is None and "disaggregation never" in out.decision.reason


def test_always_plans_a_remote_prefill_and_predicts_on_both_workers():
    d = dispatcher("always")  # 25 Gbps default: it does not pay, always goes anyway
    out = go(d, FLEET, 4100)
    pd = out.pd
    assert pd is not None and pd.prefill_worker == "p0" and out.decision.worker_id in ("d0", "d1")
    assert pd.transfer_tokens == 64 * 64 and pd.transfer_bytes == 4096 * 131072
    assert pd.estimate_s == pytest.approx(4096 * 131072 / 3.125e9 + 0.001)
    assert pd.saved_s == pytest.approx((4.209989e-07 * 4100**2 + 1.518344e-02 * 4100 + 16.50142) / 1e3)
    held = d.index.find_matches(out.request.block_hashes, 0.0, out.request.check_hashes)
    assert held == {"p0": 64, out.decision.worker_id: 64}
    ex = out.decision.explain()
    assert ex["pd"]["prefill_worker"] == "p0" and ex["pd"]["decode_worker"] == out.decision.worker_id
    assert "prefill on p0" in out.decision.reason


def test_conditional_goes_remote_only_when_the_transfer_pays():
    slow = go(dispatcher("conditional"), FLEET, 4096)  # 172 ms to move, 86 ms of prefill saved
    assert slow.pd is None and "transfer 172.8 ms >= prefill it saves 85.8 ms" in slow.decision.reason
    fast = go(dispatcher("conditional", **FAST), FLEET, 4096)  # 11.7 ms to move
    assert fast.pd is not None and fast.pd.estimate_s == pytest.approx(4096 * 131072 / 50e9 + 0.001)


def test_conditional_short_uncached_prompts_stay_local():
    d = dispatcher("conditional", **FAST)
    out = go(d, FLEET, 512)
    assert out.pd is None and "512 uncached tokens <= min_uncached_tokens" in out.decision.reason
    assert d.disagg is not None and d.disagg.outcomes == {"short": 1}


def test_conditional_cached_on_the_decode_worker_stays_local():
    d = dispatcher("conditional", **FAST)
    first = go(d, FLEET, 4096, "a")
    again = go(d, FLEET, 4160, "b")  # the same prompt plus one block: the decode worker holds 64 blocks
    assert first.pd is not None and again.decision.worker_id == first.decision.worker_id
    assert again.pd is None and "uncached tokens" in again.decision.reason


def test_conditional_busy_prefill_pool_stays_local_always_goes_anyway():
    fleet = [worker("p0", "prefill", queued=3 * 8192), worker("d0", "decode")]
    out = go(dispatcher("conditional", **FAST), fleet, 4096)
    assert out.pd is None and "queued prefill tokens" in out.decision.reason
    assert go(dispatcher("always", **FAST), fleet, 4096).pd is not None


def test_prefill_worker_chosen_cache_aware_on_the_prefill_pool():
    d = dispatcher("always", **FAST)
    fleet = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode")]
    req = d.prepare("x", list(range(4096)), 16)
    d.index.predict("p1", req.block_hashes[:32], 0.0, req.check_hashes[:32] if req.check_hashes else None)
    assert d.dispatch(req, fleet, 0.0).pd.prefill_worker == "p1"


def test_full_plane_conditional_local_always_waits():
    d = dispatcher("conditional", max_inflight=1, **FAST)
    assert d.disagg is not None
    d.disagg.plane.start("other", "p0", "d0", 10, 0.0)
    out = go(d, FLEET, 4096)
    assert out.pd is None and "in-flight cap" in out.decision.reason
    a = dispatcher("always", max_inflight=1, **FAST)
    assert a.disagg is not None
    a.disagg.plane.start("other", "p0", "d0", 10, 0.0)
    assert go(a, FLEET, 4096).pd is not None


def test_target_memory_and_size_threshold_refuse_in_every_mode():
    full = [worker("p0", "prefill"), worker("d0", "decode", active=int(0.695 * TOTAL))]
    for mode in ("always", "conditional"):
        out = go(dispatcher(mode, **FAST), full, 8192)
        assert out.pd is None and "target_full" in out.decision.reason
        big = go(dispatcher(mode, max_transfer_bytes=1 << 20, **FAST), FLEET, 8192)
        assert big.pd is None and "too_large" in big.decision.reason


def test_strict_never_plans_a_local_prefill_it_refuses_and_forgets_the_decode_prediction():
    """``routing.fallback_to_local: false``: where mode always would prefill on the decode worker for
    want of room or of a prefill worker, the dispatch raises (the request waits or is refused) and the
    blocks the router predicted on the decode worker are dropped again; a prompt the decode worker
    holds in full still runs there."""
    full = [worker("p0", "prefill"), worker("d0", "decode", active=int(0.695 * TOTAL))]
    d = dispatcher("always", strict=True, **FAST)
    with pytest.raises(NoWorkerAvailable, match="target_full.*fallback_to_local is false"):
        go(d, full, 8192)
    assert d.router.index.num_blocks("d0") == 0, "the refused route's prediction is gone"
    big = dispatcher("always", strict=True, max_transfer_bytes=1 << 20, **FAST)
    with pytest.raises(NoWorkerAvailable, match="too_large"):
        go(big, FLEET, 8192)
    assert big.disagg is not None and big.disagg.outcomes == {"refused_too_large": 1}
    with pytest.raises(NoWorkerAvailable, match="no prefill worker is routable"):
        go(d, [worker("d0", "decode"), worker("d1", "decode")], 8192)
    ok = go(d, FLEET, 4096, rid="a")
    assert ok.pd is not None and ok.pd.prefill_worker == "p0"
    # the same prompt again: its decode worker holds every full block, nothing to move or prefill
    again = go(d, FLEET, 4096, rid="b")
    assert again.pd is None and "holds every full block" in again.decision.reason
    assert d.disagg is not None and d.disagg.outcomes == {"refused_target_full": 1, "remote": 1, "cached": 1}


def test_a_held_request_that_cannot_be_routed_stays_first_in_line():
    """A released request whose dispatch raises (strict disaggregation with no prefill worker) is not
    dropped: the next pump routes it once a prefill worker is back."""
    from thunderagent.scheduler.queue import Held

    d = dispatcher("always", strict=True, **FAST)
    req = d.prepare("r", list(range(4096)), 16)
    d._ready.append(Held(req, "k", 0, 0.0, 4096, None))
    decode_only = [worker("d0", "decode"), worker("d1", "decode")]
    with pytest.raises(NoWorkerAvailable):
        d.pump(decode_only, 0.0)
    assert [h.req.request_id for h in d._ready] == ["r"]
    out = d.pump(FLEET, 1.0)
    assert out is not None and out.request.request_id == "r" and out.pd is not None and not d._ready


def test_always_holds_requests_while_the_prefill_tier_is_backlogged():
    """With every request prefilled on the prefill tier, the decode workers look free whatever that tier's
    queue: requests wait in the scheduler (bounded, ordered, refusable) until a prefill worker's backlog is
    under ``engine_backlog_passes`` passes. One above the default priority goes on the decode tier's room
    (the prefill engine's priority queue lets it overtake there); conditional mode is not gated (it prefills
    locally when the prefill tier is backlogged)."""
    sched = SchedulerConfig(enabled=True, engine_backlog_passes=1.0)
    d = dispatcher("always", scheduler=sched, **FAST)
    backlogged = [worker("p0", "prefill", queued=8192), worker("d0", "decode"), worker("d1", "decode")]
    low = d.prepare("low", list(range(4096)), 16)
    assert d.submit(low, "k", backlogged, 0.0) is None and d.held() == 1  # a full pass queued: held
    assert d.pump(backlogged, 0.1) is None
    high = d.prepare("high", list(range(10_000, 14_096)), 16, priority=1)
    assert d.submit(high, "k", backlogged, 0.2) is None  # queued behind "low" (drivers pump after a submit)
    out = d.pump(backlogged, 0.2)  # it outranks "low", and its tier does not wait for the prefill tier's room
    assert out is not None and out.request.request_id == "high" and out.pd is not None
    assert out.pd.prefill_worker == "p0" and d.held() == 1
    assert d.pump(backlogged, 0.25) is None  # "low" still waits
    drained = [worker("p0", "prefill", queued=8191), worker("d0", "decode"), worker("d1", "decode")]
    out = d.pump(drained, 0.3)
    assert out is not None and out.request.request_id == "low" and out.pd is not None and d.held() == 0
    assert out.queue_wait == pytest.approx(0.3)
    # another prefill worker with room is enough; a busy one is not room
    two = [worker("p0", "prefill", queued=50_000), worker("p1", "prefill", waiting=64), worker("d0", "decode")]
    assert d.submit(d.prepare("x", list(range(20_000, 24_096)), 16), "k", two, 1.0) is None
    two[1] = worker("p1", "prefill")
    assert d.pump(two, 1.1) is not None
    cond = dispatcher("conditional", scheduler=sched, **FAST)
    assert cond.submit(cond.prepare("c", list(range(4096)), 16), "k", backlogged, 0.0) is not None


def test_always_high_priority_waits_only_for_work_of_its_priority_or_higher():
    """A request above the default priority skips the lower tiers' backlog, but not the work of its own tier
    or higher that this gate sent the prefill worker (counted until its first token): past one pass more than
    ``engine_backlog_passes`` of it, a flood of high-priority requests is held too."""
    sched = SchedulerConfig(enabled=True, engine_backlog_passes=1.0)
    d = dispatcher("always", scheduler=sched, **FAST)
    gate = d.prefill_gate
    assert gate is not None
    fleet = [worker("p0", "prefill", queued=50_000), worker("d0", "decode"), worker("d1", "decode")]

    def high(i: int, priority: int = 1):  # type: ignore[no-untyped-def]
        return d.prepare(f"h{i}", list(range(100_000 * (i + 1), 100_000 * (i + 1) + 8192)), 16, priority=priority)

    first, second = d.submit(high(0), "k", fleet, 0.0), d.submit(high(1), "k", fleet, 0.0)
    assert first is not None and second is not None and gate.pending() == 2  # 16,384 tokens: 2 x 8,192 ahead
    assert d.submit(high(2), "k", fleet, 0.1) is None  # held behind its own tier's work
    assert d.pump(fleet, 0.1) is None
    top = d.submit(high(3, priority=2), "k", fleet, 0.1)  # queued behind h2 (drivers pump next) ...
    assert top is None
    out = d.pump(fleet, 0.1)  # ... and it outranks all the priority-1 work ahead there
    assert out is not None and out.request.request_id == "h3"
    assert d.progressed("h0", ok=True) == 1  # its first token: the driver should pump ...
    assert d.pump(fleet, 0.2) is None  # ... but h1 and h3 (priority 2 is ahead of priority 1 too) fill the bound
    d.progressed("h3", ok=True)
    out = d.pump(fleet, 0.3)
    assert out is not None and out.request.request_id == "h2" and d.held() == 0
    d.retract(out)  # it never ran there: not counted any more
    d.progressed("h1", ok=False)
    assert gate.pending() == 0


def test_strict_a_held_request_that_can_never_fit_or_waited_max_wait_s_is_refused_not_held_for_good():
    """Strict: a held request whose KV exceeds what its decode worker may take even empty is refused at once
    (``HeldRefused``, out of the queue); one refused for want of room stays first in line until it has waited
    ``max_wait_s``, then is refused."""
    from thunderagent.router.errors import HeldRefused

    sched = SchedulerConfig(enabled=True, max_wait_s=10.0)
    d = dispatcher("always", strict=True, scheduler=sched, **FAST)
    backlogged = [worker("p0", "prefill", queued=8192), worker("d0", "decode")]
    room = [worker("p0", "prefill"), worker("d0", "decode")]
    huge = d.prepare("huge", list(range(0, 64 * 16_000)), 16)  # 16,000 blocks: more than 0.8 x 16,384 blocks
    small = d.prepare("small", list(range(2_000_000, 2_004_096)), 16)
    assert d.submit(huge, "k", backlogged, 0.0) is None and d.submit(small, "k", backlogged, 0.0) is None
    out = d.pump(room, 1.0)  # (the shorter one first)
    assert out is not None and out.request.request_id == "small" and out.pd is not None
    with pytest.raises(HeldRefused) as err:
        d.pump(room, 1.0)
    assert err.value.request_id == "huge" and "transfer refused" in str(err.value) and d.held() == 0
    # for want of room only (the decode worker nearly full now): first in line, then refused at max_wait_s
    busy = d.prepare("busy", list(range(3_000_000, 3_004_096)), 16)
    assert d.submit(busy, "k", backlogged, 2.0) is None
    full = [worker("p0", "prefill"), worker("d0", "decode", active=16_000)]
    with pytest.raises(NoWorkerAvailable) as err:
        d.pump(full, 5.0)
    assert not isinstance(err.value, HeldRefused) and d.held() == 1
    with pytest.raises(HeldRefused):
        d.pump(full, 12.0)
    assert d.held() == 0


def test_make_disaggregator_from_the_example_config():
    from pathlib import Path

    from thunderagent.config import Config, load_config
    from thunderagent.scheduler.disagg import make_disaggregator

    assert make_disaggregator(Config()) is None  # no prefill group: nothing to decide
    dis = make_disaggregator(load_config(Path(__file__).resolve().parents[2] / "configs" / "disagg.yaml"))
    assert dis is not None and dis.cfg.mode == "conditional"
    assert dis.plane.default_bps == 400e9 / 8 and dis.plane.cfg.max_inflight == 4
