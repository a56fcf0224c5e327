"""The transfer plane: caps with backpressure, admission, per-link estimates, counters."""

from __future__ import annotations

import pytest

from thunderagent.config import KvTransferConfig
from thunderagent.transfer.plane import TransferPlane


def plane(**kw: object) -> TransferPlane:
    return TransferPlane(KvTransferConfig(enabled=True, **kw))


def test_estimate_is_bytes_over_bandwidth_plus_latency():
    p = plane(bandwidth_gbps=8.0, latency_s=0.002)  # 1 GB/s
    assert p.estimate("a", "b", 10**9) == pytest.approx(1.002)
    assert p.bytes_for(100) == 100 * 131072


def test_measured_bandwidth_replaces_the_default_by_ewma():
    p = plane(bandwidth_gbps=8.0, latency_s=0.0, ewma_alpha=0.5)
    t = p.start("r", "a", "b", 10**9, 0.0)
    assert t is not None and t.estimate_s == pytest.approx(1.0)
    p.finish("r", 2.0, ok=True)  # measured 0.5 GB/s
    assert p.links[("a", "b")].bandwidth_bps == pytest.approx(0.75e9)
    assert p.estimate("a", "b", 10**9) == pytest.approx(1 / 0.75)
    assert p.estimate("b", "a", 10**9) == pytest.approx(1.0)  # another link keeps the default
    assert p.stats.completed == 1 and p.stats.bytes_moved == 10**9


def test_size_threshold_and_target_watermark():
    p = plane(max_transfer_bytes=1000, target_watermark=0.7)
    assert p.refusal(1001, 1, 0, 100) == "too_large"
    assert p.refusal(1000, 10, 60, 100) is None  # 70 active after the move: at the watermark, allowed
    assert p.refusal(1000, 11, 60, 100) == "target_full"
    assert p.refusal(1000, 1, 70, 100) == "target_full"


def test_cap_in_transfers_queues_and_finish_starts_the_next():
    p = plane(max_inflight=2)
    assert p.start("a", "p", "d", 10, 0.0) is not None
    assert p.start("b", "p", "d", 10, 0.0) is not None
    assert not p.room(10)
    assert p.start("c", "p", "d", 10, 0.1) is None  # waits
    assert p.stats.waited == 1
    started = p.finish("a", 0.5, ok=True)
    assert [t.tid for t in started] == ["c"] and started[0].started_at == 0.5 and started[0].queued_at == 0.1
    assert set(p.inflight) == {"b", "c"}


def test_cap_in_bytes():
    p = plane(max_inflight=8, max_inflight_bytes=100, max_transfer_bytes=100)
    assert p.start("a", "p", "d", 60, 0.0) is not None
    assert p.start("b", "p", "d", 50, 0.0) is None  # 110 > 100
    assert p.start("c", "p", "d", 10, 0.0) is None  # FIFO: nothing overtakes a waiting transfer
    assert [t.tid for t in p.finish("a", 1.0, ok=True)] == ["b", "c"]
    assert p.inflight_bytes == 60


def test_failures_and_fallbacks_by_cause():
    p = plane()
    p.start("a", "p", "d", 10, 0.0)
    p.start("b", "p", "d", 10, 0.0)
    p.finish("a", 1.0, ok=False, cause="timeout")
    p.finish("b", 1.0, ok=False, cause="interrupted")
    p.fallback("timeout")
    p.fallback("interrupted")
    p.fallback("target_full")
    assert p.stats.failures == {"timeout": 1, "interrupted": 1}
    assert p.stats.fallbacks == {"timeout": 1, "interrupted": 1, "target_full": 1}
    assert p.stats.completed == 0 and not p.inflight and p.links == {}  # failures teach the link nothing


def test_deadline_is_timeout_factor_times_the_estimate():
    p = plane(bandwidth_gbps=8.0, latency_s=0.0, timeout_factor=3.0)
    t = p.start("a", "p", "d", 10**9, 2.0)
    assert t is not None and t.deadline == pytest.approx(5.0)


def test_burst_of_64_long_prompts_never_exceeds_the_caps():
    cap, cap_bytes = 4, 3 * 2 << 30
    p = plane(max_inflight=cap, max_inflight_bytes=cap_bytes)
    size = [(1 + k % 3) << 30 for k in range(64)]  # 1..3 GiB each
    live: list[str] = []
    for k in range(64):
        if p.start(f"r{k}", "p", "d", size[k], 0.0) is not None:
            live.append(f"r{k}")
        assert len(p.inflight) <= cap and p.inflight_bytes <= cap_bytes
    done, now = 0, 0.0
    while p.inflight:
        now += 1.0
        tid = next(iter(p.inflight))
        p.finish(tid, now, ok=True)
        done += 1
        assert len(p.inflight) <= cap and p.inflight_bytes <= cap_bytes
    assert done == 64 and not p.queue
    assert p.stats.peak_inflight <= cap and p.stats.peak_inflight_bytes <= cap_bytes
    assert p.stats.started == 64 and p.stats.waited == 64 - len(live)


def test_duplicate_start_is_a_caller_bug():
    p = plane()
    p.start("a", "p", "d", 10, 0.0)
    with pytest.raises(ValueError, match="already started"):
        p.start("a", "p", "d", 10, 0.0)


def test_a_learned_sample_of_several_transfers_takes_each_ones_latency_off():
    p = plane(bandwidth_gbps=8.0, latency_s=0.01, ewma_alpha=1.0)
    p.learn("a", "b", 4 * 10**8, 0.44, transfers=4)  # 0.44 s for 4 transfers, 0.01 s of latency each: 1 GB/s
    assert p.links[("a", "b")].bandwidth_bps == pytest.approx(1e9) and p.links[("a", "b")].samples == 1
    p.learn("a", "b", 10**6, 0.03, transfers=4)  # faster than the latency alone: nothing to learn from
    assert p.links[("a", "b")].bandwidth_bps == pytest.approx(1e9) and p.links[("a", "b")].samples == 1


def _observer(**kw: object):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from thunderagent.control.metrics import Metrics
    from thunderagent.control.pd_plane import PlaneObserver
    from thunderagent.control.registry import WorkerRegistry
    from thunderagent.types import WorkerInfo

    reg = WorkerRegistry(1.0, 3)
    for w in ("p0", "p1", "d0", "d1"):
        reg.register(WorkerInfo(w, "both", 16, 2048, 8, 1000), 0.0)
    obs = PlaneObserver(SimpleNamespace(plane=plane(**kw), strict=False), Metrics(), reg)  # type: ignore[arg-type]
    return obs, reg


def _land(obs, src: str, dst: str, now: float) -> None:  # type: ignore[no-untyped-def]
    from thunderagent.types import PdPlan

    plan = PdPlan(src, 64, 10**6, 0.0, 0.0, "test")
    assert obs.on_transfer_start(f"{src}-{dst}-{now}", plan, dst, now)
    obs.on_transfer_end(f"{src}-{dst}-{now}", plan, True, "ok", 10**6, 0.5, now + 0.5)  # (a server's: no pull)


def test_a_decode_servers_nixl_readings_teach_the_links_of_the_plans_that_landed_there():
    """vLLM's NIXL metrics on a decode server (``LinkLearner.on_server_pulls``): what grew between two readings is
    one sample of the links into it from the prefill workers whose plans landed there lately; a plan's own duration
    (prefill included) teaches nothing."""
    obs, reg = _observer(bandwidth_gbps=8.0, latency_s=0.0, ewma_alpha=1.0)
    links = obs.plane.links
    obs.learner.on_server_pulls("d0", 0.0, 0.0, 0.0, 1.0)  # the first reading: a baseline
    _land(obs, "p0", "d0", 2.0)
    assert links == {}  # the plan's 0.5 s taught nothing
    obs.learner.on_server_pulls("d0", 2e8, 0.1, 2.0, 3.0)  # 200 MB in 0.1 s: 2 GB/s
    assert links[("p0", "d0")].bandwidth_bps == pytest.approx(2e9) and links[("p0", "d0")].samples == 1
    obs.learner.on_server_pulls("d0", 2e8, 0.1, 2.0, 4.0)  # nothing new: nothing learned
    assert links[("p0", "d0")].samples == 1
    # two sources lately: each of their links learns the server's mean rate
    _land(obs, "p1", "d0", 5.0)
    obs.learner.on_server_pulls("d0", 3e8, 0.2, 3.0, 6.0)  # +100 MB in +0.1 s: 1 GB/s
    assert links[("p0", "d0")].bandwidth_bps == pytest.approx(1e9) and links[("p1", "d0")].bandwidth_bps == 1e9
    # a landing older than LANDED_WINDOW_S no longer counts; a server restart (its sums fall) is a new baseline
    from thunderagent.control.link_learning import LANDED_WINDOW_S

    obs.learner.on_server_pulls("d0", 4e8, 0.3, 4.0, 3.5 + LANDED_WINDOW_S)  # p0 landed at 2.5, p1 at 5.5
    assert links[("p0", "d0")].samples == 2 and links[("p1", "d0")].samples == 2
    _land(obs, "p0", "d0", 100.0)
    obs.learner.on_server_pulls("d0", 1e8, 0.4, 1.0, 101.0)  # restarted: baseline only
    assert links[("p0", "d0")].samples == 2
    obs.learner.on_server_pulls("d0", 1.5e8, 0.6, 2.0, 102.0)  # +50 MB in +0.2 s: 0.25 GB/s
    assert links[("p0", "d0")].bandwidth_bps == pytest.approx(2.5e8) and links[("p0", "d0")].samples == 3
    # another decode server's readings teach only its own links; a prefill server reads zeros
    obs.learner.on_server_pulls("p0", 0.0, 0.0, 0.0, 103.0)
    obs.learner.on_server_pulls("d1", 0.0, 0.0, 0.0, 103.0)
    obs.learner.on_server_pulls("d1", 1e6, 0.1, 1.0, 104.0)  # nothing landed on d1: no link to teach
    assert set(links) == {("p0", "d0"), ("p1", "d0")}
    assert obs.metrics.pd_links_learned.labels("server")._value.get() == 5
    assert [(x["src"], x["dst"], x["samples"]) for x in obs.links()] == [("p0", "d0", 3), ("p1", "d0", 2)]
    assert obs.links()[0]["bandwidth_gbps"] == pytest.approx(2.0)
    # workers that left: their readings go at the next prune
    reg.deregister("d0")
    from thunderagent.control.link_learning import PRUNE_EVERY

    for k in range(PRUNE_EVERY):
        obs.learner.on_server_pulls("d1", 1e6, 0.1, 1.0, 105.0 + k)
    assert set(obs.learner._pulls) == {"p0", "d1"} and "d0" not in obs.learner._landed
