"""NatsFleet's membership, leases, dumps and request fate, on an in-memory bus (no NATS, no sleeps).

The fleet's clock is injected and moved by the test, so lease expiry and stall timeouts are exact.
"""

from __future__ import annotations

import asyncio

import pytest

from thunderagent.config import parse_config
from thunderagent.bus.nats import BusMsg
from thunderagent.bus import wire
from thunderagent.bus.wire_admin import HeldAbort, HeldAborted
from thunderagent.kv.hashing import block_hashes
from thunderagent.assemble import build_nats_fleet
from thunderagent.control.fleet import Fleet
from thunderagent.frontend.streaming import stream_text
from thunderagent.frontend.tokenizer import ByteTokenizer
from thunderagent.types import BlockStored, LoadReport

from fake_bus import FakeBus  # noqa: E402  (tests/unit is on sys.path)
from support.clock import ManualClock

BS = 64


def heartbeat(wid: str, instance: str = "i1", last_seq: int = -1, queued: int = 0) -> bytes:
    info = wire.WireInfo(wid, "both", "simulated", BS, 8192, 64, 1000)
    load = wire.WireLoad(0.0, 0, 0, queued, 0, 0, 0, 1000)
    return wire.encode(wire.Heartbeat(wire.WIRE_VERSION, instance, info, load, last_seq))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def fleet(clock: ManualClock):
    cfg = parse_config({"control_plane": {"heartbeat_interval": 1.0, "heartbeat_misses": 3,
                                          "health_check_enabled": False},  # the test calls check_health
                        "routing": {"seed": 1}, "execution_group": {"nodes": [{"block_size": BS}]},
                        "scheduler": {"enabled": False}})  # requests go straight to workers: no held ones to pump
    f = build_nats_fleet(cfg, FakeBus(), discovery_window=0.0, clock=clock)
    await f.start()
    f.bus = f.membership.bus  # type: ignore[attr-defined]  (shorthands for the tests below)
    f.fid = f.membership.frontend_id  # type: ignore[attr-defined]
    yield f
    await f.stop()


def text_of(f: Fleet, gen):
    return stream_text(f.outputs(gen), ByteTokenizer().decoder(), [])


async def deliver(f: Fleet, subject: str, data: bytes) -> None:
    await f.bus.subs["ta.worker.>"](BusMsg(subject, data))
    for _ in range(3):  # let dump tasks run (no wall-clock wait)
        await asyncio.sleep(0)


async def stream_msg(f: Fleet, rid: str, batch: wire.TokenBatch | None, wid: str | None = None) -> None:
    """A stream message of request ``rid`` from worker ``wid`` (default: the worker serving it)."""
    data = b"" if batch is None else wire.encode(batch)
    if wid is None:
        owner = f.membership.link.owners.get(rid)
        wid = "w1" if owner is None else owner.worker_id
    subject = wire.Subjects().reply(wid, f.fid, rid)
    await f.bus.subs[f"ta.reply.*.{f.fid}.*"](BusMsg(subject, data, no_responders=batch is None))


def accepted(n: int = 0) -> wire.TokenBatch:
    return wire.TokenBatch(n, [])


async def test_start_asks_workers_to_announce_themselves(fleet):
    assert fleet.bus.published[0] == ("ta.discover", b"", "")
    assert set(fleet.bus.subs) == {"ta.worker.>", f"ta.reply.*.{fleet.fid}.*", "ta.programs.release",
                                   "ta.frontend.*.hb",  # the other frontends: who acts for the planner
                                   "ta.frontend.abort_held"}  # another frontend's /abort_requests
    assert fleet.membership.index_rebuild_s is not None


async def test_an_abort_through_another_frontend_is_answered_with_how_many_it_ended(fleet):
    on_abort = fleet.bus.subs["ta.frontend.abort_held"]
    n = len(fleet.bus.published)
    await on_abort(BusMsg("ta.frontend.abort_held", wire.encode(HeldAbort(fleet.fid, None)), "r0"))
    await on_abort(BusMsg("ta.frontend.abort_held", b"\x01garbage", "r1"))
    assert len(fleet.bus.published) == n  # our own ask, and an undecodable one: no answer
    await on_abort(BusMsg("ta.frontend.abort_held", wire.encode(HeldAbort("other", ["rid-1"])), "r2"))
    assert fleet.bus.published[-1] == ("r2", wire.encode(HeldAborted(0)), "")  # (it held none)
    assert await fleet.membership.aborts.abort_elsewhere(None) == 0  # no other frontend heard: nobody to ask
    assert len(fleet.bus.published) == n + 1


async def test_a_release_through_another_frontend_releases_this_frontends_copy(fleet, clock):
    for key in ("p1", "acme/p2"):
        fleet.programs.request_started(key, clock(), tenant=key.partition("/")[0] if "/" in key else None)
        fleet.programs.request_finished(key, 10, clock(), completed=True)
    on_release = fleet.bus.subs["ta.programs.release"]
    await on_release(BusMsg("ta.programs.release", wire.encode(wire.ProgramRelease(fleet.fid, "p1")), "r0"))
    assert fleet.programs.get("p1") is not None and fleet.bus.published[-1][0] != "r0"  # our own: ignored
    await on_release(BusMsg("ta.programs.release", wire.encode(wire.ProgramRelease("other", "p1")), "r1"))
    assert fleet.programs.get("p1") is None and fleet.bus.published[-1] == ("r1", b"released", "")
    n = len(fleet.bus.published)
    await on_release(BusMsg("ta.programs.release", wire.encode(wire.ProgramRelease("other", "p1")), "r2"))
    await on_release(BusMsg("ta.programs.release", b"\x01garbage", "r3"))
    assert len(fleet.bus.published) == n  # held no copy (or undecodable): no answer
    fleet.membership.peers.tell("acme/p2")  # this frontend's client released its copy: the others hear it
    assert wire.decode_program_release(fleet.bus.published[-1][1]) == wire.ProgramRelease(fleet.fid, "acme/p2")
    assert fleet.programs.get("acme/p2") is not None  # (tell only tells)
    assert await fleet.membership.peers.release_elsewhere("acme/p3") is False  # nobody answers
    assert fleet.membership.summary()["frontend"]["programs_released_for_peers"] == 1


async def test_heartbeat_registers_worker_and_dump_fills_index(fleet):
    fleet.bus.dumps["w1"] = ("i1", [11, 12], 4)
    await deliver(fleet, "ta.worker.w1.hello", heartbeat("w1", last_seq=4))
    assert fleet.registry.worker_ids() == ["w1"]
    assert fleet.index.num_blocks("w1") == 2 and fleet.index.last_seq("w1") == 4
    assert fleet.membership.dumps_applied == 1
    # events continue from the dump's seq
    batch = wire.KvBatch("i1", wire.events_to_wire([BlockStored("w1", 5, (13,))]))
    await deliver(fleet, "ta.worker.w1.kv", wire.encode(batch))
    assert fleet.index.num_blocks("w1") == 3
    # events of another instance (a stale process) are ignored
    stale = wire.KvBatch("old", wire.events_to_wire([BlockStored("w1", 6, (14,))]))
    await deliver(fleet, "ta.worker.w1.kv", wire.encode(stale))
    assert fleet.index.num_blocks("w1") == 3


async def test_lease_expiry_removes_worker_and_its_index_entries(fleet, clock):
    fleet.bus.dumps["w1"] = ("i1", [11], 0)
    fleet.bus.dumps["w2"] = ("i1", [], -1)
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1", last_seq=0))
    await deliver(fleet, "ta.worker.w2.hb", heartbeat("w2"))
    clock.t += 2.9
    await deliver(fleet, "ta.worker.w2.hb", heartbeat("w2"))
    clock.t += 0.2  # w1: 3.1 s since its heartbeat, lease is 3 x 1.0 s
    fleet.check_health()
    assert fleet.registry.worker_ids() == ["w2"]
    assert "w1" not in fleet.workers and fleet.index.num_blocks() == 0
    # it comes back (same process, e.g. after a network partition): re-registered and re-dumped
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1", last_seq=0))
    assert sorted(fleet.registry.worker_ids()) == ["w1", "w2"] and fleet.index.num_blocks("w1") == 1


async def test_bye_and_restart_with_new_instance(fleet):
    fleet.bus.dumps["w1"] = ("i1", [11], 0)
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1", last_seq=0))
    fleet.bus.dumps["w1"] = ("i2", [], -1)
    await deliver(fleet, "ta.worker.w1.hello", heartbeat("w1", instance="i2"))  # restarted: new cache
    assert fleet.workers["w1"].instance == "i2" and fleet.index.num_blocks("w1") == 0
    await deliver(fleet, "ta.worker.w1.bye", wire.encode(wire.Bye("i1")))  # the old one's bye: ignored
    assert "w1" in fleet.workers
    await deliver(fleet, "ta.worker.w1.bye", wire.encode(wire.Bye("i2")))
    assert fleet.registry.worker_ids() == [] and "w1" not in fleet.workers


async def test_mismatched_block_size_or_version_is_ignored(fleet):
    info = wire.WireInfo("w9", "both", "simulated", 32, 8192, 64, 1000)
    hb = wire.Heartbeat(wire.WIRE_VERSION, "i", info, wire.WireLoad(0, 0, 0, 0, 0, 0, 0, 1000), -1)
    await deliver(fleet, "ta.worker.w9.hb", wire.encode(hb))
    hb2 = wire.Heartbeat(wire.WIRE_VERSION + 1, "i", info, hb.load, -1)
    await deliver(fleet, "ta.worker.w9.hb", wire.encode(hb2))
    assert fleet.registry.worker_ids() == []


async def test_lost_event_tail_seen_in_heartbeat_triggers_a_dump(fleet):
    fleet.bus.dumps["w1"] = ("i1", [1], 0)
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1", last_seq=0))
    fleet.bus.dumps["w1"] = ("i1", [1, 2, 3], 2)
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1", last_seq=2))  # events 1, 2 never arrived
    assert fleet.membership.dumps_applied == 2 and fleet.index.num_blocks("w1") == 3


async def test_request_stream_outputs_and_abort(fleet):
    fleet.bus.dumps["w1"] = ("i1", [], -1)
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1"))
    gen = await fleet.start_generation(list(range(130)), 4)
    subject, data, reply = fleet.bus.sent("generate")[-1]
    assert subject == "ta.rpc.w1.generate" and reply == f"ta.reply.w1.{fleet.fid}.{gen.request_id}"
    assert wire.request_from_wire(wire.decode_generate(data)).block_hashes == block_hashes(list(range(130)), BS)
    assert fleet.workers["w1"].load().waiting == 1  # counted until the worker reports it
    await stream_msg(fleet, gen.request_id, accepted())
    tok = wire.WireToken([65, 66], 1.0, 130, 64, False, None, None)
    await stream_msg(fleet, gen.request_id, wire.TokenBatch(1, [tok]))
    assert gen.queue.get_nowait().token_ids == [65, 66]
    gen.worker.abort(gen.request_id)
    assert wire.decode_abort(fleet.bus.sent("abort")[-1][1]).request_id == gen.request_id
    await stream_msg(fleet, gen.request_id, wire.TokenBatch(2, [tok]))  # late output after abort: dropped
    assert gen.queue.empty()


async def test_lost_worker_ends_accepted_requests_and_reroutes_unaccepted_ones(fleet, clock):
    lost, other = "w1", "w2"
    fleet.bus.dumps[lost] = fleet.bus.dumps[other] = ("i1", [], -1)
    await deliver(fleet, f"ta.worker.{lost}.hb", heartbeat(lost))
    await deliver(fleet, f"ta.worker.{other}.hb", heartbeat(other, queued=100_000))  # busy: both go to w1
    g1 = await fleet.start_generation(list(range(100)), 4)
    g2 = await fleet.start_generation(list(range(200, 300)), 4)
    assert g1.decision.worker_id == g2.decision.worker_id == lost
    await stream_msg(fleet, g1.request_id, accepted())  # g1 started; g2 not yet
    text = asyncio.create_task(anext(text_of(fleet, g2)))
    clock.t += 3.5
    await deliver(fleet, f"ta.worker.{other}.hb", heartbeat(other, queued=100_000))
    fleet.check_health()
    assert lost not in fleet.workers
    out = g1.queue.get_nowait()
    assert out.finished and out.finish_reason == "error"
    # g2 ends "unavailable" on the lost worker; the fleet routes it to the other one
    await asyncio.sleep(0)
    assert g2.decision.worker_id == other and g2.worker is fleet.workers[other]
    assert fleet.bus.sent("generate")[-1][0] == f"ta.rpc.{other}.generate"
    await stream_msg(fleet, g2.request_id, accepted())
    await stream_msg(fleet, g2.request_id, wire.TokenBatch(1, [wire.WireToken([72, 105], 1.0, 100, 0, True,
                                                                              "length", None)]))
    chunk = await asyncio.wait_for(text, 1)
    assert (chunk.text, chunk.finish_reason) == ("Hi", "length")


async def test_no_responders_drops_worker_and_reroutes_at_once(fleet):
    for w in ("w1", "w2"):
        fleet.bus.dumps[w] = ("i1", [], -1)
        await deliver(fleet, f"ta.worker.{w}.hb", heartbeat(w))
    gen = await fleet.start_generation(list(range(100)), 4)
    first = gen.decision.worker_id
    text = asyncio.create_task(anext(text_of(fleet, gen)))
    await stream_msg(fleet, gen.request_id, None)  # NATS: nobody listens on that worker's subject
    await asyncio.sleep(0)
    assert first not in fleet.workers and gen.decision.worker_id != first
    await stream_msg(fleet, gen.request_id, None)  # the second one is gone too: nobody left
    chunk = await asyncio.wait_for(text, 1)
    assert chunk.finish_reason == "unavailable" and not fleet.workers


async def test_silent_stream_and_lost_messages_end_with_error(fleet, clock):
    fleet.bus.dumps["w1"] = ("i1", [], -1)
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1"))
    g1 = await fleet.start_generation(list(range(100)), 4)
    g2 = await fleet.start_generation(list(range(300, 400)), 4)
    await stream_msg(fleet, g1.request_id, accepted())
    await stream_msg(fleet, g2.request_id, accepted())
    await stream_msg(fleet, g2.request_id, accepted(2))  # message 1 lost
    assert g2.queue.get_nowait().finish_reason == "error"
    clock.t += wire.STALL_TIMEOUT_S - 0.5
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1"))
    fleet.check_health()
    assert g1.queue.empty()  # keepalives would have come by now; none did, but not yet too late
    clock.t += 1.0
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1"))
    fleet.check_health()
    assert g1.queue.get_nowait().finish_reason == "error"
    aborted = {wire.decode_abort(d).request_id for _, d, _ in fleet.bus.sent("abort")}
    assert aborted == {g1.request_id, g2.request_id}


async def test_bye_leaves_routing_at_once_but_drains_requests_in_flight(fleet):
    for w in ("w1", "w2"):
        fleet.bus.dumps[w] = ("i1", [1], 0)
        await deliver(fleet, f"ta.worker.{w}.hb", heartbeat(w, last_seq=0))
    gen = await fleet.start_generation(list(range(100)), 4)
    wid = gen.decision.worker_id
    await stream_msg(fleet, gen.request_id, accepted())
    fleet.outliers.ended(wid, 0.0, ok=False)  # a breaker of its own
    await deliver(fleet, f"ta.worker.{wid}.bye", wire.encode(wire.Bye("i1")))
    assert wid not in fleet.workers and wid not in fleet.registry.worker_ids()
    assert wid not in {w for w, _, _ in fleet.outliers.breakers.states()}  # forgotten with it
    assert fleet.index.num_blocks(wid) == 0
    assert gen.queue.empty()  # still streaming
    tok = wire.WireToken([65], 1.0, 100, 0, True, "length", None)
    await stream_msg(fleet, gen.request_id, wire.TokenBatch(1, [tok]))
    assert gen.queue.get_nowait().finish_reason == "length"
    fleet.check_health()
    assert fleet.membership.link.owners == {}  # nothing left draining


async def test_worker_reporting_unavailable_leaves_routing_until_its_next_heartbeat(fleet):
    for w in ("w1", "w2"):
        fleet.bus.dumps[w] = ("i1", [], -1)
        await deliver(fleet, f"ta.worker.{w}.hb", heartbeat(w))
    await deliver(fleet, "ta.worker.w1.unavailable", wire.encode(wire.Unavailable("i1", "unreachable")))
    assert [w.worker_id for w in fleet.routable()] == ["w2"]
    assert (await fleet.start_generation(list(range(100)), 4)).decision.worker_id == "w2"
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1"))
    assert sorted(w.worker_id for w in fleet.routable()) == ["w1", "w2"]


async def test_context_limit_follows_the_simulated_workers(fleet):
    assert fleet.max_context_tokens is None  # no worker yet: unknown
    fleet.bus.dumps["w1"] = ("i1", [], -1)
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1"))
    assert fleet.max_context_tokens == 1000 * BS  # a worker that states no limit: its KV pool
    # a larger worker states its limits: the frontend takes up to the largest, routing filters per worker
    info = wire.WireInfo("w2", "both", "simulated", BS, 8192, 64, 4000, 0, 4000 * BS, 200_000)
    fleet.bus.dumps["w2"] = ("i1", [], -1)
    await deliver(fleet, "ta.worker.w2.hb", wire.encode(wire.Heartbeat(wire.WIRE_VERSION, "i1", info,
                                                                     wire.WireLoad(0.0, 0, 0, 0, 0, 0, 0, 4000), -1)))
    assert fleet.max_context_tokens == 4000 * BS
    states = {w.worker_id: (w.max_seq_tokens, w.max_prompt_tokens) for w in fleet.routable()}
    assert states == {"w1": (1000 * BS, 0), "w2": (4000 * BS, 200_000)}
    long_one = await fleet.start_generation(list(range(2000 * BS)), 4)
    assert long_one.decision.worker_id == "w2"
    # a known worker's engine reported its max_model_len: its next heartbeat carries it
    info = wire.WireInfo("w2", "both", "simulated", BS, 8192, 64, 4000, 0, 1500 * BS, 0)
    await deliver(fleet, "ta.worker.w2.hb", wire.encode(wire.Heartbeat(wire.WIRE_VERSION, "i1", info,
                                                                     wire.WireLoad(0.0, 0, 0, 0, 0, 0, 0, 4000), -1)))
    assert fleet.registry.info("w2").max_seq_tokens == 1500 * BS and fleet.max_context_tokens == 1500 * BS
    assert {w.worker_id: w.max_seq_tokens for w in fleet.routable()}["w2"] == 1500 * BS


async def test_health_summary_reports_frontend_and_sync_state(fleet):
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1"))  # no dump available yet: keeps syncing
    summary = fleet.health_summary()
    assert summary["frontend"]["syncing"] == ["w1"]
    assert [w["id"] for w in summary["workers"]] == ["w1"]


async def test_a_decode_workers_heartbeats_teach_the_transfer_plane_its_links(clock):
    """Over NATS the decode server's NIXL readings ride on its worker process's heartbeats (``Heartbeat.kv_pulls``):
    the frontend's plane learns the link from the prefill worker whose plan landed there, as ``serve`` does."""
    from thunderagent.control.pd_plane import PlaneObserver
    from thunderagent.types import PdPlan

    plane = {"enabled": True, "bandwidth_gbps": 400.0, "latency_s": 0.0, "ewma_alpha": 1.0}
    cfg = parse_config({"control_plane": {"heartbeat_interval": 1.0, "heartbeat_misses": 3,
                                          "health_check_enabled": False}, "routing": {"seed": 1},
                        "execution_group": {"nodes": [{"block_size": BS, "role": "prefill", "kv_cache_transfer": plane},
                                                      {"block_size": BS, "role": "decode"}]},
                        "scheduler": {"enabled": False}})
    f = build_nats_fleet(cfg, FakeBus(), discovery_window=0.0, clock=clock)
    await f.start()
    f.bus = f.membership.bus  # type: ignore[attr-defined]
    try:
        def hb(wid: str, role: str, pulls: tuple[float, float, float] | None) -> bytes:
            info = wire.WireInfo(wid, role, "vllm", BS, 8192, 64, 1000)
            load = wire.WireLoad(0.0, 0, 0, 0, 0, 0, 0, 1000)
            return wire.encode(wire.Heartbeat(wire.WIRE_VERSION, "i1", info, load, -1, kv_pulls=pulls))

        f.bus.dumps["p1"] = f.bus.dumps["d1"] = ("i1", [], -1)
        await deliver(f, "ta.worker.p1.hello", hb("p1", "prefill", (0.0, 0.0, 0.0)))
        await deliver(f, "ta.worker.d1.hello", hb("d1", "decode", (0.0, 0.0, 0.0)))
        obs = f.disagg.observer
        assert isinstance(obs, PlaneObserver)
        plan = PdPlan("p1", 64, 10**6, 0.0, 0.0, "test")
        assert obs.on_transfer_start("r1", plan, "d1", clock())
        obs.on_transfer_end("r1", plan, True, "ok", 10**6, 0.2, clock())
        await deliver(f, "ta.worker.d1.hb", hb("d1", "decode", (2e8, 0.1, 1.0)))  # 200 MB in 0.1 s
        await deliver(f, "ta.worker.p1.hb", hb("p1", "prefill", (0.0, 0.0, 0.0)))  # (a prefill server reads nothing)
        assert [(x["src"], x["dst"], x["samples"]) for x in obs.links()] == [("p1", "d1", 1)]
        assert obs.links()[0]["bandwidth_gbps"] == pytest.approx(16.0)
        assert f.health_summary()["pd_links"] == obs.links()
    finally:
        await f.stop()


def test_load_report_fields_match_wire():
    # a new LoadReport field must be added to WireLoad too; worker_id is the subject's, and kv_seq
    # rides on the heartbeat itself (Heartbeat.last_seq)
    assert len(LoadReport.__dataclass_fields__) - 2 == len(wire.WireLoad.__struct_fields__)
