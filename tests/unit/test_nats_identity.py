"""Who may speak for a worker on the bus (in-memory bus, injected clock): a message whose payload
names another worker than its subject, a stream message from a worker not serving the request, and
a new instance of a worker whose known instance still answers a ping are ignored, counted, and
logged at a bounded rate. A real restart (the old process gone) still replaces the worker."""

from __future__ import annotations

import logging
import time

from thunderagent.bus import wire

from test_nats_fleet import accepted, clock, deliver, fleet, heartbeat, stream_msg  # noqa: F401  (fixtures)


def ignored(f) -> dict[str, int]:
    return f.health_summary()["frontend"]["ignored_messages"]


async def serving(f, wid: str = "w1"):
    """w1 registered (instance i1) with one accepted request in flight."""
    f.bus.dumps[wid] = ("i1", [], -1)
    await deliver(f, f"ta.worker.{wid}.hb", heartbeat(wid))
    gen = await f.start_generation(list(range(100)), 4)
    await stream_msg(f, gen.request_id, accepted())
    return gen


async def test_forged_new_instance_of_a_live_worker_is_ignored_and_its_streams_go_on(fleet, caplog):
    gen = await serving(fleet)
    fleet.bus.alive["w1"] = "i1"  # the real process answers pings
    caplog.set_level(logging.WARNING, "thunderagent.control.nats_membership")
    for i in range(5):
        await deliver(fleet, "ta.worker.w1.hello", heartbeat("w1", instance=f"forged{i}"))
    assert fleet.workers["w1"].instance == "i1" and fleet.registry.worker_ids() == ["w1"]
    assert gen.queue.empty()  # nothing was cut
    tok = wire.WireToken([65], 1.0, 100, 0, True, "length", None)
    await stream_msg(fleet, gen.request_id, wire.TokenBatch(1, [tok]))
    assert gen.queue.get_nowait().finish_reason == "length"
    # one probe (the others fell in its cooldown), one warning; every claim counted
    pings = [s for s, _ in fleet.bus.requests if s.endswith(".ping")]
    assert pings == ["ta.rpc.w1.ping"]
    assert fleet.bus.requests[-1][1].startswith(f"ta.reply.w1.{fleet.fid}.call.")
    assert ignored(fleet) == {"incarnation": 5, "refuted": 1}
    assert sum("still answers" in r.message for r in caplog.records) == 1


async def test_a_restart_replaces_the_worker_once_the_old_process_stops_answering(fleet, clock):
    gen = await serving(fleet)
    fleet.bus.alive["w1"] = "i1"
    await deliver(fleet, "ta.worker.w1.hello", heartbeat("w1", instance="i2"))  # refuted: i1 answers
    assert fleet.workers["w1"].instance == "i1"
    del fleet.bus.alive["w1"]  # i1 crashes; i2 (the restarted process) heartbeats
    fleet.bus.dumps["w1"] = ("i2", [7], 0)
    clock.t += 0.5
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1", instance="i2", last_seq=0))
    assert fleet.workers["w1"].instance == "i1"  # within the cooldown of the refuted claim: no new probe
    clock.t += 5.0  # i1's lease (3 s) ran out too, but the probe comes first here
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1", instance="i2", last_seq=0))
    assert fleet.workers["w1"].instance == "i2" and fleet.index.num_blocks("w1") == 1
    assert gen.queue.get_nowait().finish_reason == "error"  # the crashed process's request ends


async def test_heartbeat_naming_another_worker_is_ignored(fleet, clock, caplog):
    await serving(fleet)
    caplog.set_level(logging.WARNING, "thunderagent.control.nats_membership")
    for _ in range(3):
        await deliver(fleet, "ta.worker.w1.hb", heartbeat("w2", instance="x"))
    assert fleet.registry.worker_ids() == ["w1"] and fleet.workers["w1"].instance == "i1"
    assert ignored(fleet) == {"identity": 3}
    clock.t += 10.0  # the next warning says how many were suppressed meanwhile
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w2", instance="x"))
    warnings = [r.message for r in caplog.records if "claims to be worker w2" in r.message]
    assert len(warnings) == 2 and "(2 more since the last warning)" in warnings[1]


async def test_stream_message_from_another_worker_than_the_one_serving_is_ignored(fleet):
    gen = await serving(fleet)
    fleet.bus.dumps["w2"] = ("i1", [], -1)
    await deliver(fleet, "ta.worker.w2.hb", heartbeat("w2"))
    bogus = wire.WireToken([66], 1.0, 100, 0, True, "stop", None)
    await stream_msg(fleet, gen.request_id, wire.TokenBatch(1, [bogus]), wid="w2")
    await stream_msg(fleet, gen.request_id, wire.TokenBatch(9, []), wid="w2")  # would look like a loss
    assert gen.queue.empty() and ignored(fleet) == {"stream": 2}
    tok = wire.WireToken([65], 1.0, 100, 0, True, "length", None)
    await stream_msg(fleet, gen.request_id, wire.TokenBatch(1, [tok]))
    out = gen.queue.get_nowait()
    assert out.token_ids == [65] and out.finish_reason == "length"


async def test_a_request_too_large_for_the_bus_ends_at_once_instead_of_stalling(fleet):
    fleet.bus.dumps["w1"] = ("i1", [], -1)
    await deliver(fleet, "ta.worker.w1.hb", heartbeat("w1"))
    limit = fleet.prompt_limit
    assert limit is not None and (limit.tokens, limit.body_bytes) == wire.message_limits(1024 * 1024, 64)
    fleet.bus.max_payload = 2000  # a server configured small (the frontend's own check uses the real one)
    gen = await fleet.start_generation(list(range(1000)), 4)
    assert gen.queue.get_nowait().finish_reason == "error"
    assert fleet.bus.sent("generate") == [] and fleet.membership.link.owners == {}


async def test_a_probe_timed_out_by_our_starved_loop_asks_once_more_before_dropping(fleet):
    """The known instance's pong came, but our loop was starved past the probe's timeout (it fired
    late): liveness counts on-time loop, so the instance is asked again, answers, and keeps its
    requests. A timeout that fires on time is the old process gone (the restart test above)."""
    gen = await serving(fleet)
    fleet.bus.alive["w1"] = "i1"
    fleet.membership.probe_timeout = 0.1
    answer = fleet.bus.request_many
    starved: list[str] = []

    async def first_one_starved(subject, data, timeout, done, reply):  # type: ignore[no-untyped-def]
        if subject.endswith(".ping") and not starved:
            starved.append(subject)
            time.sleep(3 * timeout)  # noqa: ASYNC251 (the starved loop is the point)
            raise TimeoutError  # the timer fired first, the pong waits unread
        return await answer(subject, data, timeout, done, reply)

    fleet.bus.request_many = first_one_starved
    await deliver(fleet, "ta.worker.w1.hello", heartbeat("w1", instance="i2"))
    assert [s for s, _ in fleet.bus.requests if s.endswith(".ping")] == ["ta.rpc.w1.ping"]  # the second one
    assert starved == ["ta.rpc.w1.ping"]
    assert fleet.workers["w1"].instance == "i1" and gen.queue.empty(), "not dropped, nothing cut"
    assert ignored(fleet) == {"incarnation": 1, "refuted": 1}
