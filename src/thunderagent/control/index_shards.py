"""A KV index sharded across the frontends of one bus (``nats.index: sharded``).

With ``replica`` (the default) every frontend applies every worker's KV events: one frontend's core
then bounds the fleet (README "At fleet scale": ~320-380 workers prefilling flat out). Sharded, each
worker's events are applied by one frontend only, its *owner*, and the others ask it at each routing
decision:

- **Ownership** is rendezvous hashing of the worker id over the live frontends (the frontends' beats,
  ``control/frontend_beats.py``): every frontend computes the same owner from the same set, a frontend
  that joins or leaves moves only the workers it gains or loses. A frontend owns every worker until it has
  heard the others (at start, or when it cannot hear the beats at all): it then indexes too much, never too
  little. A worker it stops owning is released (its entries purged, its events ignored: ``KvFeed.release``);
  one it starts owning is claimed and dumped, as a newly met worker is.
- **Lookups**: before a request is routed, the frontend asks every other live frontend
  (``<p>.frontend.<id>.match``) how many leading blocks of the prompt each worker it owns holds (its
  index's ``find_matches``: events, and its own routing's predictions), waits at most
  ``nats.lookup_timeout_s``, and enters each answer into its own index as a short-lived prediction
  (``KvIndex.predict(short=True)``, 1 s), so everything that reads the index (the router, the scheduler's
  dispatch, grouping) sees the other frontends' workers too. A late or missing answer counts as no match
  for that decision (counted in ``/health``); the routing itself never waits longer.

What it costs: one round trip per decision (the lookups to all the other frontends go out together), and
each frontend answers every other frontend's decisions (an index lookup each). What it saves: each
frontend applies 1/N of the fleet's events. ``bench/index_lookup.py`` measures both sides; README "At
fleet scale" shows the crossover. A request held in the scheduler queue is routed on what the lookup said
when it arrived: the dispatcher re-enters its answers just before routing it (``reenter``), as fresh 1 s
entries, however long it waited (the workers may have evicted since: as stale as a prediction).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import xxhash
from prometheus_client import Counter, Gauge

from thunderagent.bus.nats import Bus, BusMsg
from thunderagent.bus.packing import pack_u64, unpack_u64
from thunderagent.bus.wire import MatchAnswer, MatchAsk, Subjects, decode_match_answer, decode_match_ask, encode
from thunderagent.control.leadership import Leadership
from thunderagent.types import EngineRequest

if TYPE_CHECKING:
    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)

#: requests whose answers are kept for a later dispatch (the oldest go first: bounds cancelled requests')
MAX_KEPT = 65_536
#: the frontends' states in which the set of live frontends is known (see ``Leadership.state``)
_SETTLED = ("alone", "leader", "follower")


def owner(worker_id: str, frontends: Sequence[str]) -> str:
    """The frontend that indexes ``worker_id``: highest rendezvous weight (a frontend leaving moves only its
    own workers, one joining takes ~1/N of each other's)."""
    return max(frontends, key=lambda f: (xxhash.xxh64_intdigest(f"{f}\x00{worker_id}".encode()), f))


class IndexShards:
    def __init__(self, bus: Bus, subjects: Subjects, frontend_id: str, timeout: float) -> None:
        self.bus = bus
        self.subjects = subjects
        self.frontend_id = frontend_id
        self.timeout = timeout
        self.frontends: list[str] = [frontend_id]  # the live set ownership was last computed on
        self.stats = {"asked": 0, "answered": 0, "late": 0, "gone": 0, "answered_for_peers": 0,
                      "claimed": 0, "released": 0}
        self._fleet: Fleet | None = None
        self._lead: Leadership | None = None
        self._claim: Callable[[str], None] = lambda wid: None
        self._release: Callable[[str], None] = lambda wid: None
        self._pending: dict[str, asyncio.Future[MatchAnswer | None]] = {}
        self._answers: dict[str, list[tuple[str, int]]] = {}  # request id -> the others' answers (insertion order)
        self._entered: dict[str, float] = {}  # request id -> when its answers were last entered into the index
        self._tokens = itertools.count()
        self._task: asyncio.Task[None] | None = None

    async def start(self, fleet: Fleet, lead: Leadership, claim: Callable[[str], None],
                    release: Callable[[str], None], interval: float) -> None:
        """``claim`` / ``release``: the membership's (dump a worker into the index / purge it)."""
        self._fleet, self._lead, self._claim, self._release = fleet, lead, claim, release
        r = fleet.metrics.registry
        self._asks = Counter("thunderagent_index_lookups_total", "Sharded index: asks to the other frontends, by "
                             "outcome (answered, late: past nats.lookup_timeout_s, gone: nobody answers there)",
                             ["outcome"], registry=r)
        self._served = Counter("thunderagent_index_lookups_served_total", "Sharded index: the other frontends' "
                               "asks this one answered", registry=r)
        self._owned = Gauge("thunderagent_index_owned_workers", "Sharded index: workers whose KV events this "
                            "frontend applies", registry=r)
        await self.bus.subscribe(self.subjects.match(self.frontend_id), self._on_ask)
        await self.bus.subscribe(self.subjects.match_reply(self.frontend_id, "*"), self._on_answer)
        self._task = asyncio.create_task(self._refresh_loop(interval), name="index-shards")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def owns(self, worker_id: str) -> bool:
        return owner(worker_id, self.frontends) == self.frontend_id

    # -- ownership -------------------------------------------------------------------------------
    async def _refresh_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self.refresh()
            except Exception:  # one bad look must not end ownership for good
                log.exception("sharded index: ownership refresh failed")

    def refresh(self) -> None:
        """Recompute the live set (when it is known) and claim / release the workers whose owner changed."""
        assert self._fleet is not None and self._lead is not None
        if self._lead.state(self._fleet.now()) in _SETTLED:
            self.frontends = sorted([self.frontend_id, *(p.frontend_id for p in self._lead.live_peers())])
        feed = self._fleet.feed
        owned = 0
        for wid in list(self._fleet.workers):
            mine = self.owns(wid)
            owned += mine
            if mine and feed.is_remote(wid):
                self.stats["claimed"] += 1
                self._claim(wid)
            elif not mine and not feed.is_remote(wid):
                self.stats["released"] += 1
                self._release(wid)
        self._owned.set(owned)

    # -- lookups ---------------------------------------------------------------------------------
    async def lookup(self, req: EngineRequest, now: float) -> None:
        """Ask the other frontends how much of this request's prompt their workers hold; enter the answers
        into the index as short predictions (a late answer: none), and keep them for :meth:`reenter`."""
        block_hashes, check_hashes = req.block_hashes, req.check_hashes
        peers = [f for f in self.frontends if f != self.frontend_id]
        if not peers or not block_hashes or self._fleet is None:
            return
        body = encode(MatchAsk(pack_u64(block_hashes), None if check_hashes is None else pack_u64(check_hashes)))
        loop = asyncio.get_running_loop()
        futs = []
        for peer in peers:
            token = f"{next(self._tokens)}"
            fut: asyncio.Future[MatchAnswer | None] = loop.create_future()
            self._pending[token] = fut
            futs.append((token, fut))
            self.bus.publish(self.subjects.match(peer), body, reply=self.subjects.match_reply(self.frontend_id, token))
        self.stats["asked"] += len(futs)
        try:
            await asyncio.wait([f for _, f in futs], timeout=self.timeout)
        finally:
            for token, _ in futs:
                self._pending.pop(token, None)
        found: list[tuple[str, int]] = []
        for _, fut in futs:
            if not fut.done():
                fut.cancel()
                self._count("late")
                continue
            answer = fut.result()
            if answer is None:
                self._count("gone")
                continue
            self._count("answered")
            found.extend((wid, n) for wid, n in answer.matches if 0 < n <= len(block_hashes))
        if found:
            self._answers[req.request_id] = found
            if len(self._answers) > MAX_KEPT:
                oldest = next(iter(self._answers))  # a request long gone (cancelled)
                del self._answers[oldest]
                self._entered.pop(oldest, None)
            self.reenter(req, now)

    def reenter(self, req: EngineRequest, now: float) -> None:
        """Enter the answers this request got into the index again, valid from ``now`` (the dispatcher calls
        it just before routing: a request held in the queue is routed on them past their first second)."""
        found = self._answers.get(req.request_id)
        if not found or self._fleet is None:
            return
        index, feed, checks = self._fleet.index, self._fleet.feed, req.check_hashes
        if now < self._entered.get(req.request_id, -math.inf) + index.short_ttl:
            return  # entered at the lookup and still live (a request routed at once: no second pass over them)
        self._entered[req.request_id] = now
        for wid, n in found:
            if feed.is_remote(wid):  # (ours: our own entries are exact)
                index.predict(wid, req.block_hashes[:n], now, None if checks is None else checks[:n], short=True)

    def _count(self, outcome: str) -> None:
        self.stats[outcome] += 1
        self._asks.labels(outcome).inc()

    async def _on_answer(self, msg: BusMsg) -> None:
        fut = self._pending.get(msg.subject.rsplit(".", 1)[-1])
        if fut is None or fut.done():
            return  # late: the decision went on without it
        if msg.no_responders:  # that frontend is gone (or indexes nothing: replica mode)
            fut.set_result(None)
            return
        try:
            fut.set_result(decode_match_answer(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            fut.set_result(None)

    async def _on_ask(self, msg: BusMsg) -> None:
        if not msg.reply or self._fleet is None:
            return
        try:
            ask = decode_match_ask(msg.data)
            hashes = unpack_u64(ask.hashes)
            checks = None if ask.checks is None else unpack_u64(ask.checks)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            return
        if checks is not None and len(checks) != len(hashes):
            return
        fleet = self._fleet
        feed = fleet.feed
        found = fleet.index.find_matches(hashes, fleet.now(), checks)
        matches = [(w, n) for w, n in found.items() if not feed.is_remote(w) and not feed.is_syncing(w)]
        self.stats["answered_for_peers"] += 1
        self._served.inc()
        self.bus.publish(msg.reply, encode(MatchAnswer(self.frontend_id, matches)))

    def summary(self) -> dict[str, object]:
        feed = self._fleet.feed if self._fleet is not None else None
        owned = [] if feed is None else sorted(w for w in self._fleet.workers if not feed.is_remote(w))  # type: ignore[union-attr]
        return {"mode": "sharded", "frontends": list(self.frontends), "owned": owned, **self.stats}
