"""WorkerService: a worker handle put on the bus, on an in-memory bus with a hand-driven handle."""

from __future__ import annotations

import asyncio
import time

import pytest

from thunderagent.bus import wire
from thunderagent.bus.nats import BusMsg
from thunderagent.types import WorkerInfo
from thunderagent.execution.nats_worker import WorkerService
from thunderagent.execution.handle import WorkerCallbacks
from thunderagent.types import BlockStored, EngineRequest, LoadReport, TokenOutput
from fake_bus import FakeBus  # (tests/unit is on sys.path)
from support.waiting import wait_until


class FakeHandle:
    worker_id = "w1"

    def __init__(self, cb: WorkerCallbacks) -> None:
        self.cb = cb
        self.queues: dict[str, asyncio.Queue[TokenOutput]] = {}
        self.aborted: list[str] = []
        self.snap: tuple[list[int], int] | tuple[list[int], int, list[int]] | None = ([5, 6], 3)
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def submit(self, req: EngineRequest) -> asyncio.Queue[TokenOutput]:
        if not req.prompt_tokens:
            raise ValueError("empty prompt")
        q: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self.queues[req.request_id] = q
        return q

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def load(self) -> LoadReport:
        return LoadReport("w1", 0.0, 1, 2, 3, 4, 5, 6, 100)

    def snapshot(self):  # type: ignore[no-untyped-def]
        return self.snap


@pytest.fixture
async def svc():
    bus = FakeBus()
    handles: list[FakeHandle] = []

    def build(cb: WorkerCallbacks) -> FakeHandle:
        handles.append(FakeHandle(cb))
        return handles[0]

    s = WorkerService(bus, wire.Subjects(), WorkerInfo("w1", "both", 64, 8192, 64, 100), "simulated", build,
                      drain_timeout=0.2)
    await s.start()
    s.fake = handles[0]  # type: ignore[attr-defined]
    yield s
    if not s._closing:
        await s.stop()


def batches(bus: FakeBus, reply: str) -> list[wire.TokenBatch]:
    return [wire.decode_tokens(d) for subj, d, _ in bus.published if subj == reply]


async def generate(s: WorkerService, rid: str, prompt: list[int]) -> str:
    req = EngineRequest(rid, prompt, [], 1, 8)
    reply = f"ta.reply.w1.f.{rid}"
    await s.bus.subs["ta.rpc.w1.*"](BusMsg("ta.rpc.w1.generate", wire.encode(wire.request_to_wire(req)), reply))
    return reply


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_start_subscribes_then_says_hello(svc):
    bus = svc.bus
    assert set(bus.subs) == {"ta.rpc.w1.*", "ta.discover", "ta.frontend.*.hb"} and svc.fake.started
    subj, data, _ = bus.published[0]
    hb = wire.decode_heartbeat(data)
    assert subj == "ta.worker.w1.hello" and hb.instance == svc.instance and hb.info.worker_id == "w1"
    await bus.subs["ta.discover"](BusMsg("ta.discover", b""))
    assert bus.published[-1][0] == "ta.worker.w1.hello"


async def test_events_go_out_in_order_and_heartbeats_count_them(svc):
    svc.fake.cb.on_events("w1", [BlockStored("w1", 0, (1, 2)), BlockStored("w1", 1, (3,))])
    svc.fake.cb.on_heartbeat("w1", svc.fake.load())
    (kv_subj, kv, _), (hb_subj, hb, _) = svc.bus.published[-2:]
    assert kv_subj == "ta.worker.w1.kv" and hb_subj == "ta.worker.w1.hb"
    batch = wire.decode_kv(kv)
    assert [e.seq for e in wire.events_from_wire("w1", batch.events)] == [0, 1]
    assert wire.decode_heartbeat(hb).last_seq == 1


async def test_limits_the_engine_states_ride_on_every_later_heartbeat(svc):
    svc.fake.cb.on_heartbeat("w1", svc.fake.load())
    before = wire.decode_heartbeat(svc.bus.published[-1][1]).info
    assert (before.max_seq_tokens, before.max_prompt_tokens) == (0, 0)
    svc.fake.cb.on_limits("w1", 2048, 0)  # vLLM's max_model_len, read from its model card
    svc.fake.cb.on_heartbeat("w1", svc.fake.load())
    after = wire.decode_heartbeat(svc.bus.published[-1][1]).info
    assert (after.max_seq_tokens, after.max_prompt_tokens) == (2048, 0) and after.worker_id == "w1"


async def test_its_servers_kv_pulls_ride_on_the_next_heartbeat(svc):
    """A vLLM decode server's NIXL reads (cumulative, from its load polls) go to the frontends in heartbeats, where
    the transfer plane's links learn from them (``control/pd_plane.py``); a server that reports none sends None."""
    svc.fake.cb.on_heartbeat("w1", svc.fake.load())
    assert wire.decode_heartbeat(svc.bus.published[-1][1]).kv_pulls is None
    svc.fake.cb.on_kv_pulls("w1", 196608.0, 0.12, 1.0)
    svc.fake.cb.on_heartbeat("w1", svc.fake.load())
    assert wire.decode_heartbeat(svc.bus.published[-1][1]).kv_pulls == (196608.0, 0.12, 1.0)


async def test_its_servers_prefill_figures_ride_on_the_next_heartbeat(svc):
    """A vLLM server's computed prompt tokens and prefill seconds (cumulative, from its load polls) go to the
    frontends in heartbeats, where cache migration measures its prefill rate; a server that reports none sends
    None."""
    svc.fake.cb.on_heartbeat("w1", svc.fake.load())
    assert wire.decode_heartbeat(svc.bus.published[-1][1]).prefill is None
    svc.fake.cb.on_prefill("w1", 4096.0, 2.0)
    svc.fake.cb.on_heartbeat("w1", svc.fake.load())
    assert wire.decode_heartbeat(svc.bus.published[-1][1]).prefill == (4096.0, 2.0)


async def test_generate_streams_numbered_batches_until_finished(svc):
    reply = await generate(svc, "r1", [1, 2, 3])
    q = svc.fake.queues["r1"]
    q.put_nowait(TokenOutput("r1", [7], 1.0, 3, 0))
    q.put_nowait(TokenOutput("r1", [8], 1.0, 3, 0))  # same pass: one message
    await settle()
    q.put_nowait(TokenOutput("r1", [9], 2.0, 3, 0, True, "length"))
    await settle()
    got = batches(svc.bus, reply)
    assert [b.n for b in got] == [0, 1, 2]
    assert [[o.token_ids for o in b.outputs] for b in got] == [[], [[7], [8]], [[9]]]
    assert got[-1].outputs[-1].finished and not svc._streams
    assert (svc.counters.requests_accepted, svc.counters.requests_finished) == (1, {"length": 1})  # its metrics


async def test_abort_cancels_the_stream(svc):
    await generate(svc, "r1", [1])
    await svc.bus.subs["ta.rpc.w1.*"](BusMsg("ta.rpc.w1.abort", wire.encode(wire.Abort("r1"))))
    assert svc.fake.aborted == ["r1"] and not svc._streams
    assert svc.counters.requests_finished == {"cut": 1}  # its metrics


async def test_refused_and_duplicate_requests_end_with_error(svc):
    reply = await generate(svc, "bad", [])
    (b,) = batches(svc.bus, reply)
    assert b.error == "empty prompt" and b.outputs[0].finish_reason == "error"
    await generate(svc, "r1", [1])
    reply = await generate(svc, "r1", [1])
    assert batches(svc.bus, reply)[-1].error == "duplicate request id r1"
    assert svc.counters.requests_refused == {"engine_refused": 1, "duplicate_id": 1}
    assert svc.counters.requests_accepted == 1


async def test_dump_replies_with_snapshot_or_unavailable(svc):
    await svc.bus.subs["ta.rpc.w1.*"](BusMsg("ta.rpc.w1.dump", b"", "ta.reply.w1.f.call.d1"))
    chunks = [wire.decode_dump_chunk(d) for s, d, _ in svc.bus.published if s == "ta.reply.w1.f.call.d1"]
    assert wire.join_dump(chunks) == wire.Dump(svc.instance, 3, [5, 6])
    svc.fake.snap = ([5, 6], 4, [7, 8])  # with the double-hash guard's check hashes
    await svc.bus.subs["ta.rpc.w1.*"](BusMsg("ta.rpc.w1.dump", b"", "ta.reply.w1.f.call.d3"))
    chunks = [wire.decode_dump_chunk(d) for s, d, _ in svc.bus.published if s == "ta.reply.w1.f.call.d3"]
    assert wire.join_dump(chunks) == wire.Dump(svc.instance, 4, [5, 6], [7, 8])
    svc.fake.snap = None
    await svc.bus.subs["ta.rpc.w1.*"](BusMsg("ta.rpc.w1.dump", b"", "ta.reply.w1.f.call.d2"))
    chunks = [wire.decode_dump_chunk(d) for s, d, _ in svc.bus.published if s == "ta.reply.w1.f.call.d2"]
    assert wire.join_dump(chunks).hashes is None


async def test_stop_says_bye_drains_and_turns_new_requests_away(svc):
    reply = await generate(svc, "r1", [1])
    stopping = asyncio.create_task(svc.stop())
    await settle()
    assert svc.bus.published[-1][0] == "ta.worker.w1.bye"
    late = await generate(svc, "r2", [1])
    assert batches(svc.bus, late)[0].outputs[0].finish_reason == "unavailable"
    svc.fake.queues["r1"].put_nowait(TokenOutput("r1", [7], 1.0, 1, 0, True, "stop"))
    await asyncio.wait_for(stopping, 2)
    assert batches(svc.bus, reply)[-1].outputs[-1].finish_reason == "stop" and svc.fake.stopped


async def test_stop_ends_what_does_not_drain_in_time(svc):
    reply = await generate(svc, "r1", [1])
    await asyncio.wait_for(svc.stop(), 2)  # drain_timeout 0.2 s
    assert batches(svc.bus, reply)[-1].outputs[-1].finish_reason == "error"
    assert svc.fake.aborted == ["r1"]


async def test_ping_answers_with_this_instance_on_its_own_reply_subject(svc):
    await svc.bus.subs["ta.rpc.w1.*"](BusMsg("ta.rpc.w1.ping", b"", "ta.reply.w1.f.call.p1"))
    subj, data, _ = svc.bus.published[-1]
    assert subj == "ta.reply.w1.f.call.p1" and wire.decode_pong(data).instance == svc.instance


async def test_rpcs_asking_for_replies_under_another_workers_name_are_ignored(svc):
    before = len(svc.bus.published)
    req = EngineRequest("r9", [1, 2], [], 1, 8)
    for kind, data in (("generate", wire.encode(wire.request_to_wire(req))), ("dump", b""), ("ping", b"")):
        await svc.bus.subs["ta.rpc.w1.*"](BusMsg(f"ta.rpc.w1.{kind}", data, "ta.reply.w2.f.r9"))
    assert len(svc.bus.published) == before and "r9" not in svc.fake.queues


async def test_requests_of_a_frontend_that_stops_beating_are_aborted(svc, monkeypatch):
    now = [svc._now()]
    monkeypatch.setattr(svc, "_now", lambda: now[0])
    lease = svc.frontend_lease
    await generate(svc, "r1", [1])  # to frontend "f"
    req = wire.request_to_wire(EngineRequest("r2", [1], [], 1, 8))
    await svc.bus.subs["ta.rpc.w1.*"](BusMsg("ta.rpc.w1.generate", wire.encode(req), "ta.reply.w1.g.r2"))  # to "g"
    assert svc.check_frontends(now[0] + lease - 0.1) == []  # a request is news of its frontend
    now[0] += lease - 0.5
    await svc.bus.subs["ta.frontend.*.hb"](BusMsg("ta.frontend.g.hb", b""))  # g beats, f is silent
    now[0] += 1.0
    assert svc.check_frontends(now[0]) == ["r1"]
    assert svc.fake.aborted == ["r1"] and set(svc._streams) == {"r2"}


async def test_a_starved_loop_does_not_count_as_a_frontends_silence():
    """The worker's own loop starved past the lease (a busy host): the frontend's heartbeats wait
    unread meanwhile, so its requests are not aborted; its true silence afterwards still is."""
    lease = 0.4
    fakes: list[FakeHandle] = []
    svc = WorkerService(FakeBus(), wire.Subjects(), WorkerInfo("w1", "both", 64, 8192, 64, 100), "simulated",
                        lambda cb: fakes.append(FakeHandle(cb)) or fakes[0], drain_timeout=0.2, frontend_lease=lease)
    await svc.start()
    try:
        await generate(svc, "r1", [1])  # to frontend "f"
        await asyncio.sleep(0.05)  # the keepalive loop is waiting for its next tick
        time.sleep(2 * lease)  # noqa: ASYNC251 (the starved loop is the point)
        await asyncio.sleep(lease / 2)  # the keepalive loop's ticks run, the first one late
        assert fakes[0].aborted == [] and set(svc._streams) == {"r1"}
        await wait_until(lambda: fakes[0].aborted == ["r1"], 4 * lease, "a silent frontend's request aborted")
    finally:
        await svc.stop()
