"""The cache-migration policy (transfer/migration.py): which prefixes, which target, refusals by cause."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from thunderagent.config import KvTransferConfig, MigrationConfig, RoutingConfig
from thunderagent.engine.timing import PolynomialTiming
from thunderagent.kv.index import KvIndex
from thunderagent.transfer.migration import PREFILL_EWMA, Migration, Migrator
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import LoadReport, WorkerState

BS = 64
MNBT = 8192
A = list(range(1, 513))  # 32 K tokens
B = list(range(1001, 1129))  # 8 K tokens
SHORT = list(range(2001, 2017))  # 1 K tokens: under min_prefix_tokens (2,048)
TOKEN_BYTES = 131072


def routing(**link: object) -> RoutingConfig:
    return RoutingConfig(migration=MigrationConfig(enabled=True, link=KvTransferConfig(
        enabled=True, bandwidth_gbps=200.0, **link)))  # type: ignore[arg-type]


def worker(wid: str, queued: int = 0, active: int = 0, waiting: int = 0) -> WorkerState:
    return WorkerState(wid, BS, MNBT, 64, LoadReport(wid, 0.0, 0, waiting, queued, 0, active, 0, 16384))


def setup(**link: object) -> tuple[Migrator, KvIndex]:
    r = routing(**link)
    index = KvIndex(prediction_ttl=120.0)
    for w in ("w0", "w1", "w2"):
        index.add_worker(w)
    index.resync("w0", A + B + SHORT, 0)
    return Migrator(r, TransferPlane(r.migration.link), PolynomialTiming(), BS), index


def demand(mig: Migrator, hashes: list[int], n: int, now: float = 0.0) -> None:
    for _ in range(n):
        mig.observe(hashes + [99_000 + n], len(hashes), now)  # a unique suffix past the prefix


HOT = worker("w0", queued=2 * MNBT)  # 2 passes: hot
FLEET = [HOT, worker("w1", queued=800), worker("w2")]


def test_copies_the_hot_workers_prefixes_by_demand_each_to_the_least_loaded_target():
    mig, index = setup()
    demand(mig, A, 5)
    demand(mig, B, 4)
    assert mig.tick(FLEET, index, 0.0) == []  # hot since 0.0: not sustained yet
    assert mig.tick(FLEET, index, 0.05) == []  # next look not due (interval_s 0.1)
    out = mig.tick(FLEET, index, 0.3)
    assert [(m.src, m.dst, m.blocks) for m in out] == [("w0", "w2", 512), ("w0", "w1", 128)]
    assert out[0] == Migration("migrate-1", "w0", "w2", A[-1], tuple(A), 512, 512 * BS * TOKEN_BYTES,
                               pytest.approx(5.0, rel=0.1))
    assert mig.inflight == 2 and mig.planned == 2 and mig.refusals == {}
    # in flight: not planned again
    assert mig.tick(FLEET, index, 0.5) == []


def test_a_landed_copy_is_predicted_on_the_target_and_not_copied_again():
    mig, index = setup()
    demand(mig, A, 5)
    mig.tick(FLEET, index, 0.0)
    (m,) = mig.tick(FLEET, index, 0.3)
    done = mig.finished(m.tid, True)
    mig.landed(done, index, 0.4)
    assert index.find_matches(A, 0.4) == {"w0": 512, "w2": 512}
    assert (mig.completed, mig.bytes_moved, mig.blocks_moved) == (1, m.nbytes, 512)
    assert mig.tick(FLEET, index, 0.5) == []  # a worker with room holds it now


def test_a_failed_copy_counts_and_frees_the_prefix_for_another_try():
    mig, index = setup()
    demand(mig, A, 5)
    mig.tick(FLEET, index, 0.0)
    (m,) = mig.tick(FLEET, index, 0.3)
    mig.finished(m.tid, False)
    assert (mig.failed, mig.completed, mig.inflight) == (1, 0, 0)
    (again,) = mig.tick(FLEET, index, 0.5)
    assert again.tid == "migrate-2" and again.dst == "w2"


def test_demand_below_min_demand_and_short_prefixes_are_not_copied():
    mig, index = setup()
    demand(mig, B, 1)  # decays under min_demand (1) at once
    demand(mig, SHORT, 10)  # under min_prefix_tokens: not even tracked
    assert mig.stats()["tracked_prefixes"] == 1
    mig.tick(FLEET, index, 0.0)
    assert mig.tick(FLEET, index, 0.3) == []
    # demand decays with its half-life (10 s): 3 requests 20 s ago weigh 0.75
    mig2, index2 = setup()
    demand(mig2, B, 3, now=0.0)
    assert mig2.demand(B[-1], 20.0) == pytest.approx(0.75)
    mig2.tick(FLEET, index2, 19.8)
    assert mig2.tick(FLEET, index2, 20.1) == []
    demand(mig2, B, 1, now=20.1)  # one more: 1.7
    assert len(mig2.tick(FLEET, index2, 20.3)) == 1


def test_the_skew_must_be_sustained_without_a_break():
    mig, index = setup()
    demand(mig, A, 5)
    cool = [worker("w0", queued=MNBT // 2), *FLEET[1:]]
    mig.tick(FLEET, index, 0.0)
    mig.tick(cool, index, 0.2)  # cooled down: starts afresh
    assert mig.tick(FLEET, index, 0.35) == []
    assert mig.tick(FLEET, index, 0.5) == []
    assert len(mig.tick(FLEET, index, 0.7)) == 1  # hot since 0.35


def test_a_target_a_hot_threshold_below_the_source_has_room_too():
    mig, index = setup()
    demand(mig, A, 5)
    fleet = [worker("w0", queued=3 * MNBT), worker("w1", queued=2 * MNBT - 1), worker("w2", queued=MNBT - 1)]
    mig.tick(fleet, index, 0.0)  # w0 and w1 hot; w2 (under 1 pass, 2 below w0) may take w0's prefix
    assert [m.dst for m in mig.tick(fleet, index, 0.3)] == ["w2"]
    mig2, index2 = setup()
    demand(mig2, A, 5)
    fleet[0] = worker("w0", queued=2 * MNBT - 2)  # w2 less than a pass below: no room
    mig2.tick(fleet, index2, 0.0)
    assert mig2.tick(fleet, index2, 0.3) == [] and mig2.refusals == {"no_target": 1}  # w1 has room: not its prefix


def test_busy_counts_as_hot():
    mig, index = setup()
    demand(mig, A, 5)
    busy = [worker("w0", waiting=64), *FLEET[1:]]
    mig.tick(busy, index, 0.0)
    assert [m.dst for m in mig.tick(busy, index, 0.3)] == ["w2"]


def test_a_prefix_a_worker_with_room_already_holds_is_left_to_routing():
    mig, index = setup()
    index.resync("w1", A, 0)
    demand(mig, A, 5)
    mig.tick(FLEET, index, 0.0)
    assert mig.tick(FLEET, index, 0.3) == []


def test_only_the_blocks_the_target_lacks_move():
    mig, index = setup()
    index.resync("w2", A[:100], 0)
    demand(mig, A, 5)
    mig.tick(FLEET, index, 0.0)
    (m,) = mig.tick(FLEET, index, 0.3)
    assert (m.dst, m.blocks, m.nbytes) == ("w2", 412, 412 * BS * TOKEN_BYTES)


@pytest.mark.parametrize(("fleet", "link", "cause"), [
    # nobody has room: over room_backlog_passes and less than a hot threshold below the source
    ([worker("w0", queued=MNBT + 100), worker("w1", queued=5000), worker("w2", queued=5000)], {}, "no_target"),
    (FLEET, {"bandwidth_gbps": 1.0}, "not_worth_it"),  # 4 GiB at 1 Gb/s: far slower than recomputing
    (FLEET, {"max_transfer_bytes": 1 << 30}, "too_large"),
    ([HOT, worker("w1", queued=MNBT), worker("w2", active=11_000)], {}, "target_full"),  # over 0.7 after
])
def test_refusals_by_cause(fleet, link, cause):
    r = RoutingConfig(migration=MigrationConfig(enabled=True, link=KvTransferConfig(enabled=True, **link)))
    index = KvIndex(prediction_ttl=120.0)
    for w in ("w0", "w1", "w2"):
        index.add_worker(w)
    index.resync("w0", A, 0)
    mig = Migrator(r, TransferPlane(r.migration.link), PolynomialTiming(), BS)
    demand(mig, A, 5)
    mig.tick(fleet, index, 0.0)
    assert mig.tick(fleet, index, 0.3) == []
    assert mig.refusals == {cause: 1}


def test_the_plane_cap_counts_the_copies_planned_in_the_same_look():
    mig, index = setup(max_inflight=1)
    demand(mig, A, 5)
    demand(mig, B, 4)
    mig.tick(FLEET, index, 0.0)
    assert [m.key for m in mig.tick(FLEET, index, 0.3)] == [A[-1]]
    assert mig.refusals == {"plane_busy": 1}


def test_recompute_time_is_counted_in_passes_of_the_targets_batch():
    mig, _ = setup()
    t = PolynomialTiming()
    assert mig.recompute_s(2 * MNBT + 100, MNBT) == pytest.approx(
        2 * t.pass_time(MNBT, 0, 1, False) + t.pass_time(100, 0, 1, False))


def test_a_servers_measured_prefill_rate_replaces_the_timing_model_in_worth_it():
    """A real server's own figures (computed prompt tokens, seconds in prefill; cumulative) set its recompute time:
    a slow CPU server makes a slow link's copy worth it, a fast one makes a fast link's copy not worth it."""
    r = RoutingConfig(migration=MigrationConfig(enabled=True, link=KvTransferConfig(enabled=True, bandwidth_gbps=1.0)))
    index = KvIndex(prediction_ttl=120.0)
    for w in ("w0", "w1", "w2"):
        index.add_worker(w)
    index.resync("w0", A, 0)
    mig = Migrator(r, TransferPlane(r.migration.link), PolynomialTiming(), BS)
    tokens = len(A) * BS
    assert mig.recompute_s(tokens, MNBT, "w2") == mig.recompute_s(tokens, MNBT)  # nothing measured: the model
    mig.server_prefill("w2", 10_000.0, 10.0)  # the first reading: a baseline only
    mig.server_prefill("w2", 10_500.0, 11.0)  # under MIN_PREFILL_SAMPLE_TOKENS new: not a sample yet
    assert mig.prefill_tps == {}
    mig.server_prefill("w2", 12_000.0, 14.0)  # +2,000 tokens in +4 s: 500 tokens/s
    assert mig.prefill_tps == {"w2": 500.0} and mig.recompute_s(tokens, MNBT, "w2") == tokens / 500.0
    mig.server_prefill("w2", 14_000.0, 16.0)  # +2,000 in +2 s: 1,000 tokens/s, weighed in
    assert mig.prefill_tps["w2"] == pytest.approx((1 - PREFILL_EWMA) * 500.0 + PREFILL_EWMA * 1000.0)
    mig.server_prefill("w2", 100.0, 0.1)  # restarted: a new baseline, the rate kept
    assert mig.prefill_tps["w2"] > 500.0 and mig.stats()["measured_prefill_tps"] == {"w2": 650.0}
    demand(mig, A, 5)
    mig.tick(FLEET, index, 0.0)
    (m,) = mig.tick(FLEET, index, 0.3)  # 4 GiB at 1 Gb/s (34 s) beats 32 K tokens at 650 tokens/s (50 s)
    assert m.dst == "w2" and mig.refusals == {}
    # the default link: worth it against the timing model (``test_only_the_blocks_the_target_lacks_move``), not
    # against fast servers (1e9 tokens/s)
    mig2, index2 = setup()
    for w in ("w1", "w2"):
        mig2.server_prefill(w, 0.0, 0.0)
        mig2.server_prefill(w, 1e9, 1.0)
    demand(mig2, A, 5)
    mig2.tick(FLEET, index2, 0.0)
    assert mig2.tick(FLEET, index2, 0.3) == [] and mig2.refusals == {"not_worth_it": 1}
    mig2.forget_departed({"w0", "w1"})  # w2 left: its rate goes
    assert set(mig2.prefill_tps) == {"w1"}


def test_config_is_off_by_default_and_every_knob_needs_the_switch():
    assert not RoutingConfig().migration.enabled
    with pytest.raises(ValidationError, match="routing.migration.enabled"):
        MigrationConfig(sustain_s=1.0)
    with pytest.raises(ValidationError, match="routing.migration.enabled"):
        MigrationConfig(link=KvTransferConfig(enabled=True))
    with pytest.raises(ValidationError, match="room_backlog_passes"):
        MigrationConfig(enabled=True, room_backlog_passes=1.0, hot_backlog_passes=1.0)
    # policy kv_aware only: refused where the policy is known (the simulator's run, the live router), which
    # may differ from routing.policy (sim --policy, serve --policy): tests/unit/test_sim_migration.py


def test_the_live_driver_refuses_what_it_cannot_do():
    from thunderagent.config import Config, ConfigError, ExecutionGroupConfig, NodeConfig, Policy
    from thunderagent.control.cache_migration import make_cache_migration

    def make(cfg: Config, policy: Policy = Policy.kv_aware) -> object:
        return make_cache_migration(cfg, None, {}, KvIndex(prediction_ttl=120.0), lambda: 0.0, policy)

    assert make(Config()) is None  # off
    assert make(Config(routing=routing())) is not None
    with pytest.raises(ConfigError, match="kv_aware only"):
        make(Config(routing=routing()), Policy.round_robin)
    with pytest.raises(ConfigError, match="link.enabled"):
        make(Config(routing=RoutingConfig(migration=MigrationConfig(enabled=True))))
    # vLLM servers move real KV (NIXL, kv_both: tests/engines/test_real_vllm_pd.py); other real engines cannot
    vllm = ExecutionGroupConfig(nodes=[NodeConfig(engine="vllm", endpoints=[{"url": "http://127.0.0.1:1"}])])
    assert make(Config(routing=routing(), execution_group=vllm, model="/nonexistent-model-dir")) is not None
    for engine in ("sglang", "openai"):
        other = ExecutionGroupConfig(nodes=[NodeConfig(engine=engine, endpoints=[{"url": "http://127.0.0.1:1"}])])
        with pytest.raises(ConfigError, match=f"simulated or vllm.*not engine {engine}"):
            make(Config(routing=routing(), execution_group=other, model="/nonexistent-model-dir"))


def test_max_gbps_holds_copies_to_an_average_rate():
    r = RoutingConfig(migration=MigrationConfig(enabled=True, max_gbps=30.0, link=KvTransferConfig(
        enabled=True, bandwidth_gbps=200.0)))
    index = KvIndex(prediction_ttl=120.0)
    for w in ("w0", "w1", "w2"):
        index.add_worker(w)
    index.resync("w0", A + B, 0)
    mig = Migrator(r, TransferPlane(r.migration.link), PolynomialTiming(), BS)
    demand(mig, A, 5)
    demand(mig, B, 4)
    mig.tick(FLEET, index, 0.0)
    # one second of 30 Gbit/s is 3.75 GB: A's 4.3 GB goes (the level was above zero) and B waits
    (a,) = mig.tick(FLEET, index, 0.3)
    assert a.blocks == 512 and mig.refusals == {"rate_limited": 1}
    assert mig.tick(FLEET, index, 0.4) == []  # 0.1 s refilled 0.375 GB: still below zero (-0.54 GB + 0.375)
    (b,) = mig.tick(FLEET, index, 0.5)  # 0.2 s: above zero
    assert b.blocks == 128 and mig.refusals == {"rate_limited": 2}
    with pytest.raises(ValidationError, match="max_gbps"):
        MigrationConfig(max_gbps=10.0)  # the switch off
    with pytest.raises(ValidationError, match="max_gbps"):
        MigrationConfig(enabled=True, max_gbps=0.0)


def test_a_leaving_worker_hands_its_prefixes_off_by_demand():
    mig, index = setup()
    demand(mig, A, 2)
    demand(mig, B, 5)
    demand(mig, SHORT, 9)  # under min_prefix_tokens: never copied
    index.resync("w2", B, 0)  # w2 keeps B already: nothing to hand off for it
    fleet = [worker("w0"), worker("w1", queued=800), worker("w2")]  # w0 leaving; nobody hot, no sustain needed
    out = mig.evacuate("w0", fleet, index, 0.0)
    assert [(m.src, m.dst, m.blocks) for m in out] == [("w0", "w2", 512)]  # A, to the least loaded
    assert mig.inflight == 1
    assert mig.evacuate("w0", fleet, index, 0.1) == []  # A in flight, B kept by w2
    # no worker to take them
    assert mig.evacuate("w0", [worker("w0")], index, 0.2) == [] and mig.refusals == {"no_target": 1}
