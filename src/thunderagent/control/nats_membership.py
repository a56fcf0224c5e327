"""NATS membership: the workers of one frontend process (``thunderagent frontend``) are discovered
on the bus.

- a worker appears on its first hello or heartbeat (``Heartbeat`` carries its static facts, so a
  frontend that missed the hello still finds it) and joins the fleet as a
  :class:`~thunderagent.control.remote_worker.RemoteWorker`;
- its lease is the fleet's heartbeat timeout (``heartbeat_interval x heartbeat_misses``): a worker
  that misses it, says ``bye``, cannot be reached (NATS "no responders"), or comes back as a new
  process (new ``instance``) leaves the fleet and its index entries are purged;
- its cache enters the index from a dump (on first meeting, and whenever events were lost), then
  from its KV events; the fleet's :class:`~thunderagent.kv.feed.KvFeed` joins the two seamlessly.

Every frontend subscribes to the same worker subjects, so replicas hold the same fleet and the same
(confirmed) index; a restarted frontend asks every worker to announce itself and dumps them before
it starts serving HTTP (``index_rebuild_s`` in ``/health``). A worker that says ``bye`` leaves
routing at once but drains: its requests in flight keep streaming (the fleet's stall check still
watches them).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING

import msgspec

from thunderagent.bus.nats import Bus, BusError, BusMsg
from thunderagent.bus.wire import (
    WIRE_VERSION,
    Heartbeat,
    Subjects,
    decode_bye,
    decode_dump_chunk,
    decode_heartbeat,
    decode_kv,
    decode_unavailable,
    events_from_wire,
    info_from_wire,
    join_dump,
    load_from_wire,
)
from thunderagent.control.remote_worker import RemoteLink, RemoteWorker
from thunderagent.types import LoadReport

if TYPE_CHECKING:
    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)


class NatsMembership:
    def __init__(
        self,
        bus: Bus,
        *,
        prefix: str = "ta",
        discovery_window: float = 0.25,
        sync_timeout: float = 1.5,
        dump_timeout: float = 1.0,
    ) -> None:
        self.bus = bus
        self.subjects = Subjects(prefix)
        self.frontend_id = secrets.token_hex(4)
        self.inbox = self.subjects.inbox(self.frontend_id)
        self.link = RemoteLink(bus, self.subjects, self.inbox, self.drop)  # no responders: the worker is gone
        self.discovery_window = discovery_window
        self.sync_timeout = sync_timeout
        self.dump_timeout = dump_timeout
        self.remotes: dict[str, RemoteWorker] = {}
        #: seconds from start to an index rebuilt from every worker found at start
        self.index_rebuild_s: float | None = None
        self.dumps_applied = 0
        self._fleet: Fleet | None = None
        self._syncs: dict[str, asyncio.Task[None]] = {}
        self._warned: set[str] = set()

    @property
    def fleet(self) -> Fleet:
        assert self._fleet is not None, "NatsMembership.start() was not awaited"
        return self._fleet

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, fleet: Fleet) -> None:
        self._fleet = fleet
        t0 = fleet.now()
        await self.bus.connect()
        await self.bus.subscribe(self.subjects.all_workers(), self._on_worker_msg)
        await self.bus.subscribe(f"{self.inbox}.*", self._on_inbox)
        self.bus.publish(self.subjects.discover(), b"")
        # Workers answer a discover within milliseconds; each one met starts its dump at once.
        await asyncio.sleep(self.discovery_window)
        pending = list(self._syncs.values())
        if pending:
            await asyncio.wait(pending, timeout=self.sync_timeout)
        self.index_rebuild_s = fleet.now() - t0
        log.info("frontend %s: %d workers, index rebuilt with %d blocks in %.3fs",
                 self.frontend_id, len(self.remotes), fleet.index.num_blocks(), self.index_rebuild_s)

    async def stop(self) -> None:
        for task in self._syncs.values():
            task.cancel()
        # every worker still serving a request of ours, draining ones included
        for worker in {*self.remotes.values(), *self.link.owners.values()}:
            await worker.stop()
        await self.bus.close()

    def summary(self) -> dict[str, object]:
        feed = self.fleet.feed
        return {"frontend": {
            "id": self.frontend_id,
            "index_rebuild_s": None if self.index_rebuild_s is None else round(self.index_rebuild_s, 4),
            "syncing": sorted(w for w in self.remotes if feed.is_syncing(w)),
            "dumps_applied": self.dumps_applied,
        }}

    # -- worker messages (one subscription: in publication order per worker) ----------------
    async def _on_worker_msg(self, msg: BusMsg) -> None:
        parsed = self.subjects.parse_worker(msg.subject)
        if parsed is None:
            return
        wid, kind = parsed
        fleet = self.fleet
        try:
            if kind in ("hb", "hello"):
                self.on_heartbeat_msg(wid, decode_heartbeat(msg.data))
            elif kind == "kv":
                batch = decode_kv(msg.data)
                if self._instance(wid) == batch.instance:
                    fleet.on_events(wid, events_from_wire(wid, batch.events))
            elif kind == "bye":
                if self._instance(wid) == decode_bye(msg.data).instance:
                    self.drop(wid, "shutting down", drain=True)
            elif kind == "unavailable":
                u = decode_unavailable(msg.data)
                if self._instance(wid) == u.instance:
                    fleet.on_unavailable(wid, u.reason)  # out of routing until its next heartbeat
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._warn_once(f"bad:{wid}", "undecodable %s message from %s: %s", kind, wid, exc)

    def _instance(self, wid: str) -> str | None:
        w = self.remotes.get(wid)
        return None if w is None else w.instance

    def on_heartbeat_msg(self, wid: str, hb: Heartbeat) -> None:
        if hb.version != WIRE_VERSION or hb.info.worker_id != wid:
            self._warn_once(f"version:{wid}", "worker %s speaks wire version %d (id %s), this frontend %d: ignored",
                            wid, hb.version, hb.info.worker_id, WIRE_VERSION)
            return
        known = self._instance(wid)
        if known is not None and known != hb.instance:
            self.drop(wid, "restarted")
            known = None
        load = load_from_wire(hb.load, wid)
        if known is None and not self._add(wid, hb, load):
            return
        worker = self.remotes[wid]
        worker.on_heartbeat(load)
        fleet = self.fleet
        fleet.on_heartbeat(wid, worker.load())
        if fleet.feed.heartbeat(wid, hb.last_seq):
            log.warning("worker %s published events up to seq %d, index has %d: resyncing",
                        wid, hb.last_seq, fleet.index.last_seq(wid))
            self.resync(wid)

    def _add(self, wid: str, hb: Heartbeat, load: LoadReport) -> bool:
        fleet = self.fleet
        info = info_from_wire(hb.info)
        if info.block_size != fleet.block_size:
            self._warn_once(f"bs:{wid}", "worker %s has block_size %d, this frontend hashes %d-token blocks: "
                            "ignored (give both the same config)", wid, info.block_size, fleet.block_size)
            return False
        worker = RemoteWorker(self.link, wid, hb.instance, load, fleet.callbacks(), hb.info.engine)
        self.remotes[wid] = worker
        fleet.join(worker, info, synced=False)  # its events wait for its dump
        self._update_context_limit()
        self._syncs[wid] = asyncio.create_task(self._sync(wid, hb.instance), name=f"sync-{wid}")
        log.info("worker %s joined (%s engine, instance %s)", wid, hb.info.engine, hb.instance)
        return True

    def drop(self, wid: str, reason: str, *, drain: bool = False) -> None:
        """Remove a worker from this frontend's fleet; see :meth:`Fleet.leave` for its requests."""
        if self.remotes.pop(wid, None) is None:
            return
        task = self._syncs.pop(wid, None)
        if task is not None:
            task.cancel()
        self.fleet.leave(wid, reason, drain=drain)
        self._update_context_limit()

    def lease_expired(self, worker_id: str) -> None:
        self.drop(worker_id, "lease expired")

    def _update_context_limit(self) -> None:
        """Longest sequence a worker can hold, when every worker is simulated (their KV pool); else
        unknown (real engines say so themselves)."""
        fleet = self.fleet
        if self.remotes and all(w.engine == "simulated" for w in self.remotes.values()):
            infos = [fleet.registry.info(w) for w in self.remotes]
            fleet.max_context_tokens = max(i.kv_total_blocks * i.block_size for i in infos)
        else:
            fleet.max_context_tokens = None

    # -- KV index ----------------------------------------------------------------------------
    def resync(self, worker_id: str) -> None:
        worker = self.remotes.get(worker_id)
        if worker_id in self._syncs or worker is None:
            return
        self.fleet.feed.begin_sync(worker_id)
        self._syncs[worker_id] = asyncio.create_task(self._sync(worker_id, worker.instance), name=f"sync-{worker_id}")

    async def _sync(self, wid: str, instance: str) -> None:
        """Dump the worker's cache into the index; retried with backoff while the worker is here."""
        delay = 0.1
        feed = self.fleet.feed
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
                now = self.fleet.now()
                if dump.hashes is None:
                    again = feed.abandon_sync(wid, now)
                else:
                    again = feed.apply_dump(wid, dump.hashes, dump.last_seq, now)
                    self.dumps_applied += 1
                if not again:
                    return
                feed.begin_sync(wid)
        finally:
            if self._syncs.get(wid) is asyncio.current_task():
                del self._syncs[wid]

    # -- requests ----------------------------------------------------------------------------
    async def _on_inbox(self, msg: BusMsg) -> None:
        rid = msg.subject.rsplit(".", 1)[1]
        owner = self.link.owners.get(rid)
        if owner is not None:
            owner.on_stream(rid, msg)

    def _warn_once(self, key: str, fmt: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(fmt, *args)
