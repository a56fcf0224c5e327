"""Cache migration under sustained skew: copy a hot worker's most-demanded prefixes to a worker with room.

Why: the cost function spreads a hot prefix only by *recomputing* it elsewhere (its load-shrunk cache
credit); when the prefixes are long (8-32 K tokens) and several of them sit on one backlogged worker,
every spread pays a long prefill on the target, and until then the requests queue behind the hot worker.
A copy over a fast link costs the target no compute, and lands before the demand does.

Pure and synchronous (``now`` passed in). A driver (the simulator on its virtual clock, the live fleet
on its health tick) calls:

* :meth:`Migrator.observe` for every routed request: the request's deepest known overlap (its *prefix*,
  at least ``min_prefix_tokens``) gets one more request of demand (decayed with ``demand_half_life_s``);
* :meth:`Migrator.tick` with the fleet's workers and the index: at most every ``interval_s`` it looks for
  **sources** (load at least ``hot_backlog_passes`` passes, or busy, for ``sustain_s`` without a break) and
  **targets** (neither hot nor busy, and load under ``room_backlog_passes`` passes or at least
  ``hot_backlog_passes`` passes below the source's: the cost function would then route the prefix's
  requests there once it holds it; a fleet under load has no idle worker), and plans copies of
  the sources' prefixes by falling demand (at least ``min_demand``): each to the least-loaded target that
  lacks it (targets given a copy in this look come last), through the plane's admission (``too_large``,
  ``target_full``), worth it only when the link's estimate is below the target's recompute time (its timing
  model, in passes of its batch) (``not_worth_it``), and only when the plane has room at once: a copy
  never queues in front of a prefill/decode handoff (``plane_busy``). A prefix that some worker with room
  already holds is not copied (routing already has a place for it). The driver starts each planned copy
  on the plane (:meth:`TransferPlane.start` returns it started) and pins the prefix on the source;
* :meth:`Migrator.finished` when the copy ended: the driver then imports the blocks into the target
  engine and :meth:`landed` predicts them in the index, so kv_aware routes the prefix's requests there.

*Load* is the cost function's own request-independent part (``router/cost.py`` ``base_load``: queued
prefill, decode weight x decode tokens, memory), in passes of the worker's ``max_num_batched_tokens``: the
cost function spills a prefix's requests to a worker without it once the holder's load exceeds the
prefix's length, so the copy is planned on the same measure, well below that point (a 32 K-token prefix
spills at about 4 passes; a source is hot at 1 by default), and lands before the recompute would start.

*Worth it* compares the link's estimate with the target's recompute time: its timing model, or, once the
driver reports the target server's own prefill figures (:meth:`Migrator.server_prefill`: vLLM's computed
prompt tokens and the seconds its requests spent in prefill, cumulative), the rate measured there (an
EWMA over readings of at least :data:`MIN_PREFILL_SAMPLE_TOKENS` new tokens): a configured timing model
says nothing of a real server's speed.

*Several frontends* (NATS): one plans the copies, on its own requests' demand plus what the others report
(:meth:`Migrator.shared_demand`: each frontend's most-demanded prefixes, by key, every look; :meth:`peer_demand`
takes them in, decaying from their arrival with the same half-life). A prefix counts the others' demand once this
frontend tracks it itself (it needs the prefix's blocks, and a real engine its tokens, to copy it): behind a
balancer a hot prefix reaches every frontend.

Refusals are counted by cause once per (look, prefix), ``no_target`` once per (look, source); with ``max_gbps``
a copy past the average rate waits (``rate_limited``), leaving the link to prefill/decode handoffs; counters
are plain fields (:meth:`stats`). Bounded: ``max_prefixes`` prefixes tracked (least recently requested
forgotten first), ``max_per_tick`` copies per look, one copy of a prefix in flight at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Sequence
from dataclasses import dataclass

from thunderagent.config import RoutingConfig
from thunderagent.engine.timing import TimingModel
from thunderagent.kv.index import KvIndex
from thunderagent.router.cost import base_load, is_busy
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import WorkerState

TID_PREFIX = "migrate-"
#: a server's prefill reading counts once this many computed tokens grew since the last one counted (a few
#: tiny prompts' passes are mostly overhead: they would understate its rate)
MIN_PREFILL_SAMPLE_TOKENS = 1024
#: weight of a new reading in a server's measured prefill rate
PREFILL_EWMA = 0.3
#: another frontend's demand report older than this (seconds) no longer counts (it stopped, or left)
PEER_DEMAND_TTL_S = 60.0
#: prefixes a frontend reports to the others per look, most demanded first
SHARED_PREFIXES = 64


@dataclass(slots=True, frozen=True)
class PrefixSource:
    """What a real engine needs to serve a prefix's copy, given to :meth:`Migrator.observe` by a live
    driver: the request's token ids (a reference: the migrator copies the prefix's part only when it starts
    tracking the prefix) and what keys the engine's own prefix cache besides them (vLLM salts its block hashes
    with ``cache_salt`` and the LoRA adapter's name)."""

    tokens: Sequence[int]
    hash_seed: int
    cache_salt: str | None = None
    lora_name: str | None = None

    def cut(self, n: int) -> PrefixSource:
        """This source's first ``n`` tokens, copied: an ``array("I")`` (4 bytes a token, not a list's ~36; token ids
        are below 2**32), filled by ``fromlist`` from a list (about 0.3x the time of ``array(type, iterable)``:
        ~1 ms for 100k tokens, paid once per newly tracked prefix)."""
        kept = array("I")
        t = self.tokens
        if isinstance(t, list):
            kept.fromlist(t[:n] if len(t) > n else t)
        else:
            kept.extend(t[:n])
        return PrefixSource(kept, self.hash_seed, self.cache_salt, self.lora_name)


@dataclass(slots=True, frozen=True)
class Migration:
    """One planned copy: ``hashes`` are the prefix's blocks the source holds (the target imports those it
    lacks); ``blocks`` / ``nbytes`` what moves; ``source``: the prefix's tokens (its ``n`` blocks and the token
    after them when the request had one) when the driver gave them."""

    tid: str
    src: str
    dst: str
    key: int  # the prefix's key (hash of its last block as requested)
    hashes: tuple[int, ...]
    blocks: int
    nbytes: int
    demand: float
    checks: tuple[int, ...] | None = None  # the blocks' check hashes (double-hash guard), None if unknown
    source: PrefixSource | None = None


class _Prefix:
    __slots__ = ("at", "checks", "count", "hashes", "source")

    def __init__(self, hashes: tuple[int, ...], checks: tuple[int, ...] | None, source: PrefixSource | None,
                 now: float) -> None:
        self.hashes = hashes
        self.checks = checks  # carried with a copy: imported blocks must verify like computed ones
        # real engines: a copy is a request for these tokens on each side (``control/cache_migration.py``)
        self.source = source
        self.count = 0.0  # decayed requests as of ``at``
        self.at = now


class Migrator:
    """The migration policy; ``plane`` is the fleet's transfer plane, ``timing`` the targets' timing model."""

    def __init__(self, routing: RoutingConfig, plane: TransferPlane, timing: TimingModel, block_size: int) -> None:
        self.routing = routing
        self.cfg = routing.migration
        self.plane = plane
        self.timing = timing
        self.block_size = block_size
        self._demand: dict[int, _Prefix] = {}  # prefix key (its last block's hash) -> demand; LRU order
        self._since: dict[str, float] = {}  # worker -> since when it is hot without a break
        self._next = 0.0  # the next look is due at
        self._active: dict[str, Migration] = {}  # in flight, by tid
        self._moving: set[int] = set()  # keys of prefixes in flight
        self._n = 0
        self.planned = 0
        self.completed = 0
        self.failed = 0
        self.bytes_moved = 0
        self.blocks_moved = 0
        self.refusals: dict[str, int] = {}
        # ``max_gbps``: a token bucket of bytes, one second of the rate deep, refilled at each look. A copy goes
        # while the level is above zero and takes its bytes (the level may go below: a copy larger than a
        # second's worth still goes, and the next wait as long as it took), so the average stays at the rate.
        self._rate = None if self.cfg.max_gbps is None else self.cfg.max_gbps * 1e9 / 8  # bytes/s
        self._level = self._rate or 0.0
        self._level_at: float | None = None
        self.prefill_tps: dict[str, float] = {}  # worker -> its server's measured prefill rate (tokens/s)
        self._prefill_seen: dict[str, tuple[float, float]] = {}  # worker -> (tokens, seconds) at the last sample
        self._peers: dict[str, tuple[float, dict[int, float]]] = {}  # frontend -> (when, prefix key -> demand)

    # -- demand ----------------------------------------------------------------------------------
    def observe(self, block_hashes: Sequence[int], depth: int, now: float,
                check_hashes: Sequence[int] | None = None, source: PrefixSource | None = None) -> None:
        """A request was routed; ``depth``: the most of its leading blocks any worker held;
        ``check_hashes``: its blocks' check hashes (double-hash guard on); ``source``: its tokens (a live
        fleet of real engines; the prefix's part, plus one token, is kept while the prefix is tracked)."""
        if depth <= 0 or depth * self.block_size < self.cfg.min_prefix_tokens:
            return
        key = block_hashes[depth - 1]
        table = self._demand
        p = table.pop(key, None)
        if p is None:
            checks = tuple(check_hashes[:depth]) if check_hashes is not None and len(check_hashes) >= depth else None
            kept = None if source is None else source.cut(depth * self.block_size + 1)
            p = _Prefix(tuple(block_hashes[:depth]), checks, kept, now)
            if len(table) >= self.cfg.max_prefixes:
                del table[next(iter(table))]  # least recently requested
        table[key] = p  # most recent last
        p.count = self._decayed(p, now) + 1.0
        p.at = now

    def demand(self, key: int, now: float) -> float:
        """A tracked prefix's demand: this frontend's requests, plus the other frontends' reports."""
        p = self._demand.get(key)
        return 0.0 if p is None else self._decayed(p, now) + self._from_peers(key, now)

    def _decayed(self, p: _Prefix, now: float) -> float:
        return p.count * 0.5 ** (max(0.0, now - p.at) / self.cfg.demand_half_life_s)

    def _from_peers(self, key: int, now: float) -> float:
        if not self._peers:  # (one frontend: nothing to add)
            return 0.0
        hl = self.cfg.demand_half_life_s
        return sum(d[key] * 0.5 ** (max(0.0, now - at) / hl) for at, d in self._peers.values()
                   if key in d and now - at <= PEER_DEMAND_TTL_S)

    def shared_demand(self, now: float) -> list[tuple[int, float]]:
        """This frontend's own demand to report to the others: its :data:`SHARED_PREFIXES` most-demanded prefixes,
        (key, demand now)."""
        own = sorted(((self._decayed(p, now), k) for k, p in self._demand.items()), reverse=True)
        return [(k, d) for d, k in own[:SHARED_PREFIXES] if d > 0.0]

    def peer_demand(self, frontend_id: str, entries: Sequence[tuple[int, float]], now: float) -> None:
        """Another frontend's report (:meth:`shared_demand`), arrived ``now``: it replaces that frontend's last;
        reports older than :data:`PEER_DEMAND_TTL_S` are dropped."""
        self._peers[frontend_id] = (now, {int(k): float(d) for k, d in entries[:SHARED_PREFIXES] if d > 0.0})
        for f in [f for f, (at, _) in self._peers.items() if now - at > PEER_DEMAND_TTL_S]:
            del self._peers[f]

    def demand_from(self, now: float) -> list[str]:
        """The frontends whose reports count now."""
        return sorted(f for f, (at, _) in self._peers.items() if now - at <= PEER_DEMAND_TTL_S)

    # -- planning --------------------------------------------------------------------------------
    def tick(self, workers: Sequence[WorkerState], index: KvIndex, now: float) -> list[Migration]:
        """Copies to start now (each started on the plane by the caller, which has room for all)."""
        cfg = self.cfg
        if now < self._next:
            return []
        self._next = now + cfg.interval_s
        self._refill(now)
        sources: list[tuple[float, WorkerState]] = []
        others: list[tuple[float, WorkerState]] = []  # neither hot nor busy
        since: dict[str, float] = {}
        for w in workers:
            if w.role == "prefill":  # serves remote prefills only: routing never sends a prefix's requests there
                continue
            q = base_load(w, self.routing)
            if is_busy(w, self.routing) or q >= cfg.hot_backlog_passes * w.max_num_batched_tokens:
                t0 = since[w.worker_id] = self._since.get(w.worker_id, now)
                if now - t0 >= cfg.sustain_s:
                    sources.append((q, w))
            else:
                others.append((q, w))
        self._since = since  # a worker that cooled down (or left) starts afresh
        if not sources:
            return []
        sources.sort(key=lambda x: -x[0])
        ranked = self._ranked(now)
        given: dict[str, int] = {}  # target -> copies planned for it in this look
        out: list[Migration] = []
        for load, src in sources:
            # room: under room_backlog_passes, or a hot threshold's worth of passes below this source (the
            # cost function would route the prefix's requests there once it holds it)
            batch = src.max_num_batched_tokens
            targets = [w for q, w in others
                       if q < cfg.room_backlog_passes * batch or q <= load - cfg.hot_backlog_passes * batch]
            if not targets:
                self._refuse("no_target")
                continue
            self._copies(src.worker_id, ranked, targets, given, out, index, now, cfg.min_demand)
        return out

    def evacuate(self, src: str, workers: Sequence[WorkerState], index: KvIndex, now: float) -> list[Migration]:
        """Copies of the prefixes worker ``src`` holds, for it is leaving (an operator's removal): the tracked ones
        it holds at least ``min_prefix_tokens`` of and no other worker holds as deeply, by falling demand, each to
        the least-loaded other worker (not busy, not a prefill worker), through :meth:`tick`'s admission (plane,
        worth, rate); at most ``max_per_tick``. The caller starts them as it does :meth:`tick`'s."""
        targets = [w for w in workers
                   if w.worker_id != src and w.role != "prefill" and not is_busy(w, self.routing)]
        if not targets:
            self._refuse("no_target")
            return []
        self._refill(now)
        out: list[Migration] = []
        self._copies(src, self._ranked(now), targets, {}, out, index, now, 0.0)  # leaving: any demand counts
        return out

    def _copies(self, src: str, ranked: list[tuple[float, int, _Prefix]], targets: list[WorkerState],
                given: dict[str, int], out: list[Migration], index: KvIndex, now: float, min_demand: float) -> None:
        """Plan into ``out`` copies of ``src``'s prefixes (``ranked``, by falling demand, down to ``min_demand``)
        that no worker of ``targets`` holds as deeply, up to ``max_per_tick`` in all. Work: one index match per
        tracked prefix at most (``max_prefixes``, each O(its blocks))."""
        cfg = self.cfg
        for dem, key, p in ranked:
            if dem < min_demand or len(out) >= cfg.max_per_tick:
                break
            if key in self._moving:
                continue
            held = index.find_matches(p.hashes, now)
            n = held.get(src, 0)
            if n * self.block_size < cfg.min_prefix_tokens:
                continue  # not this source's prefix
            if any(held.get(w.worker_id, 0) >= n for w in targets):
                continue  # a worker with room holds it: routing already has a place for it
            mig = self._plan(src, p, n, dem, held, targets, given, out)
            if mig is not None:
                out.append(mig)

    def _plan(self, src: str, p: _Prefix, n: int, dem: float, held: dict[str, int],
              targets: list[WorkerState], given: dict[str, int], planned: list[Migration]) -> Migration | None:
        plane, bs = self.plane, self.block_size
        dst = min(targets, key=lambda w: (given.get(w.worker_id, 0), base_load(w, self.routing),
                                          -held.get(w.worker_id, 0)))
        blocks = n - held.get(dst.worker_id, 0)
        nbytes = plane.bytes_for(blocks * bs)
        why = plane.refusal(nbytes, blocks, dst.load.kv_active_blocks, dst.load.kv_total_blocks)
        if why is None and plane.estimate(src, dst.worker_id, nbytes) >= self.recompute_s(
                blocks * bs, dst.max_num_batched_tokens, dst.worker_id):
            why = "not_worth_it"
        if why is None and not self._room(nbytes, planned):
            why = "plane_busy"
        if why is None and self._rate is not None and self._level <= 0:
            why = "rate_limited"  # (max_gbps)
        if why is not None:
            self._refuse(why)
            return None
        if self._rate is not None:
            self._level -= nbytes
        self._n += 1
        mig = Migration(f"{TID_PREFIX}{self._n}", src, dst.worker_id, p.hashes[-1], p.hashes[:n], blocks,
                        nbytes, dem, None if p.checks is None else p.checks[:n],
                        None if p.source is None else p.source.cut(n * bs + 1))
        given[dst.worker_id] = given.get(dst.worker_id, 0) + 1
        self._active[mig.tid] = mig
        self._moving.add(mig.key)
        self.planned += 1
        return mig

    def _ranked(self, now: float) -> list[tuple[float, int, _Prefix]]:
        """The tracked prefixes by falling demand: (demand, key, prefix)."""
        return sorted(((self._decayed(p, now) + self._from_peers(k, now), k, p) for k, p in self._demand.items()),
                      key=lambda x: -x[0])

    def _refill(self, now: float) -> None:
        """``max_gbps``' bucket, refilled up to ``now``."""
        if self._rate is not None:
            if self._level_at is not None:
                self._level = min(self._rate, self._level + (now - self._level_at) * self._rate)
            self._level_at = now

    def _room(self, nbytes: int, planned: list[Migration]) -> bool:
        """The plane would start this copy at once after the ones ``planned`` in this look (never queued
        in front of a prefill/decode handoff)."""
        p = self.plane
        return (not p.queue and len(p.inflight) + len(planned) < p.cfg.max_inflight
                and p.inflight_bytes + sum(m.nbytes for m in planned) + nbytes <= p.cfg.max_inflight_bytes)

    def server_prefill(self, worker_id: str, tokens: float, seconds: float) -> None:
        """Worker ``worker_id``'s server computed ``tokens`` prompt tokens (cached ones not counted) in requests that
        spent ``seconds`` in prefill, so far (cumulative, vLLM's per-request histograms' sums). The growth since
        the last sample, once it reaches :data:`MIN_PREFILL_SAMPLE_TOKENS`, is a sample of its prefill rate; a
        reading below the last (a restart) is only the new baseline."""
        last = self._prefill_seen.get(worker_id)
        if last is None or tokens < last[0] or seconds < last[1]:
            self._prefill_seen[worker_id] = (tokens, seconds)
            return
        dt, ds = tokens - last[0], seconds - last[1]
        if dt < MIN_PREFILL_SAMPLE_TOKENS or ds <= 0:
            return
        self._prefill_seen[worker_id] = (tokens, seconds)
        rate, old = dt / ds, self.prefill_tps.get(worker_id)
        self.prefill_tps[worker_id] = rate if old is None else (1 - PREFILL_EWMA) * old + PREFILL_EWMA * rate

    def forget_departed(self, present: Container[str]) -> None:
        """Workers not in ``present`` left: their measured rates go (one back under its id measures again)."""
        for w in [w for w in self._prefill_seen if w not in present]:
            self.prefill_tps.pop(w, None)
            del self._prefill_seen[w]

    def recompute_s(self, tokens: int, batch: int, worker_id: str | None = None) -> float:
        """Seconds a target needs to prefill ``tokens``: at its server's measured rate when known
        (:meth:`server_prefill`), else in passes of ``batch`` tokens of its timing model."""
        if worker_id is not None and (tps := self.prefill_tps.get(worker_id)):
            return tokens / tps
        full, rest = divmod(tokens, batch)
        t = full * self.timing.pass_time(batch, 0, 1, False) if full else 0.0
        return t + (self.timing.pass_time(rest, 0, 1, False) if rest else 0.0)

    def _refuse(self, cause: str) -> None:
        self.refusals[cause] = self.refusals.get(cause, 0) + 1

    # -- lifecycle -------------------------------------------------------------------------------
    def finished(self, tid: str, ok: bool) -> Migration:
        """Copy ``tid`` ended (``ok``: its bytes arrived). The caller imports the blocks on success and
        calls :meth:`landed`."""
        mig = self._active.pop(tid)
        self._moving.discard(mig.key)
        if ok:
            self.completed += 1
            self.bytes_moved += mig.nbytes
            self.blocks_moved += mig.blocks
        else:
            self.failed += 1
        return mig

    def landed(self, mig: Migration, index: KvIndex, now: float) -> None:
        """The target holds the prefix now: predicted there until its own events confirm it."""
        index.predict(mig.dst, mig.hashes, now, mig.checks)

    @property
    def inflight(self) -> int:
        return len(self._active)

    def stats(self) -> dict[str, object]:
        return {"planned": self.planned, "completed": self.completed, "failed": self.failed,
                "bytes_moved": self.bytes_moved, "blocks_moved": self.blocks_moved,
                "refusals": dict(self.refusals), "tracked_prefixes": len(self._demand),
                "measured_prefill_tps": {w: round(r, 1) for w, r in sorted(self.prefill_tps.items())}}
