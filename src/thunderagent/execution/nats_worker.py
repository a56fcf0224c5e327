"""One worker process on the NATS bus (``thunderagent worker``).

A :class:`WorkerService` wraps any :class:`WorkerHandle` (the simulated engine driven by
:class:`LocalWorker`, or a real-engine adapter) and puts it on the bus:

- the handle's KV events go out as ``KvBatch`` on ``<p>.worker.<id>.kv`` and its heartbeats as
  ``Heartbeat`` on ``<p>.worker.<id>.hb`` (discovery, lease renewal and load report in one message;
  a ``hello`` with the same content on start and whenever a frontend asks ``<p>.discover``);
- ``<p>.rpc.<id>.generate`` starts a request; its outputs stream to the request's reply subject as
  ``TokenBatch`` messages numbered from 0 (0 = accepted), with an empty keepalive batch whenever a
  request produced nothing for ``KEEPALIVE_S``; ``abort`` cancels one; ``dump`` answers with the
  cached hashes and the last event seq they include (``DumpChunk``s); ``ping`` with this process's
  instance (``Pong``: a frontend that hears of a new instance asks whether the old one still runs);
  ``cordon`` keeps an operator's mark (in its heartbeats); ``reset_cache`` empties its server's prefix cache,
  ``adapter`` loads or unloads a LoRA adapter there, ``pause`` pauses or resumes its generation, ``call`` sends
  it one of vLLM's parameterless operator paths, each answering how it went (``bus.wire_admin``);
- a request lives as long as its frontend: one that misses ``frontend_lease`` seconds of
  heartbeats (``<p>.frontend.<fid>.hb``) is gone, and its requests are aborted (nobody reads them);
- it answers only to reply subjects under its own name (``<p>.reply.<id>.``): what it publishes
  always names it, so NATS permissions can bind its identity (see :mod:`thunderagent.bus.wire`);
- on SIGTERM/SIGINT: ``bye`` (frontends take it out of routing at once), then it drains: requests in
  flight finish (up to ``drain_timeout``; the rest end with "error"), new ones are answered
  "unavailable" (the frontend routes them elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import socket
from typing import Any
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from thunderagent.config import Config
from thunderagent.bus.connect import connect_options
import msgspec

from thunderagent.bus.nats import Bus, BusMsg, NatsBus
from thunderagent.bus.wire_admin import (AdminReply, decode_reset_cache, decode_server_call, decode_set_adapter,
                                         decode_set_paused)
from thunderagent.types import WorkerInfo
from thunderagent.bus.wire import (
    KEEPALIVE_S,
    WIRE_VERSION,
    Bye,
    Heartbeat,
    KvBatch,
    Pong,
    Subjects,
    TokenBatch,
    Unavailable,
    check_token,
    decode_abort,
    decode_generate,
    dump_chunks,
    encode,
    events_to_wire,
    info_to_wire,
    load_to_wire,
    output_to_wire,
    request_from_wire,
)
from thunderagent.gc_policy import tune_gc
from thunderagent.execution.handle import AdminResult, OutputQueue, WorkerCallbacks, WorkerHandle, snapshot_checks
from thunderagent.execution.server_admin import sleep_effect
from thunderagent.execution.worker_counters import WorkerCounters
from thunderagent.execution.worker_spans import WorkerSpans, make_worker_spans
from thunderagent.types import FinishReason, KvEvent, LoadReport, TokenOutput

log = logging.getLogger(__name__)

#: a tick this late or less is scheduling jitter, not a starved loop (``control.liveness.JITTER_S``)
_JITTER_S = 0.005

HandleBuilder = Callable[[WorkerCallbacks], WorkerHandle]


@dataclass(slots=True)
class _Out:
    """One request's output stream to its frontend."""

    reply: str
    n: int  # next message number
    last: float  # loop time of the last message sent
    frontend: str = ""  # the frontend it streams to (its id, from the reply subject)
    task: asyncio.Task[None] | None = None
    span: Any = None  # its span here (control_plane.tracing: execution/worker_spans.py), until it ends
    produced: int = 0  # tokens sent back (the span's)
    started: bool = False  # the first output with content went (the span's first-token event)


class WorkerService:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        info: WorkerInfo,
        engine_kind: str,
        build: HandleBuilder,
        *,
        keepalive: float = KEEPALIVE_S,
        drain_timeout: float = 30.0,
        frontend_lease: float = 3.0,
        sharded_kv: bool = False,
        spans: WorkerSpans | None = None,
    ) -> None:
        self.bus = bus
        self.spans = spans  # control_plane.tracing: a span per traced request (execution/worker_spans.py)
        self.subjects = subjects
        self.info = info
        self.worker_id = check_token(info.worker_id, "worker id")
        self.wire_info = info_to_wire(info, engine_kind)
        self._engine_kind = engine_kind
        self.instance = secrets.token_hex(6)  # a new one every process start: frontends tell a restarted worker
        self.keepalive = keepalive
        self.drain_timeout = drain_timeout
        self.frontend_lease = frontend_lease
        self._frontends: dict[str, float] = {}  # frontend id -> loop time it was last heard of
        self._closing = False
        self._build = build
        self.handle: WorkerHandle | None = None
        self.last_seq = -1
        self.cordoned = False  # an operator took this worker out of routing (told every frontend in heartbeats)
        self.asleep = False  # its server was put to sleep through a frontend (told every frontend in heartbeats)
        self.paused = False  # its server's generation was paused through a frontend (likewise)
        self.kv_pulls: tuple[float, float, float] | None = None  # its server's NIXL reads so far (the next heartbeat's)
        self.prefill: tuple[float, float] | None = None  # its server's computed prompt tokens, prefill seconds so far
        self._load = LoadReport(info.worker_id, 0.0, 0, 0, 0, 0, 0, 0, info.kv_total_blocks)  # last pushed
        self._streams: dict[str, _Out] = {}
        self._keepalive_task: asyncio.Task[None] | None = None
        self._replies = subjects.reply_prefix(self.worker_id)
        self._refused_replies = 0
        self.counters = WorkerCounters()  # its metrics endpoint's (thunderagent worker --metrics-port)
        self._calls: set[asyncio.Task[None]] = set()  # operator calls answered from a task (a cache reset)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kv_subject = subjects.worker_kv(self.worker_id, sharded_kv)  # (nats.index: sharded: its owner's only)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.bus.connect()
        self.handle = self._build(WorkerCallbacks(self._on_events, self._on_heartbeat, self._on_load,
                                                  self._on_unavailable, self._now, on_limits=self._on_limits,
                                                  on_adapters=self._on_adapters, on_asleep=self._set_asleep,
                                                  on_paused=self._set_paused, on_kv_pulls=self._set_kv_pulls,
                                                  on_prefill=self._set_prefill))
        # Subscribe (and flush) before saying hello: a frontend dumps a worker as soon as it meets it.
        await self.bus.subscribe(self.subjects.rpcs(self.worker_id), self._on_rpc)
        await self.bus.subscribe(self.subjects.discover(), self._on_discover)
        await self.bus.subscribe(self.subjects.frontend_beats(), self._on_frontend_beat)
        self.handle.start()
        self._publish_heartbeat("hello", self._load)
        self._keepalive_task = asyncio.create_task(self._keepalives(), name="keepalives")
        log.info("worker %s (instance %s) on the bus", self.worker_id, self.instance)

    def _on_limits(self, worker_id: str, max_seq: int, max_prompt: int) -> None:
        """The engine stated its limits (vLLM: max_model_len): every heartbeat from now on carries them."""
        self.info = replace(self.info, max_seq_tokens=max_seq, max_prompt_tokens=max_prompt)
        self.wire_info = info_to_wire(self.info, self._engine_kind)

    def _on_adapters(self, worker_id: str, adapters: tuple[str, ...]) -> None:
        """The engine's LoRA adapters: every heartbeat from now on carries them."""
        self.info = replace(self.info, adapters=adapters)
        self.wire_info = info_to_wire(self.info, self._engine_kind)

    def _set_asleep(self, worker_id: str, asleep: bool) -> None:
        """Its server fell asleep or woke (its metrics say so)."""
        self._set_marks(asleep=asleep)

    def _set_kv_pulls(self, worker_id: str, nbytes: float, seconds: float, transfers: float) -> None:
        self.kv_pulls = (nbytes, seconds, transfers)  # (its next heartbeat tells the frontends: their links learn)

    def _set_prefill(self, worker_id: str, tokens: float, seconds: float) -> None:
        self.prefill = (tokens, seconds)  # (its next heartbeat tells the frontends: cache migration's recompute times)

    def _set_paused(self, worker_id: str, paused: bool) -> None:
        """Its server was paused or resumed (its ``/is_paused`` says so)."""
        self._set_marks(paused=paused)

    def _set_marks(self, *, asleep: bool | None = None, paused: bool | None = None) -> None:
        """Its server fell asleep or woke, was paused or resumed (asked through a frontend, or its metrics say so):
        every frontend is told in a heartbeat, at once. None: unchanged."""
        changed = False
        if asleep is not None and asleep != self.asleep:
            self.asleep, changed = asleep, True
            log.warning("server %s", "asleep: routed to only while no awake worker can take a request" if asleep
                        else "awake")
        if paused is not None and paused != self.paused:
            self.paused, changed = paused, True
            log.warning("server %s", "paused: routed to only while no other worker can take a request" if paused
                        else "resumed")
        if changed and not self._closing:
            self._publish_heartbeat("hb", self._load)

    async def stop(self) -> None:
        """Leave: say bye, drain the requests in flight (bounded), then close."""
        self._closing = True
        self.bus.publish(self.subjects.worker(self.worker_id, "bye"), encode(Bye(self.instance)))
        deadline = self._now() + self.drain_timeout
        while self._streams and self._now() < deadline:
            await asyncio.sleep(0.05)
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
        for rid, out in list(self._streams.items()):
            log.warning("request %s still running after %.0fs of draining: ended", rid, self.drain_timeout)
            self._drop_stream(rid)
            if self.handle is not None:
                self.handle.abort(rid)
            self._send(out, [TokenOutput(rid, [], self._now(), 0, 0, True, FinishReason.ERROR)])
        if self.handle is not None:
            await self.handle.stop()
        await self.bus.close()

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    # -- handle callbacks (synchronous, in event order) --------------------------------------
    def _on_events(self, worker_id: str, events: list[KvEvent]) -> None:
        if not events:
            return
        self.last_seq = events[-1].seq
        self.counters.published(events)
        self.bus.publish(self._kv_subject, encode(KvBatch(self.instance, events_to_wire(events))))

    def _on_heartbeat(self, worker_id: str, load: LoadReport) -> None:
        self._load = load
        if not self._closing:  # a draining worker's lease runs out on its own
            self._publish_heartbeat("hb", load)

    def _on_load(self, worker_id: str, load: LoadReport) -> None:
        self._load = load  # sent with the next heartbeat (frontends count what they sent meanwhile)

    def _on_unavailable(self, worker_id: str, reason: str) -> None:
        self.bus.publish(self.subjects.worker(self.worker_id, "unavailable"),
                         encode(Unavailable(self.instance, reason)))

    def _publish_heartbeat(self, kind: str, load: LoadReport) -> None:
        hb = Heartbeat(WIRE_VERSION, self.instance, self.wire_info, load_to_wire(load), self.last_seq, self.cordoned,
                       self.asleep, self.paused, self.kv_pulls, self.prefill)
        self.counters.heartbeats += 1
        self.bus.publish(self.subjects.worker(self.worker_id, kind), encode(hb))

    # -- bus handlers ------------------------------------------------------------------------
    async def _on_discover(self, msg: BusMsg) -> None:
        assert self.handle is not None
        if self._closing:
            return
        self._publish_heartbeat("hello", self._load)

    async def _on_frontend_beat(self, msg: BusMsg) -> None:
        self._frontends[msg.subject.split(".")[-2]] = self._now()

    def excuse(self, late: float) -> None:
        """Our loop woke ``late`` seconds late: a frontend's heartbeats sent meanwhile wait unread,
        so that time is not its silence (leases count on-time loop, as the frontend's ``LoopLag``)."""
        if late > _JITTER_S:
            for f in self._frontends:
                self._frontends[f] += late

    def now_serving(self) -> tuple[int, int, LoadReport]:
        """Requests streaming from here, frontends heard of within the lease, its engine's last load (for metrics)."""
        return len(self._streams), len(self._frontends), self._load

    def check_frontends(self, now: float) -> list[str]:
        """Abort the requests of frontends not heard of for ``frontend_lease``; returns their ids."""
        gone = {f for f, t in self._frontends.items() if now - t > self.frontend_lease}
        for f in gone:
            del self._frontends[f]
        ended = [rid for rid, out in self._streams.items() if out.frontend in gone]
        for rid in ended:
            self._drop_stream(rid)
            assert self.handle is not None
            self.handle.abort(rid)
        if ended:
            log.warning("frontend(s) %s silent for %.1fs: %d requests aborted", ", ".join(sorted(gone)),
                        self.frontend_lease, len(ended))
        return ended

    async def _on_rpc(self, msg: BusMsg) -> None:
        kind = msg.subject.rsplit(".", 1)[1]
        if msg.reply and not msg.reply.startswith(self._replies):
            # Answering there would speak for another worker (NATS permissions would refuse it too).
            self._refused_replies += 1
            if self._refused_replies in (1, 10, 100) or self._refused_replies % 1000 == 0:
                log.warning("%s rpc with reply subject %s, not under %s: ignored (%d so far)",
                            kind, msg.reply, self._replies, self._refused_replies)
            return
        if kind == "generate":
            self._generate(msg)
        elif kind == "abort":
            rid = decode_abort(msg.data).request_id
            if self._drop_stream(rid) is not None:
                assert self.handle is not None
                self.handle.abort(rid)
        elif kind == "dump":
            self._dump(msg)
        elif kind == "ping":
            if msg.reply:
                self.bus.publish(msg.reply, encode(Pong(self.instance)))
        elif kind == "cordon":  # kept here, so that every frontend (one started later too) reads it in heartbeats
            self.cordoned = msg.data == b"1"
            log.warning("%s by an operator", "cordoned: out of routing" if self.cordoned else "uncordoned")
            if not self._closing:
                self._publish_heartbeat("hb", self._load)
            if msg.reply:
                self.bus.publish(msg.reply, encode(Pong(self.instance)))
        elif kind in ("reset_cache", "adapter", "pause", "call"):  # (a task: the server's answer holds up no rpc)
            if msg.reply:
                task = asyncio.get_running_loop().create_task(self._admin_call(kind, msg), name=kind)
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)
        else:
            log.warning("unknown rpc %s", msg.subject)

    async def _admin_call(self, kind: str, msg: BusMsg) -> None:
        """An operator's call on this worker's server (``bus.wire_admin``), answered to its reply subject."""
        assert self.handle is not None
        try:
            if kind == "reset_cache":
                reset = decode_reset_cache(msg.data)
                what = "prefix cache reset"
                r = await self.handle.reset_prefix_cache(reset.running, reset.external)
            elif kind == "call":
                call = decode_server_call(msg.data)
                what = f"{call.path[:80]} called"
                r = await self.handle.server_call(call.path, call.query, call.body)
                asleep = sleep_effect(call.path, call.query, r.answer)[0] if r.success else None
                # (awake whole: vLLM resumed its scheduling too, so a pause before is over)
                self._set_marks(asleep=asleep, paused=False if asleep is False else None)
            elif kind == "pause":
                pause = decode_set_paused(msg.data)
                what = f"generation {'paused (' + pause.mode + ')' if pause.paused else 'resumed'}"
                r = await self.handle.set_paused(pause.paused, pause.mode, pause.clear_cache)
                if r.success:
                    self._set_marks(paused=pause.paused)
            else:
                ask = decode_set_adapter(msg.data)
                what = f"LoRA adapter {ask.name!r} {'loaded' if ask.path is not None else 'unloaded'}"
                r = await self.handle.set_adapter(ask.name, ask.path, ask.inplace)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            what, r = "an operator's call", AdminResult(False, f"not a {kind} request: {e}")
        log.warning("%s by an operator: %s", what, "done" if r.success else f"refused: {r.error}")
        self.bus.publish(msg.reply, encode(AdminReply(self.instance, r.success, r.error, r.answer)))

    def _generate(self, msg: BusMsg) -> None:
        assert self.handle is not None
        req = request_from_wire(decode_generate(msg.data))
        rid = req.request_id
        if not msg.reply:
            log.warning("generate %s without a reply subject: ignored", rid)
            return
        out = _Out(msg.reply, 0, self._now())
        plen = len(req.prompt_tokens)
        if self._closing:  # routed here before the frontend saw our bye: it goes elsewhere
            self.counters.refused("shutting_down")
            self._send(out, [TokenOutput(rid, [], self._now(), plen, 0, True, FinishReason.UNAVAILABLE)],
                       "shutting down")
            return
        if rid in self._streams:
            self.counters.refused("duplicate_id")
            self._send(out, [TokenOutput(rid, [], self._now(), plen, 0, True, FinishReason.ERROR)],
                       f"duplicate request id {rid}")
            return
        span = self.spans.start(req) if self.spans is not None else None  # (the server gets its traceparent)
        try:
            queue = self.handle.submit(req)
        except Exception as exc:  # the engine refused it (bad input): tell the frontend, keep serving
            log.warning("request %s refused: %s", rid, exc)
            self.counters.refused("engine_refused")
            if span is not None:
                self.spans.end(span, FinishReason.ERROR, 0)  # type: ignore[union-attr]
            self._send(out, [TokenOutput(rid, [], self._now(), plen, 0, True, FinishReason.ERROR)], str(exc))
            return
        self._send(out, [])  # n=0: accepted
        self.counters.requests_accepted += 1
        out.frontend = self.subjects.reply_frontend(msg.reply) or ""
        self._frontends[out.frontend] = self._now()  # a request is news of its frontend too
        self._streams[rid] = out
        out.span = span
        out.task = asyncio.create_task(self._pump(rid, out, queue), name=f"out-{rid}")

    def _dump(self, msg: BusMsg) -> None:
        assert self.handle is not None
        if not msg.reply:
            return
        snap = self.handle.snapshot()  # publishes pending events first: they precede the dump
        hashes, seq = (None, self.last_seq) if snap is None else snap[:2]
        for chunk in dump_chunks(self.instance, hashes, seq, None if snap is None else snapshot_checks(snap)):
            self.bus.publish(msg.reply, encode(chunk))

    # -- output streams ----------------------------------------------------------------------
    def _send(self, out: _Out, outputs: list[TokenOutput], error: str | None = None) -> None:
        self.bus.publish(out.reply, encode(TokenBatch(out.n, [output_to_wire(o) for o in outputs], error)))
        out.n += 1
        out.last = self._now()

    def _drop_stream(self, rid: str) -> _Out | None:
        out = self._streams.pop(rid, None)
        if out is not None:  # cut: aborted by its frontend, its frontend gone, or the worker stopping
            self.counters.finished("cut")
        if out is not None and out.task is not None and out.task is not asyncio.current_task():
            out.task.cancel()
        return out

    async def _pump(self, rid: str, out: _Out, queue: OutputQueue) -> None:
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty():  # everything of this engine pass in one message
                    batch.append(queue.get_nowait())
                self._send(out, batch)
                if out.span is not None:
                    assert self.spans is not None
                    out.produced, out.started = self.spans.outputs(out.span, batch, out.produced, out.started)
                    if batch[-1].finished:
                        out.span = None  # (ended)
                if batch[-1].finished:
                    self.counters.finished(batch[-1].finish_reason or "")
                    return
        finally:
            if out.span is not None:  # cut: aborted by its frontend, or the worker stopping
                self.spans.end(out.span, None, out.produced)  # type: ignore[union-attr]
                out.span = None
            if self._streams.get(rid) is out:
                del self._streams[rid]

    async def _keepalives(self) -> None:
        # Ticks often enough for both jobs: a keepalive at most keepalive/2 late, and a dead
        # frontend's requests aborted within 1.25 leases of its last heartbeat (a 1 s tick let
        # them run up to lease + 1 s: with a 0.6 s lease, an engine worked 2x longer for nobody).
        tick = min(self.keepalive / 2, self.frontend_lease / 4)
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(tick)
            self.excuse(loop.time() - asked - tick)
            now = self._now()
            self.check_frontends(now)
            for out in list(self._streams.values()):
                if now - out.last >= self.keepalive:
                    self._send(out, [])


# ---------------------------------------------------------------------------------------------
# process entry point
# ---------------------------------------------------------------------------------------------
def default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


#: called with the worker before it joins the bus; returns what to await when it stops (``thunderagent worker
#: --metrics-port``: its metrics endpoint, started and stopped with it)
OnStarted = Callable[["WorkerService"], Awaitable[Callable[[], Awaitable[None]]]]


async def run_worker(cfg: Config, worker_id: str, node_index: int = 0, endpoint: int = 0,
                     prefix: str = "ta", on_started: OnStarted | None = None) -> None:
    """Run one worker until SIGTERM / SIGINT, on the bus of ``cfg.nats``."""
    from thunderagent.execution.factories import handle_builder

    nodes = cfg.execution_group.nodes
    if not 0 <= node_index < len(nodes):
        raise ValueError(f"--node {node_index} out of range: the config has {len(nodes)} node groups")
    node = nodes[node_index]
    check_token(worker_id, "worker id")
    info = WorkerInfo(worker_id, node.role.value, node.block_size, node.max_num_batched_tokens,
                      node.queue_depth_threshold, node.kv_blocks, node.max_batch_size, *node.sequence_limits(),
                      server=node.shared_server(endpoint))
    build = handle_builder(cfg, node, worker_id, endpoint)
    bus = NatsBus(cfg.nats.servers, f"worker {worker_id}", options=connect_options(cfg.nats))
    cp = cfg.control_plane  # frontends beat every heartbeat_interval, like workers
    spans = make_worker_spans(cp.tracing, worker_id, node.engine)  # (None: tracing off, nothing imported)
    service = WorkerService(bus, Subjects(prefix), info, node.engine, build,
                            frontend_lease=cp.heartbeat_interval * cp.heartbeat_misses,
                            sharded_kv=cfg.nats.index == "sharded", spans=spans)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = await on_started(service) if on_started is not None else None  # (a refusal: before the bus)
    await service.start()
    tune_gc()  # start-up done (gc_policy)
    try:
        await stop.wait()
    finally:
        log.info("worker %s shutting down", worker_id)
        with contextlib.suppress(Exception):
            await service.stop()
        if stopped is not None:
            await stopped()
        if spans is not None:
            await asyncio.to_thread(spans.shutdown)  # (the last spans flushed: bounded by the export timeout)
