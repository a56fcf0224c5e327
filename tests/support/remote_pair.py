"""A worker process's :class:`WorkerService` (simulated engine) and the frontend's
:class:`RemoteWorker` for it, joined by a real nats-server, in one event loop: the remote handle
under test, with what a frontend's membership would do for it (heartbeats, KV events, streams)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from support.callbacks import Recorder
from thunderagent.bus.nats import BusMsg, NatsBus
from thunderagent.bus.wire import Subjects, decode_heartbeat, decode_kv, events_from_wire, load_from_wire
from thunderagent.config import NodeConfig
from thunderagent.control.remote_worker import RemoteLink, RemoteWorker
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.execution.handle import WorkerCallbacks
from thunderagent.execution.local import LocalWorker, ScaledClock
from thunderagent.execution.nats_worker import WorkerService
from thunderagent.types import LoadReport, WorkerInfo

WID = "remote-0"


async def remote_pair(rec: Recorder, nats_url: str, block_size: int) -> tuple[RemoteWorker,
                                                                             Callable[[], Awaitable[None]]]:
    subjects = Subjects("conf")
    node = NodeConfig(block_size=block_size, kv_blocks=4096)
    info = WorkerInfo(WID, "both", block_size, node.max_num_batched_tokens, node.queue_depth_threshold,
                      node.kv_blocks)

    def build(cb: WorkerCallbacks) -> LocalWorker:
        return LocalWorker(SimulatedEngine(WID, node, eos_token_id=256), ScaledClock(20.0), cb, 0.05)

    # this harness's frontend side does not heartbeat: a lease longer than any test
    service = WorkerService(NatsBus(nats_url, "conf-worker"), subjects, info, "simulated", build, keepalive=0.2,
                            frontend_lease=3600.0)
    await service.start()
    bus = NatsBus(nats_url, "conf-frontend")
    await bus.connect()
    cb = rec.callbacks()
    link = RemoteLink(bus, subjects, "conf", lambda wid, why: rec.unavailable.append(why))
    remote = RemoteWorker(link, WID, service.instance, LoadReport(WID, 0.0, 0, 0, 0, 0, 0, 0, node.kv_blocks), cb)

    async def on_worker(msg: BusMsg) -> None:
        parsed = subjects.parse_worker(msg.subject)
        if parsed is None:
            return
        kind = parsed[1]
        if kind in ("hb", "hello"):
            remote.on_heartbeat(load_from_wire(decode_heartbeat(msg.data).load, WID))
            cb.on_heartbeat(WID, remote.load())
        elif kind == "kv":
            cb.on_events(WID, events_from_wire(WID, decode_kv(msg.data).events))

    async def on_reply(msg: BusMsg) -> None:
        rid = msg.subject.rsplit(".", 1)[1]
        owner = link.owners.get(rid)
        if owner is not None:
            owner.on_stream(rid, msg)

    await bus.subscribe(subjects.all_workers(), on_worker)
    await bus.subscribe(subjects.replies("conf"), on_reply)
    bus.publish(subjects.discover(), b"")

    async def cleanup() -> None:
        await service.stop()
        await bus.close()

    return remote, cleanup
