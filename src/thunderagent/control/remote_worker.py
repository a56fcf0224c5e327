"""The handle of a worker process reached over the NATS bus (see :mod:`thunderagent.bus.wire`).

A :class:`RemoteWorker` publishes ``generate`` / ``abort`` RPCs and turns the worker's numbered
``TokenBatch`` replies into outputs on the request's queue: batch 0 says the worker accepted the
request; empty batches after it are keepalives (they touch the queue, so the fleet's stall check
sees a live request); a missing batch number means messages were lost and the request ends
``ERROR``. Its load is the worker's last heartbeat plus the requests sent since, so two quick
requests never both see an idle worker. It shares a :class:`RemoteLink` (bus, subjects, this
frontend's id, who serves which request) with the other remote workers of its membership. A
request's outputs come back on ``<p>.reply.<worker>.<frontend>.<rid>``: the membership hands a
stream message only to the worker its subject names (see :mod:`thunderagent.bus.wire`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from thunderagent.bus.nats import Bus, BusError, BusMsg
from thunderagent.bus.wire import Abort, Subjects, decode_tokens, encode, output_from_wire, request_to_wire
from thunderagent.bus.wire_admin import ResetCache, ServerCall, SetAdapter, SetPaused, decode_admin_reply
from thunderagent.execution.server_admin import ADMIN_TIMEOUT_S, SERVER_CALLS
from thunderagent.execution.handle import AdminResult, OutputQueue, Snapshot, WorkerCallbacks, with_pending
from thunderagent.types import EngineRequest, FinishReason, LoadReport, TokenOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RemoteLink:
    """What the remote workers of one frontend share."""

    bus: Bus
    subjects: Subjects
    frontend_id: str  # replies come to ``<p>.reply.<worker>.<frontend_id>.<request id>``
    #: the worker is unreachable (NATS "no responders"): the membership drops it
    on_lost: Callable[[str, str], None]
    owners: dict[str, RemoteWorker] = field(default_factory=dict)  # request id -> worker serving it


@dataclass(slots=True)
class _Stream:
    req: EngineRequest
    queue: OutputQueue
    next_n: int = 0


class RemoteWorker:
    def __init__(self, link: RemoteLink, worker_id: str, instance: str, load: LoadReport,
                 callbacks: WorkerCallbacks, engine: str = "simulated") -> None:
        self.worker_id = worker_id
        self.instance = instance
        self.engine = engine
        self._link = link
        self._cb = callbacks
        self._load = load
        self._streams: dict[str, _Stream] = {}
        # prompt tokens of requests sent since the last heartbeat: counted as waiting until the
        # worker's own report includes them
        self._unreported: dict[str, int] = {}

    # -- WorkerHandle ------------------------------------------------------------------------
    def start(self) -> None:
        pass

    async def stop(self) -> None:
        for st in self.take_streams():
            self.send_abort(st.req.request_id)  # the worker need not finish what nobody will read
            self._finish(st, FinishReason.ABORT)  # this frontend shuts down

    def submit(self, req: EngineRequest) -> OutputQueue:
        link = self._link
        rid = req.request_id
        queue = OutputQueue(self._cb.clock())
        data = encode(request_to_wire(req))
        if len(data) > link.bus.max_payload:  # the bus would drop it: end it now, not after the stall timeout
            log.warning("request %s: %d bytes, over the bus's max_payload of %d: ended", rid, len(data),
                        link.bus.max_payload)
            self._finish(_Stream(req, queue), FinishReason.ERROR)
            return queue
        self._streams[rid] = _Stream(req, queue)
        link.owners[rid] = self
        self._unreported[rid] = len(req.prompt_tokens)
        link.bus.publish(link.subjects.rpc(self.worker_id, "generate"), data,
                         reply=link.subjects.reply(self.worker_id, link.frontend_id, rid))
        self._cb.on_load(self.worker_id, self.load())
        return queue

    def abort(self, request_id: str) -> None:
        if self.detach(request_id) is not None:
            self.send_abort(request_id)

    def snapshot(self) -> Snapshot | None:
        return None  # dumps are asynchronous: the membership requests them itself

    async def reset_prefix_cache(self, running: bool, external: bool) -> AdminResult:
        return await self._admin_call("reset_cache", encode(ResetCache(running, external)))

    async def set_paused(self, paused: bool, mode: str, clear_cache: bool) -> AdminResult:
        return await self._admin_call("pause", encode(SetPaused(paused, mode, clear_cache)))

    async def server_call(self, path: str, query: str = "", body: bytes = b"") -> AdminResult:
        call = SERVER_CALLS.get(path)
        return await self._admin_call("call", encode(ServerCall(path, query, body)),
                                      call.timeout_s if call is not None else ADMIN_TIMEOUT_S)

    async def set_adapter(self, name: str, path: str | None, inplace: bool) -> AdminResult:
        return await self._admin_call("adapter", encode(SetAdapter(name, path, inplace)))

    async def _admin_call(self, kind: str, data: bytes, timeout_s: float = ADMIN_TIMEOUT_S) -> AdminResult:
        """Asked of the worker process (it holds the server's connection); its answer, or a failure when the
        instance this frontend knows does not answer in time (its server's own timeout, plus the bus)."""
        link = self._link
        reply = link.subjects.call_reply(self.worker_id, link.frontend_id, secrets.token_hex(6))

        def its_answer(msg: BusMsg) -> bool:
            try:
                return decode_admin_reply(msg.data).instance == self.instance
            except (msgspec.DecodeError, msgspec.ValidationError):
                return False

        try:
            got = await link.bus.request_many(link.subjects.rpc(self.worker_id, kind), data, timeout_s + 2,
                                              its_answer, reply)
        except (BusError, TimeoutError) as e:
            return AdminResult(False, error=f"the worker process did not answer: {e or 'timed out'}")
        r = decode_admin_reply(got[-1].data)
        return AdminResult(r.success, r.error, r.answer)

    # -- membership side ---------------------------------------------------------------------
    def load(self) -> LoadReport:
        unreported = self._unreported
        return with_pending(self._load, len(unreported), sum(unreported.values()))

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def on_heartbeat(self, load: LoadReport) -> None:
        self._load = load
        self._unreported.clear()

    def detach(self, request_id: str) -> _Stream | None:
        if self._unreported.pop(request_id, None) is not None:
            self._cb.on_load(self.worker_id, self.load())  # no longer waiting on our account
        owners = self._link.owners
        if owners.get(request_id) is self:
            del owners[request_id]
        return self._streams.pop(request_id, None)

    def take_streams(self) -> list[_Stream]:
        return [st for rid in list(self._streams) if (st := self.detach(rid)) is not None]

    def send_abort(self, request_id: str) -> None:
        link = self._link
        link.bus.publish(link.subjects.rpc(self.worker_id, "abort"), encode(Abort(request_id)))

    def on_stream(self, request_id: str, msg: BusMsg) -> None:
        st = self._streams.get(request_id)
        if st is None:
            return
        if msg.no_responders:
            self._link.on_lost(self.worker_id, "unreachable (no responders)")  # this request is routed again
            return
        batch = decode_tokens(msg.data)
        if batch.n != st.next_n:
            log.warning("request %s on %s: output message %d lost", request_id, self.worker_id, st.next_n)
            self.detach(request_id)
            self.send_abort(request_id)
            self._finish(st, FinishReason.ERROR)
            return
        if batch.error:
            log.warning("request %s refused by %s: %s", request_id, self.worker_id, batch.error)
        now = self._cb.clock()
        st.next_n += 1
        st.queue.accepted = True
        st.queue.touch(now)  # an empty batch is a keepalive
        for w in batch.outputs:
            out = output_from_wire(request_id, w)
            st.queue.put_output(out, now)
            if out.finished:
                self.detach(request_id)
                return

    def _finish(self, st: _Stream, reason: FinishReason) -> None:
        now = self._cb.clock()
        st.queue.put_output(TokenOutput(st.req.request_id, [], now, len(st.req.prompt_tokens), 0, True, reason), now)
