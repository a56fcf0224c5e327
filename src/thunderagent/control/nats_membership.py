"""NATS membership: the workers of one frontend process (``thunderagent frontend``) are discovered
on the bus.

- a worker appears on its first hello or heartbeat (``Heartbeat`` carries its static facts, so a
  frontend that missed the hello still finds it) and joins the fleet as a
  :class:`~thunderagent.control.remote_worker.RemoteWorker`;
- its lease is the fleet's heartbeat timeout (``heartbeat_interval x heartbeat_misses``): a worker
  that misses it, says ``bye``, cannot be reached (NATS "no responders"), or comes back as a new
  process (new ``instance``) leaves the fleet and its index entries are purged;
- identity is the subject (``<p>.worker.<id>.>``, ``<p>.reply.<id>.>``; NATS permissions keep each
  worker to its own): a message whose payload names another worker, or a stream message from
  another worker than the one serving the request, is ignored and counted; a new instance replaces
  a known one only when the known one no longer answers a ping (it crashed). Without that
  evidence anyone on the bus could end a worker's streams with one forged heartbeat;
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
from collections import Counter
from dataclasses import replace
from collections.abc import Callable
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
    decode_pong,
    decode_unavailable,
    events_from_wire,
    info_from_wire,
    join_dump,
    load_from_wire,
    message_limits,
)
from thunderagent.control.frontend_beats import FrontendBeats
from thunderagent.control.migration_peers import MigrationPeers
from thunderagent.control.index_shards import IndexShards
from thunderagent.control.abort_peers import AbortPeers
from thunderagent.control.planner_peers import PlannerPeers
from thunderagent.control.program_peers import ProgramPeers
from thunderagent.control.tenant_peers import TenantPeers
from thunderagent.control.marks import apply_asleep, apply_cordon, apply_paused
from thunderagent.control.remote_worker import RemoteLink, RemoteWorker
from thunderagent.types import LoadReport, PromptLimit

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
        probe_timeout: float = 1.0,
        warn_interval: float = 10.0,
    ) -> None:
        self.bus = bus
        self.subjects = Subjects(prefix)
        self.frontend_id = secrets.token_hex(4)
        self.link = RemoteLink(bus, self.subjects, self.frontend_id, self.drop)  # no responders: the worker is gone
        self.peers = ProgramPeers(bus, self.subjects, self.frontend_id)  # program releases reach every frontend
        self.tenants = TenantPeers(bus, self.subjects, self.frontend_id)  # tenant limits hold across frontends
        self.beats = FrontendBeats(bus, self.subjects, self.frontend_id)  # request lease; who acts for the planner
        self.planner_peers = PlannerPeers(bus, self.subjects, self.frontend_id)  # the fleet's traffic, not ours
        self.aborts = AbortPeers(bus, self.subjects, self.frontend_id,  # /abort_requests: their held requests too
                                 lambda: len(self.beats.leadership.live_peers()) if self.beats.leadership else 0)
        self.shards: IndexShards | None = None  # nats.index: sharded (control/index_shards.py)
        self.demand: MigrationPeers | None = None  # routing.migration: the frontends' demand (migration_peers.py)
        self._watched: set[str] = set()  # sharded: workers whose KV-event subject we subscribe to
        self._tasks: set[asyncio.Task[None]] = set()
        self.discovery_window = discovery_window
        self.sync_timeout = sync_timeout
        self.dump_timeout = dump_timeout
        #: a known instance that does not answer a ping within this is gone (a restart replaces it)
        self.probe_timeout = probe_timeout
        self.warn_interval = warn_interval
        #: messages ignored for what they claim, by kind: "identity" (payload names another worker than
        #: the subject), "incarnation" (a new instance held until the known one is proven gone),
        #: "refuted" (the known one answered), "stream" (outputs from a worker not serving the request)
        self.ignored: Counter[str] = Counter()
        self.remotes: dict[str, RemoteWorker] = {}
        #: seconds from start to an index rebuilt from every worker found at start
        self.index_rebuild_s: float | None = None
        self.dumps_applied = 0
        self._fleet: Fleet | None = None
        self._syncs: dict[str, asyncio.Task[None]] = {}
        self._warned: set[str] = set()
        self._limited: dict[str, tuple[float, int]] = {}  # key -> (time of the last warning, suppressed since)
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._challengers: dict[str, Heartbeat] = {}  # worker -> latest heartbeat of an unproven new instance
        self._probe_after: dict[str, float] = {}  # worker -> no new probe before (a refuted claim)

    @property
    def fleet(self) -> Fleet:
        assert self._fleet is not None, "NatsMembership.start() was not awaited"
        return self._fleet

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, fleet: Fleet) -> None:
        self._fleet = fleet
        t0 = fleet.now()
        await self.bus.connect()
        tokens, body = message_limits(self.bus.max_payload, fleet.block_size)
        fleet.prompt_limit = PromptLimit(tokens, "one request message to a worker can carry (the NATS server's "
                                         "max_payload)", body)
        cp = fleet.cfg.control_plane
        await self.beats.start(cp.heartbeat_interval, cp.heartbeat_interval * cp.heartbeat_misses,
                               fleet.planner.can_act, fleet.now, copies=fleet.cache_migration is not None)
        lead = self.beats.leadership
        assert lead is not None  # (set by start)
        fleet.planner.lead = lead  # one frontend runs the planner's command / webhook
        fleet.transfers.copy_gate = lead.copying  # one frontend plans cache migration's copies
        if fleet.cache_migration is not None:  # ... on the demand every frontend reports
            self.demand = MigrationPeers(self.bus, self.subjects, self.frontend_id, fleet.cache_migration.migrator)
            await self.demand.start(fleet.now)
        if fleet.planner.planner is not None:
            await self.planner_peers.start(fleet.now)
            fleet.planner.peers = self.planner_peers  # every planner judges every frontend's requests
        if fleet.cfg.nats.index == "sharded":
            self.shards = IndexShards(self.bus, self.subjects, self.frontend_id, fleet.cfg.nats.lookup_timeout_s)
            await self.shards.start(fleet, lead, self.claim, self.release, cp.heartbeat_interval)
            fleet.remote_lookup = self.shards.lookup
            fleet.dispatcher.before_route = self.shards.reenter  # held requests: their answers, again
            fleet.feed.lagged = True  # events on their own subscriptions: heartbeats may overtake them
        # sharded: hellos, heartbeats, byes only; each owned worker's events on a subscription of its own
        workers = self.subjects.all_workers() if self.shards is None else self.subjects.worker_control()
        await self.bus.subscribe(workers, self._on_worker_msg)
        await self.bus.subscribe(self.subjects.replies(self.frontend_id), self._on_reply)
        await self.peers.start(fleet.release_program)  # another frontend's client released a program
        await self.aborts.start(fleet.abort_held)
        fleet.held_peers = self.aborts.abort_elsewhere
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
        for task in [*self._syncs.values(), *self._probes.values()]:
            task.cancel()
        await self.beats.stop()
        for part in (self.shards, self.demand):
            if part is not None:
                await part.stop()
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
            "instances": {w: r.instance for w, r in sorted(self.remotes.items())},
            "ignored_messages": dict(self.ignored),
            "programs_released_for_peers": self.peers.released_for_peers,
            "held_aborted_for_peers": self.aborts.aborted_for_peers,
            "tenant_reports": {"sent": self.tenants.reports_sent, "taken": self.tenants.reports_taken},
            "planner_leadership": (None if self.beats.leadership is None
                                   else self.beats.leadership.summary(self.fleet.now())),
            "planner_counters_from": self.planner_peers.shared.origins(),
            "index": {"mode": "replica"} if self.shards is None else self.shards.summary(),
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
                if fleet.feed.is_remote(wid):  # sharded: another frontend indexes it
                    return
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
        if hb.version != WIRE_VERSION:
            self._warn_once(f"version:{wid}", "worker %s speaks wire version %d, this frontend %d: ignored",
                            wid, hb.version, WIRE_VERSION)
            return
        if hb.info.worker_id != wid:
            self._ignore("identity", wid, "a heartbeat on worker %s's subject claims to be worker %s: ignored",
                         wid, hb.info.worker_id)
            return
        known = self._instance(wid)
        if known is not None and known != hb.instance:
            self._challenge(wid, known, hb)
            return
        load = load_from_wire(hb.load, wid)
        if known is None and not self._add(wid, hb, load):
            return
        worker = self.remotes[wid]
        worker.on_heartbeat(load)
        fleet = self.fleet
        if known is not None:
            self._restate(wid, hb)
        if hb.cordoned != (wid in fleet.cordoned):  # (an operator's, through any frontend)
            apply_cordon(fleet, wid, hb.cordoned, "its heartbeat says so")
        if hb.asleep != (wid in fleet.asleep):
            apply_asleep(fleet, wid, hb.asleep, "its heartbeat says so")
        if hb.paused != (wid in fleet.paused):
            apply_paused(fleet, wid, hb.paused, "its heartbeat says so")
        if hb.kv_pulls is not None:  # (the links learn)
            fleet.transfers.on_server_pulls(wid, *hb.kv_pulls, fleet.now())
        if hb.prefill is not None:  # (cache migration's recompute times)
            fleet.transfers.on_server_prefill(wid, *hb.prefill)
        fleet.on_heartbeat(wid, worker.load())
        if fleet.feed.heartbeat(wid, hb.last_seq):
            log.warning("worker %s published events up to seq %d, index has %d: resyncing",
                        wid, hb.last_seq, fleet.index.last_seq(wid))
            fleet.resync_worker(wid, "tail_lost")

    async def set_cordon(self, worker_id: str, cordoned: bool) -> None:
        """Tell the worker to keep (or drop) its cordon mark; returns once it confirmed (its heartbeat with the mark
        went out before the answer). TimeoutError: no answer within ``probe_timeout``."""
        reply = self.subjects.call_reply(worker_id, self.frontend_id, secrets.token_hex(6))
        try:
            await self.bus.request_many(self.subjects.rpc(worker_id, "cordon"), b"1" if cordoned else b"0",
                                        self.probe_timeout, _pong_from(self._instance(worker_id)), reply)
        except BusError as e:
            raise TimeoutError(str(e)) from None

    def _restate(self, wid: str, hb: Heartbeat) -> None:
        """A known worker's heartbeat states other limits (its engine reported max_model_len) or LoRA adapters:
        take them (one restate; the common heartbeat, unchanged, allocates nothing more)."""
        registry = self.fleet.registry
        try:
            info = registry.info(wid)
        except KeyError:  # left meanwhile
            return
        new = info_from_wire(hb.info)
        limits = (new.max_seq_tokens, new.max_prompt_tokens)
        if limits == (info.max_seq_tokens, info.max_prompt_tokens) and new.adapters == info.adapters:
            return
        registry.restate(replace(info, max_seq_tokens=limits[0], max_prompt_tokens=limits[1], adapters=new.adapters))
        if limits != (info.max_seq_tokens, info.max_prompt_tokens):
            self._update_context_limit()

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
        if self.shards is not None and not self.shards.owns(wid):
            fleet.feed.release(wid)  # another frontend indexes it: asked at each decision
        else:
            self._syncs[wid] = asyncio.create_task(self._sync(wid, hb.instance), name=f"sync-{wid}")
        log.info("worker %s joined (%s engine, instance %s)", wid, hb.info.engine, hb.instance)
        return True

    # -- a new instance of a known worker: a restart only with evidence -----------------------
    def _challenge(self, wid: str, known: str, hb: Heartbeat) -> None:
        """``hb`` claims a new process behind worker ``wid``. A restart (the old process crashed)
        looks like this, and so does a forgery or a second process given the same id. The claim is
        held, and the known instance pinged: if it answers, it is alive and the claim is ignored;
        if not, it is gone, and the new instance replaces it. (A clean stop said bye, and a silent
        worker's lease expires: both remove the known instance without a probe.)"""
        self.ignored["incarnation"] += 1
        self._challengers[wid] = hb
        if wid not in self._probes and self.fleet.now() >= self._probe_after.get(wid, 0.0):
            self._probes[wid] = asyncio.create_task(self._probe(wid, known), name=f"probe-{wid}")

    async def _probe(self, wid: str, known: str) -> None:
        try:
            alive = await self._answers(wid, known)
            hb = self._challengers.pop(wid, None)
            current = self._instance(wid)
            if alive and current == known:
                self._probe_after[wid] = self.fleet.now() + max(5.0, 5 * self.probe_timeout)
                self._ignore("refuted", wid, "worker %s: instance %s claimed to replace the running instance %s, "
                             "which still answers: ignored (forged, or two workers share the id)",
                             wid, "?" if hb is None else hb.instance, known)
                return
            if current == known:
                self.drop(wid, "restarted")
            if hb is not None and self._instance(wid) is None:
                self.on_heartbeat_msg(wid, hb)  # the new process, registered from its latest heartbeat
        finally:
            if self._probes.get(wid) is asyncio.current_task():
                del self._probes[wid]

    async def _answers(self, wid: str, instance: str) -> bool:
        """Does ``instance`` of ``wid`` answer a ping within ``probe_timeout`` (of on-time loop)?"""
        is_it = _pong_from(instance)
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            reply = self.subjects.call_reply(wid, self.frontend_id, secrets.token_hex(6))
            asked = loop.time()
            try:
                await self.bus.request_many(self.subjects.rpc(wid, "ping"), b"", self.probe_timeout, is_it, reply)
                return True
            except BusError:
                return False
            except TimeoutError:
                # A timeout that fired late says our loop was starved: the pong may be waiting unread
                # (liveness counts on-time loop, as LoopLag does), so the known instance is asked once
                # more rather than dropped with its requests.
                if attempt or loop.time() - asked < 1.5 * self.probe_timeout:
                    return False
        return False

    def drop(self, wid: str, reason: str, *, drain: bool = False) -> None:
        """Remove a worker from this frontend's fleet; see :meth:`Fleet.leave` for its requests."""
        if wid not in self._probes:
            self._challengers.pop(wid, None)
        if self.remotes.pop(wid, None) is None:
            return
        task = self._syncs.pop(wid, None)
        if task is not None:
            task.cancel()
        self._unwatch(wid)
        self.fleet.leave(wid, reason, drain=drain)
        self._update_context_limit()

    def lease_expired(self, worker_id: str) -> None:
        self.drop(worker_id, "lease expired")

    def _update_context_limit(self) -> None:
        """Longest sequence a worker can hold, when every worker states one (simulated ones: their KV
        pool); else unknown (real engines say so themselves)."""
        self.fleet.max_context_tokens = self.fleet.registry.context_limit()

    # -- KV index ----------------------------------------------------------------------------
    def resync(self, worker_id: str) -> None:
        worker = self.remotes.get(worker_id)
        if worker_id in self._syncs or worker is None or self.fleet.feed.is_remote(worker_id):
            return
        self.fleet.feed.begin_sync(worker_id)
        self._syncs[worker_id] = asyncio.create_task(self._sync(worker_id, worker.instance), name=f"sync-{worker_id}")

    def claim(self, worker_id: str) -> None:
        """Sharded index: this frontend indexes the worker from now on (its events, its dump)."""
        worker = self.remotes.get(worker_id)
        if worker is None:
            return
        self.fleet.feed.claim(worker_id)
        if worker_id not in self._syncs:
            self._syncs[worker_id] = asyncio.create_task(self._sync(worker_id, worker.instance),
                                                         name=f"sync-{worker_id}")

    def release(self, worker_id: str) -> None:
        """Sharded index: another frontend indexes the worker from now on."""
        task = self._syncs.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self.fleet.feed.release(worker_id)
        self._unwatch(worker_id)

    def _unwatch(self, worker_id: str) -> None:
        """Stop receiving a worker's sharded KV events (released, or gone)."""
        if worker_id in self._watched:
            self._watched.discard(worker_id)
            task = asyncio.get_running_loop().create_task(
                self.bus.unsubscribe(self.subjects.worker_kv(worker_id, sharded=True)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _sync(self, wid: str, instance: str) -> None:
        """Dump the worker's cache into the index; retried with backoff while the worker is here."""
        delay = 0.1
        feed = self.fleet.feed
        try:
            if self.shards is not None and wid not in self._watched:  # its events first (buffered), then the dump
                await self.bus.subscribe(self.subjects.worker_kv(wid, sharded=True), self._on_worker_msg)
                self._watched.add(wid)
            while self._instance(wid) == instance:
                try:
                    replies = await self.bus.request_many(
                        self.subjects.rpc(wid, "dump"), b"", self.dump_timeout,
                        lambda m: decode_dump_chunk(m.data).final,
                        self.subjects.call_reply(wid, self.frontend_id, secrets.token_hex(6)),
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
                    again = feed.apply_dump(wid, dump.hashes, dump.last_seq, now, dump.checks)
                    self.dumps_applied += 1
                if not again:
                    return
                feed.begin_sync(wid)
        finally:
            if self._syncs.get(wid) is asyncio.current_task():
                del self._syncs[wid]

    # -- requests ----------------------------------------------------------------------------
    async def _on_reply(self, msg: BusMsg) -> None:
        parsed = self.subjects.parse_reply(msg.subject)
        if parsed is None:
            return
        wid, rid = parsed
        owner = self.link.owners.get(rid)
        if owner is None:
            return  # finished or aborted: late messages are normal
        if owner.worker_id != wid:
            self._ignore("stream", wid, "worker %s sent outputs of request %s, which %s serves: ignored",
                         wid, rid, owner.worker_id)
            return
        owner.on_stream(rid, msg)

    def _ignore(self, kind: str, wid: str, fmt: str, *args: object) -> None:
        """Count a message ignored for what it claims; warn at most every ``warn_interval`` seconds
        per kind and worker (a flood of forgeries must not flood the log)."""
        self.ignored[kind] += 1
        key = f"{kind}:{wid}"
        now = self.fleet.now()
        last, suppressed = self._limited.get(key, (float("-inf"), 0))
        if now - last < self.warn_interval:
            self._limited[key] = (last, suppressed + 1)
            return
        self._limited[key] = (now, 0)
        more = f" ({suppressed} more since the last warning)" if suppressed else ""
        log.warning(fmt + more, *args)

    def _warn_once(self, key: str, fmt: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(fmt, *args)


def _pong_from(instance: str | None) -> Callable[[BusMsg], bool]:
    """An answer that is ``instance``'s Pong (a garbage answer proves nothing either way)."""
    def is_it(msg: BusMsg) -> bool:
        try:
            return decode_pong(msg.data).instance == instance
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
    return is_it
