"""The control plane of one frontend process (``thunderagent frontend``): workers found over NATS.

:class:`NatsFleet` is the in-process :class:`Fleet` (same registry, index, router, streaming and
metrics) whose workers are not built from the config but *discovered* on the bus:

- a worker appears on its first hello or heartbeat (``Heartbeat`` carries its static facts, so a
  frontend that missed the hello still finds it) and gets a :class:`RemoteWorker` handle;
- its lease is the registry's heartbeat timeout (``heartbeat_interval x heartbeat_misses``): a
  worker that misses it, says ``bye``, cannot be reached (NATS "no responders"), or comes back as a
  new process (new ``instance``) leaves the fleet and its index entries are purged;
- its cache enters the index from a dump (on first meeting, and whenever events were lost), then
  from its KV events; :class:`~thunderagent.control.kv_sync.KvFeed` joins the two seamlessly.

Every frontend subscribes to the same worker subjects, so replicas hold the same fleet and the same
(confirmed) index; a restarted frontend asks every worker to announce itself and dumps them before
it starts serving HTTP (``index_rebuild_s`` in ``/health``).

Requests never hang. A request its worker has not accepted yet when the worker is lost ends with
``finish_reason="unavailable"``, which the fleet routes again to another worker (the client sees
nothing). An accepted one ends with ``"error"`` (a 502 when nothing was generated yet), and so does a
stream that hears nothing (no output, no keepalive) for ``STALL_TIMEOUT_S``. A worker that says
``bye`` leaves routing at once but drains: its requests in flight keep streaming.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from dataclasses import dataclass

import msgspec

from thunderagent.config import Config, Policy
from thunderagent.control.kv_sync import KvFeed
from thunderagent.control.nats_bus import Bus, BusError, BusMsg
from thunderagent.control.registry import Health
from thunderagent.control.wire import (
    STALL_TIMEOUT_S,
    WIRE_VERSION,
    Abort,
    Heartbeat,
    Subjects,
    decode_bye,
    decode_dump_chunk,
    decode_heartbeat,
    decode_kv,
    decode_tokens,
    decode_unavailable,
    encode,
    events_from_wire,
    info_from_wire,
    join_dump,
    load_from_wire,
    output_from_wire,
    request_to_wire,
)
from thunderagent.server.fleet import Fleet
from thunderagent.server.tokenizer import Tokenizer
from thunderagent.server.worker_handle import UNAVAILABLE
from thunderagent.types import EngineRequest, KvEvent, LoadReport, TokenOutput

log = logging.getLogger(__name__)

#: finish reason of a request cut off by its worker's loss (as real-engine adapters report it)
ERROR = "error"


@dataclass(slots=True)
class _Stream:
    req: EngineRequest
    queue: asyncio.Queue[TokenOutput]
    last: float  # loop time of submission or of the last message
    next_n: int = 0
    accepted: bool = False


class RemoteWorker:
    """WorkerHandle of a worker process reached over the bus. Owned by its :class:`NatsFleet`."""

    def __init__(self, fleet: NatsFleet, worker_id: str, instance: str, load: LoadReport,
                 engine: str = "simulated") -> None:
        self.worker_id = worker_id
        self.instance = instance
        self.engine = engine
        self.heartbeats_paused = False  # protocol attribute; a remote worker's heartbeats are its own
        self._fleet = fleet
        self._load = load
        self._streams: dict[str, _Stream] = {}
        # prompt tokens of requests sent since the last heartbeat: counted as waiting until the
        # worker's own report includes them (two quick requests must not both see an idle worker)
        self._unreported: dict[str, int] = {}

    # -- WorkerHandle ------------------------------------------------------------------------
    def start(self) -> None:
        pass

    async def stop(self) -> None:
        for st in self.take_streams():
            self._fleet.finish(st, "abort")  # this frontend shuts down

    def submit(self, req: EngineRequest) -> asyncio.Queue[TokenOutput]:
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self.attach(req, queue)
        return queue

    def abort(self, request_id: str) -> None:
        self._fleet.abort(request_id)

    def load(self) -> LoadReport:
        if not self._unreported:
            return self._load
        return dataclasses.replace(
            self._load,
            waiting=self._load.waiting + len(self._unreported),
            queued_prefill_tokens=self._load.queued_prefill_tokens + sum(self._unreported.values()),
        )

    def snapshot(self) -> tuple[list[int], int] | None:
        return None  # dumps are asynchronous: the fleet requests them itself (NatsFleet._sync)

    # -- fleet side --------------------------------------------------------------------------
    def attach(self, req: EngineRequest, queue: asyncio.Queue[TokenOutput]) -> None:
        fleet = self._fleet
        rid = req.request_id
        self._streams[rid] = _Stream(req, queue, fleet.now())
        fleet.owners[rid] = self
        self._unreported[rid] = len(req.prompt_tokens)
        fleet.bus.publish(fleet.subjects.rpc(self.worker_id, "generate"), encode(request_to_wire(req)),
                          reply=f"{fleet.inbox}.{rid}")

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def detach(self, request_id: str) -> _Stream | None:
        self._unreported.pop(request_id, None)
        if self._fleet.owners.get(request_id) is self:
            del self._fleet.owners[request_id]
        return self._streams.pop(request_id, None)

    def take_streams(self) -> list[_Stream]:
        return [st for rid in list(self._streams) if (st := self.detach(rid)) is not None]

    def on_heartbeat(self, load: LoadReport) -> None:
        self._load = load
        self._unreported.clear()

    def on_stream(self, request_id: str, msg: BusMsg, now: float) -> None:
        st = self._streams.get(request_id)
        if st is None:
            return
        fleet = self._fleet
        if msg.no_responders:
            fleet.drop_worker(self.worker_id, "unreachable (no responders)")  # this request is routed again
            return
        batch = decode_tokens(msg.data)
        if batch.n != st.next_n:
            log.warning("request %s on %s: output message %d lost", request_id, self.worker_id, st.next_n)
            self.detach(request_id)
            fleet.send_abort(self.worker_id, request_id)
            fleet.finish(st, ERROR)
            return
        if batch.error:
            log.warning("request %s refused by %s: %s", request_id, self.worker_id, batch.error)
        st.next_n += 1
        st.last = now
        st.accepted = True
        for w in batch.outputs:
            out = output_from_wire(request_id, w)
            st.queue.put_nowait(out)
            if out.finished:
                self.detach(request_id)
                return

    def stalled(self, now: float, timeout: float) -> list[_Stream]:
        """Detach and return the streams that heard nothing for ``timeout`` seconds."""
        late = [rid for rid, st in self._streams.items() if now - st.last > timeout]
        return [st for rid in late if (st := self.detach(rid)) is not None]


class NatsFleet(Fleet):
    def __init__(
        self,
        cfg: Config,
        bus: Bus,
        *,
        prefix: str = "ta",
        policy: Policy | None = None,
        tokenizer: Tokenizer | None = None,
        discovery_window: float = 0.25,
        sync_timeout: float = 1.5,
        dump_timeout: float = 1.0,
        stall_timeout: float = STALL_TIMEOUT_S,
    ) -> None:
        super().__init__(cfg, policy=policy, tokenizer=tokenizer)
        self.bus = bus
        self.subjects = Subjects(prefix)
        self.frontend_id = secrets.token_hex(4)
        self.inbox = self.subjects.inbox(self.frontend_id)
        self.feed = KvFeed(self.index)
        self.owners: dict[str, RemoteWorker] = {}  # request id -> worker currently serving it
        self.discovery_window = discovery_window
        self.sync_timeout = sync_timeout
        self.dump_timeout = dump_timeout
        self.stall_timeout = stall_timeout
        #: seconds from start to an index rebuilt from every worker found at start
        self.index_rebuild_s: float | None = None
        self.dumps_applied = 0
        self._syncs: dict[str, asyncio.Task[None]] = {}
        self._draining: list[RemoteWorker] = []  # gone from routing, finishing their requests
        self._warned: set[str] = set()
        self.max_context_tokens = None  # known once workers announce themselves

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        t0 = self.now()
        await self.bus.connect()
        await self.bus.subscribe(self.subjects.all_workers(), self._on_worker_msg)
        await self.bus.subscribe(f"{self.inbox}.*", self._on_inbox)
        self.bus.publish(self.subjects.discover(), b"")
        # Workers answer a discover within milliseconds; each one met starts its dump at once.
        await asyncio.sleep(self.discovery_window)
        pending = list(self._syncs.values())
        if pending:
            await asyncio.wait(pending, timeout=self.sync_timeout)
        self.index_rebuild_s = self.now() - t0
        log.info("frontend %s: %d workers, index rebuilt with %d blocks in %.3fs",
                 self.frontend_id, len(self.workers), self.index.num_blocks(), self.index_rebuild_s)
        if self.cfg.control_plane.health_check_enabled:
            self._health_task = asyncio.create_task(self._health_loop(), name="health")

    async def stop(self) -> None:
        for task in self._syncs.values():
            task.cancel()
        for worker in self._draining:
            await worker.stop()
        await super().stop()
        await self.bus.close()

    # -- worker messages (one subscription: in publication order per worker) ----------------
    async def _on_worker_msg(self, msg: BusMsg) -> None:
        parsed = self.subjects.parse_worker(msg.subject)
        if parsed is None:
            return
        wid, kind = parsed
        try:
            if kind in ("hb", "hello"):
                self.on_heartbeat_msg(wid, decode_heartbeat(msg.data))
            elif kind == "kv":
                batch = decode_kv(msg.data)
                if self._instance(wid) == batch.instance:
                    self._on_events(wid, events_from_wire(wid, batch.events))
            elif kind == "bye":
                if self._instance(wid) == decode_bye(msg.data).instance:
                    self.drop_worker(wid, "shutting down", drain=True)
            elif kind == "unavailable":
                u = decode_unavailable(msg.data)
                if self._instance(wid) == u.instance:
                    self._on_unavailable(wid, u.reason)  # out of routing until its next heartbeat
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._warn_once(f"bad:{wid}", "undecodable %s message from %s: %s", kind, wid, exc)

    def _instance(self, wid: str) -> str | None:
        w = self.workers.get(wid)
        return w.instance if isinstance(w, RemoteWorker) else None

    def on_heartbeat_msg(self, wid: str, hb: Heartbeat) -> None:
        if hb.version != WIRE_VERSION or hb.info.worker_id != wid:
            self._warn_once(f"version:{wid}", "worker %s speaks wire version %d (id %s), this frontend %d: ignored",
                            wid, hb.version, hb.info.worker_id, WIRE_VERSION)
            return
        known = self._instance(wid)
        if known is not None and known != hb.instance:
            self.drop_worker(wid, "restarted")
            known = None
        load = load_from_wire(hb.load, wid)
        if known is None and not self._add_worker(wid, hb, load):
            return
        worker = self.workers[wid]
        assert isinstance(worker, RemoteWorker)
        worker.on_heartbeat(load)
        self._on_heartbeat(wid, load)
        if self.feed.heartbeat(wid, hb.last_seq):
            log.warning("worker %s published events up to seq %d, index has %d: resyncing",
                        wid, hb.last_seq, self.index.last_seq(wid))
            self._start_sync(wid)

    def _add_worker(self, wid: str, hb: Heartbeat, load: LoadReport) -> bool:
        info = info_from_wire(hb.info)
        if info.block_size != self.block_size:
            self._warn_once(f"bs:{wid}", "worker %s has block_size %d, this frontend hashes %d-token blocks: "
                            "ignored (give both the same config)", wid, info.block_size, self.block_size)
            return False
        self.registry.register(info, self.now())
        self.feed.add_worker(wid)  # syncing: its events wait for its dump
        self.workers[wid] = RemoteWorker(self, wid, hb.instance, load, hb.info.engine)
        self._update_context_limit()
        self._syncs[wid] = asyncio.create_task(self._sync(wid, hb.instance), name=f"sync-{wid}")
        log.info("worker %s joined (%s engine, instance %s)", wid, hb.info.engine, hb.instance)
        return True

    def drop_worker(self, wid: str, reason: str, *, drain: bool = False) -> None:
        """Remove a worker from this frontend's fleet (registry, index, routing). Its requests in
        flight end (see the module docstring), unless ``drain``: a worker shutting down cleanly
        finishes them, and its streams stay until then (or until they stall)."""
        worker = self.workers.pop(wid, None)
        if worker is None:
            return
        assert isinstance(worker, RemoteWorker)
        self.registry.deregister(wid)
        purged = self.feed.remove_worker(wid)
        task = self._syncs.pop(wid, None)
        if task is not None:
            task.cancel()
        self._unavailable.pop(wid, None)
        self.metrics.healthy.labels(wid).set(0)
        self._update_context_limit()
        log.warning("worker %s left: %s; %d index entries purged, %d requests in flight%s", wid, reason, purged,
                    worker.in_flight, " (draining)" if drain and worker.in_flight else "")
        if drain:
            if worker.in_flight:
                self._draining.append(worker)
            return
        for st in worker.take_streams():
            self.finish(st, ERROR if st.accepted else UNAVAILABLE)

    def _update_context_limit(self) -> None:
        """Longest sequence a worker can hold, when every worker is simulated (their KV pool); else
        unknown (real engines say so themselves)."""
        infos = [(self.registry.info(w), self.workers[w]) for w in self.registry.worker_ids()]
        if infos and all(isinstance(h, RemoteWorker) and h.engine == "simulated" for _, h in infos):
            self.max_context_tokens = max(i.kv_total_blocks * i.block_size for i, _ in infos)
        else:
            self.max_context_tokens = None

    # -- KV index ----------------------------------------------------------------------------
    def _on_events(self, worker_id: str, events: list[KvEvent]) -> None:
        if self.feed.events(worker_id, events, self.now()):
            log.warning("KV event gap from %s: resyncing from a dump", worker_id)
            self._start_sync(worker_id)

    def _resync(self, worker_id: str) -> None:
        self._start_sync(worker_id)

    def _start_sync(self, wid: str) -> None:
        worker = self.workers.get(wid)
        if wid in self._syncs or not isinstance(worker, RemoteWorker):
            return
        self.feed.begin_sync(wid)
        self._syncs[wid] = asyncio.create_task(self._sync(wid, worker.instance), name=f"sync-{wid}")

    async def _sync(self, wid: str, instance: str) -> None:
        """Dump the worker's cache into the index; retried with backoff while the worker is here."""
        delay = 0.1
        try:
            while self._instance(wid) == instance:
                try:
                    replies = await self.bus.request_many(
                        self.subjects.rpc(wid, "dump"), b"", self.dump_timeout,
                        lambda m: decode_dump_chunk(m.data).final,
                    )
                    dump = join_dump([decode_dump_chunk(m.data) for m in replies])
                except (TimeoutError, BusError, ValueError, msgspec.DecodeError) as exc:
                    log.warning("dump of %s failed (%r): retrying in %.1fs", wid, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 2.0)
                    continue
                if dump.instance != instance:
                    return  # a new process answered; its own hello replaces this worker
                now = self.now()
                if dump.hashes is None:
                    again = self.feed.abandon_sync(wid, now)
                else:
                    again = self.feed.apply_dump(wid, dump.hashes, dump.last_seq, now)
                    self.dumps_applied += 1
                if not again:
                    return
                self.feed.begin_sync(wid)
        finally:
            if self._syncs.get(wid) is asyncio.current_task():
                del self._syncs[wid]

    # -- requests ----------------------------------------------------------------------------
    async def _on_inbox(self, msg: BusMsg) -> None:
        rid = msg.subject.rsplit(".", 1)[1]
        owner = self.owners.get(rid)
        if owner is not None:
            owner.on_stream(rid, msg, self.now())

    def abort(self, request_id: str) -> None:
        owner = self.owners.get(request_id)
        if owner is not None and owner.detach(request_id) is not None:
            self.send_abort(owner.worker_id, request_id)

    def send_abort(self, worker_id: str, request_id: str) -> None:
        self.bus.publish(self.subjects.rpc(worker_id, "abort"), encode(Abort(request_id)))

    def finish(self, st: _Stream, reason: str) -> None:
        st.queue.put_nowait(TokenOutput(st.req.request_id, [], self.now(), len(st.req.prompt_tokens), 0, True, reason))

    # -- health ------------------------------------------------------------------------------
    def check_health(self) -> None:
        now = self.now()
        for change in self.registry.check(now):
            if change.health is Health.unhealthy:
                self.drop_worker(change.worker_id, f"lease expired: {change.reason}")
        self._draining = [w for w in self._draining if w.in_flight]
        for worker in [*self.workers.values(), *self._draining]:
            assert isinstance(worker, RemoteWorker)
            for st in worker.stalled(now, self.stall_timeout):
                log.warning("request %s on %s: nothing heard for %.1fs", st.req.request_id, worker.worker_id,
                            self.stall_timeout)
                self.send_abort(worker.worker_id, st.req.request_id)
                self.finish(st, ERROR if st.accepted else UNAVAILABLE)

    def health_summary(self) -> dict[str, object]:
        summary = super().health_summary()
        summary["frontend"] = {
            "id": self.frontend_id,
            "index_rebuild_s": None if self.index_rebuild_s is None else round(self.index_rebuild_s, 4),
            "syncing": sorted(w for w in self.workers if self.feed.is_syncing(w)),
            "dumps_applied": self.dumps_applied,
        }
        return summary

    def _warn_once(self, key: str, fmt: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(fmt, *args)

