"""Keeps a KvIndex in step with remote workers: live events, cache dumps, and the seam between them.

Pure and clock-free (``now`` is passed in). A frontend over NATS learns a worker's cache two ways:
the worker's KV event stream (per-worker ``seq``) and, when it first meets the worker or notices
lost events, a *dump* (all cached hashes plus the ``last_seq`` they include). The dump travels on
a different subscription than the events, so the two can arrive in any order. The seam:

- ``begin_sync`` is called *before* the dump is requested; from then on the worker's events are
  buffered, not applied;
- ``apply_dump`` replaces the worker's entries by the dump (``KvIndex.resync``) and then applies the
  buffered events: those with ``seq <= last_seq`` are already in the dump and the index ignores them
  as duplicates, later ones apply on top. If the buffered events do not start at ``last_seq + 1``,
  some were lost: the index marks a gap and ``apply_dump`` asks for another sync.

Events never reach the index out of order and none are applied twice, whichever of dump and
events comes first. Every method that returns ``True`` means "request a (new) dump of this worker".

With a sharded index (``nats.index: sharded``) a worker whose events another frontend indexes is
*remote* here (``release``): its entries are purged, its events and heartbeats' sequence numbers are
ignored, and routing learns its cache by asking that frontend; ``claim`` makes it indexed here again
(syncing: the caller then requests its dump).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from thunderagent.kv.index import EventResult, KvIndex
from thunderagent.types import KvEvent

#: events buffered per worker while its dump is in flight; past this the buffer is dropped and the
#: sync repeated (a dump that takes this long is stale anyway)
MAX_BUFFERED_EVENTS = 200_000


class _State:
    __slots__ = ("syncing", "buffer", "overflow", "remote", "hb_seq", "hb_prev")

    def __init__(self) -> None:
        self.remote = False  # indexed by another frontend (sharded index)
        self.hb_seq = self.hb_prev = -1  # the last two heartbeats' seqs (``lagged``)
        self.syncing = False
        self.buffer: list[KvEvent] = []
        self.overflow = False


class KvFeed:
    def __init__(self, index: KvIndex, max_buffered: int = MAX_BUFFERED_EVENTS) -> None:
        self.index = index
        self.max_buffered = max_buffered
        #: events and heartbeats come on separate subscriptions (sharded index): a heartbeat may overtake
        #: events sent before it, so a lost tail is judged on the previous heartbeat (a beat interval back)
        self.lagged = False
        self._st: dict[str, _State] = {}

    def add_worker(self, worker_id: str, *, live: bool = False) -> None:
        """A newly met worker, registered in the index: syncing (its events wait for its dump), or
        ``live`` when its cache is known to be empty (a new engine: its events apply at once)."""
        self.index.add_worker(worker_id)
        st = self._st.setdefault(worker_id, _State())
        st.syncing, st.buffer, st.overflow = not live, [], False

    def remove_worker(self, worker_id: str) -> int:
        """Forget a worker; returns the index entries purged."""
        self._st.pop(worker_id, None)
        return self.index.remove_worker(worker_id)

    def release(self, worker_id: str) -> None:
        """Another frontend indexes this worker from now on: purge its entries, ignore its events."""
        st = self._st.get(worker_id)
        if st is not None:
            st.remote, st.syncing, st.buffer, st.overflow = True, False, [], False
            self.index.resync(worker_id, (), -1)  # (its predictions go too)

    def claim(self, worker_id: str) -> None:
        """This frontend indexes the worker again: syncing, as when first met (request its dump)."""
        st = self._st.get(worker_id)
        if st is not None:
            st.remote, st.syncing, st.buffer, st.overflow = False, True, [], False

    def is_remote(self, worker_id: str) -> bool:
        st = self._st.get(worker_id)
        return st is not None and st.remote

    def is_syncing(self, worker_id: str) -> bool:
        st = self._st.get(worker_id)
        return st is not None and st.syncing

    def events(self, worker_id: str, events: Sequence[KvEvent], now: float) -> bool:
        st = self._st.get(worker_id)
        if st is None or st.remote:
            return False
        if st.syncing:
            if len(st.buffer) + len(events) > self.max_buffered:
                st.buffer = []
                st.overflow = True
            else:
                st.buffer.extend(events)
            return False
        return self._apply(events, now)

    def heartbeat(self, worker_id: str, last_seq: int) -> bool:
        """A heartbeat says the worker published events up to ``last_seq``; if the index has fewer,
        the tail of the stream was lost (no later event would reveal the gap)."""
        st = self._st.get(worker_id)
        if st is None or st.syncing or st.remote:
            return False
        if self.lagged:
            if last_seq != st.hb_seq:
                st.hb_prev, st.hb_seq = st.hb_seq, last_seq
            last_seq = st.hb_prev
        return last_seq > self.index.last_seq(worker_id)

    def begin_sync(self, worker_id: str) -> None:
        st = self._st.get(worker_id)
        if st is not None and not st.syncing and not st.remote:
            st.syncing, st.buffer, st.overflow = True, [], False

    def apply_dump(self, worker_id: str, hashes: Sequence[int], last_seq: int, now: float,
                   checks: Sequence[int] | None = None) -> bool:
        """``checks``: the dumped blocks' check hashes (double-hash guard); without them, with the
        guard on, the dumped entries are unverified (``kv.check``)."""
        st = self._st.get(worker_id)
        if st is None or st.remote:  # (a dump that arrives after the worker was released)
            return False
        self.index.resync(worker_id, hashes, last_seq, checks)
        return self._finish(st, now)

    def abandon_sync(self, worker_id: str, now: float) -> bool:
        """The worker cannot dump its cache: go live on events alone (the index stays as it is)."""
        st = self._st.get(worker_id)
        if st is None or st.remote:
            return False
        self._finish(st, now)
        return False  # asking again would get the same answer

    def _finish(self, st: _State, now: float) -> bool:
        buffered, overflow = st.buffer, st.overflow
        st.syncing, st.buffer, st.overflow = False, [], False
        gap = self._apply(buffered, now)
        return gap or overflow

    def _apply(self, events: Iterable[KvEvent], now: float) -> bool:
        gap = False
        apply = self.index.apply_event
        for ev in events:
            if apply(ev, now) is EventResult.GAP:
                gap = True
        return gap
