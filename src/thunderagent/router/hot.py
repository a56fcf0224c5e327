"""Hot prefixes: replicas for a prefix whose demand exceeds what its holders can serve.

The cost function alone keeps sending a prefix's requests to the workers that hold it: elsewhere
they pay the whole prefix again. Its load-shrunk cache credit spreads them only once a holder is
several passes behind. When one prefix draws more traffic than its holders can prefill, that
leaves its requests queued behind each other while other workers idle.

**Hot.** For a request, the *prefix* is its leading blocks held by the deepest holders (the largest
overlap of any worker, at least ``min_prefix_tokens``); it is keyed by the hash of its last block,
which names the whole chain. The prefix is hot for this request when

* every holder is overloaded: busy, or ``hot_backlog_passes`` passes of queued prefill or more, and
* some other worker has room: not busy, under ``room_backlog_passes`` passes of queued prefill.

**Replicas.** Once ``min_requests`` requests found the prefix hot (none more than ``retire_after_s``
after the previous), a hot request goes to a *new replica*: the lowest-cost worker with room, even
though it prefills the prefix once. That request warms it: the index predicts the prefix there, so
the replica is a holder for the next requests and the cost function balances between the copies.
A prefix gets at most ``max_replicas`` replicas; a new one is added only while all copies
(replicas included) are overloaded. At the cap, the cost function decides alone.

**Retirement** (hysteresis in time): each ``retire_after_s`` without the prefix being hot retires
its newest replica; the prefix is forgotten once none is left. A retired replica keeps its cache
(the cost function may still use it); it no longer counts against the cap. A replica that is not
among the routable workers when a replica is added is dropped from the set (it left routing).

The table is bounded (``max_prefixes``, least recently hot forgotten first) and is updated lazily,
on the requests of the prefix itself: retirement is a pure function of (replicas, last hot, now),
so no sweep is needed and nothing reads a clock.

Hot path: a request whose largest overlap is under ``min_prefix_tokens`` costs one pass over the
candidates; one with a holder that has room costs a second pass; only a hot prefix touches the table.
"""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.config import HotPrefixConfig
from thunderagent.router.cost import queued_prefill
from thunderagent.router.policies import Candidate
from thunderagent.decision import HotPrefixNote


class _Hot:
    """One hot prefix: its replica set (oldest first), when it was last hot, and how many requests
    found it hot since it was first seen hot (counts toward ``min_requests``)."""

    __slots__ = ("replicas", "last_hot", "sightings")

    def __init__(self, now: float) -> None:
        self.replicas: list[str] = []
        self.last_hot = now
        self.sightings = 0


class HotPrefixes:
    """The replica sets of hot prefixes. Pure: ``now`` is passed in."""

    __slots__ = ("cfg", "_table", "added", "to_replicas")

    def __init__(self, cfg: HotPrefixConfig) -> None:
        self.cfg = cfg
        self.added = 0  # replicas added so far (requests sent to warm one)
        self.to_replicas = 0  # requests that went to a replica (steered or chosen by the cost)
        # prefix key (hash of its last block) -> state; insertion order = least recently hot first
        self._table: dict[int, _Hot] = {}

    def tracked(self) -> int:
        """Prefixes in the table (hot lately, with or without replicas)."""
        return len(self._table)

    def live_replicas(self, now: float) -> int:
        """Replicas not retired at ``now``, over every tracked prefix (O(``max_prefixes``))."""
        return sum(len(self._live(e, now)) for e in self._table.values())

    def replicas(self, key: int, now: float) -> tuple[str, ...]:
        """The live replica set of the prefix whose last block hashes to ``key`` (oldest first)."""
        e = self._table.get(key)
        return () if e is None else tuple(self._live(e, now))

    def steer(
        self, block_hashes: Sequence[int], cands: Sequence[Candidate], now: float
    ) -> tuple[int, HotPrefixNote | None]:
        """``(i, note)``: ``i >= 0`` sends the request to ``cands[i]``, a new replica (``note.added``);
        ``i == -1`` leaves the choice to the policy, and ``note`` (when not None) names the prefix's
        live replicas, to explain a choice that lands on one of them."""
        cfg = self.cfg
        depth = 0
        for c in cands:
            if c.score.overlap_blocks > depth:
                depth = c.score.overlap_blocks
        if not depth or depth * cands[0].worker.block_size < cfg.min_prefix_tokens:
            return -1, None
        key = block_hashes[depth - 1]
        holders = self._overloaded_holders(cands, depth)
        if holders is None:  # a holder has room: not hot
            return -1, self._note(key, depth, (), now)
        room = self._best_with_room(cands, depth)
        if room < 0:  # nobody has room: the whole fleet is loaded, hits matter most
            return -1, self._note(key, depth, holders, now)
        e = self._sighting(key, now, cands)
        if e.sightings < cfg.min_requests:
            return -1, self._note(key, depth, holders, now)
        if e.replicas:  # a replica that lost the prefix (evicted, prediction expired): warm it again
            again = self._best_with_room(cands, depth, e.replicas)
            if again >= 0:
                return again, HotPrefixNote(depth, holders, tuple(e.replicas), False)
        if len(e.replicas) >= cfg.max_replicas:  # at the cap: the cost function decides alone
            return -1, self._note(key, depth, holders, now)
        e.replicas.append(cands[room].worker.worker_id)
        self.added += 1
        return room, HotPrefixNote(depth, holders, tuple(e.replicas), True)

    def reason(self, note: HotPrefixNote, block_size: int, worker_id: str, steered: bool) -> str:
        """The explanation of a choice that landed on a replica of ``note``'s prefix: ``steered`` there
        by :meth:`steer` (the whole reason), or chosen by the policy (a prefix to its reason)."""
        tokens = note.prefix_blocks * block_size
        if steered:
            what = (f"new replica {len(note.replicas)}/{self.cfg.max_replicas}" if note.added
                    else "its replica warmed again (it lost the prefix)")
            return (f"hot prefix ({tokens} tokens): all {len(note.holders)} holders ({', '.join(note.holders)}) "
                    f"backlogged >= {self.cfg.hot_backlog_passes:g} passes while {worker_id} has room: {what}")
        return f"replica of a hot prefix ({tokens} tokens, replicas {', '.join(note.replicas)}); "

    # -- internals -------------------------------------------------------------------------------
    def _overloaded_holders(self, cands: Sequence[Candidate], depth: int) -> tuple[str, ...] | None:
        """The holders' ids when every one is overloaded, else None."""
        passes = self.cfg.hot_backlog_passes
        for c in cands:  # first pass allocates nothing: most requests stop here
            s = c.score
            if s.overlap_blocks == depth and not s.busy and (
                queued_prefill(c.worker) < passes * c.worker.max_num_batched_tokens
            ):
                return None
        return tuple(c.worker.worker_id for c in cands if c.score.overlap_blocks == depth)

    def _best_with_room(self, cands: Sequence[Candidate], depth: int, among: list[str] | None = None) -> int:
        """Index of the lowest-cost non-holder with room (first on ties), or -1; ``among``: only those."""
        passes = self.cfg.room_backlog_passes
        best = -1
        for i, c in enumerate(cands):
            s = c.score
            if among is not None and c.worker.worker_id not in among:
                continue
            if s.overlap_blocks < depth and not s.busy and (
                queued_prefill(c.worker) < passes * c.worker.max_num_batched_tokens
            ) and (best < 0 or s.cost < cands[best].score.cost):
                best = i
        return best

    def _sighting(self, key: int, now: float, cands: Sequence[Candidate]) -> _Hot:
        """Record that a request found ``key`` hot at ``now`` (its state, created if new); replicas
        retired by now or absent from ``cands`` (they left routing) leave the set."""
        table = self._table
        e = table.pop(key, None)
        if e is None:
            e = _Hot(now)
            if len(table) >= self.cfg.max_prefixes:
                del table[next(iter(table))]  # least recently hot
        else:
            e.replicas = self._live(e, now)
            if now - e.last_hot >= self.cfg.retire_after_s:
                e.sightings = 0  # demand lapsed: count afresh
        table[key] = e  # most recently hot last
        if e.replicas:
            present = {c.worker.worker_id for c in cands}
            e.replicas = [w for w in e.replicas if w in present]
        e.last_hot = now
        e.sightings += 1
        return e

    def _note(self, key: int, depth: int, holders: tuple[str, ...], now: float) -> HotPrefixNote | None:
        e = self._table.get(key)
        if e is None:
            return None
        live = self._live(e, now)
        if not live:
            if now - e.last_hot >= self.cfg.retire_after_s:
                del self._table[key]  # retired: forget it
            return None
        return HotPrefixNote(depth, holders, tuple(live), False)

    def _live(self, e: _Hot, now: float) -> list[str]:
        """Replicas not retired at ``now``: the newest retires after ``retire_after_s`` without the
        prefix being hot, the next one ``retire_after_s`` later, and so on."""
        periods = int((now - e.last_hot) // self.cfg.retire_after_s)
        n = len(e.replicas)
        return e.replicas if periods <= 0 else e.replicas[: max(0, n - periods)]
