"""KvIndex: which worker holds which KV block. Pure, synchronous, clock-free: every time is passed in as ``now``.

Layout
------
Block hashes are chained (``kv.hashing``): one hash identifies a whole prefix, so a *flat* map keyed by hash answers
"who holds the first i blocks" without any tree.

Each registered worker owns one bit (a power of two; bits of removed workers are reused). An entry ``(hash,
worker)`` lives in exactly one of two maps:

- ``_confirmed: hash -> int``: bitmask of the workers whose entry is confirmed (``BlockStored`` or a
  resync). Confirmed entries never expire.
- ``_predicted: hash -> PredBatch | Predictions``: the router's own predictions, valid while ``now < expiry``
  (``kv.predictions``: a hash predicted on one worker maps to the predicting call's batch).

Why bitmasks: ``find_matches`` runs once per routed request. With masks, "which of the workers still matching also
hold block i" is one dict lookup and one ``&`` per block, whatever the number of workers, instead of one lookup per
(block, worker); an int per hash is also far smaller than a dict per hash. Predictions are consulted only for blocks
where some still-matching worker lacks a confirmed entry.

Each worker also keeps the set of hashes it has entries for: ``remove_worker`` and ``AllBlocksCleared`` cost O(them).

Confidence levels
-----------------
(a) worker events: ``apply_event`` (per-worker sequence numbers; a gap marks the worker STALE and its entries are
    ignored by ``find_matches`` until ``resync``),
(b) predictions: ``predict`` (TTL; a ``BlockStored`` for the same hash confirms them; a prediction never downgrades
    a confirmed entry),
(c) lazy verification: ``report_missing`` drops entries the worker found absent.

Double hash: with ``double_hash`` on, a :class:`~thunderagent.kv.check.CheckMap` verifies primary hashes against a
second, independent hash (see that module). A prediction made at ``t`` is valid while ``now < t + ttl``."""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from thunderagent.kv.check import CheckMap, cut_levels, cut_unverified
from thunderagent.kv.predictions import PredBatch as _PredBatch
from thunderagent.kv.predictions import Predictions as _Predictions
from thunderagent.kv.predictions import record as _record
from thunderagent.kv.predictions import sweep as _sweep
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

_NEVER = math.inf

#: ``predict`` sweeps up to this many expiry-queue items per hash it pushes (see ``predict``).
_SWEEP_PER_PREDICTION = 2


class EventResult(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq <= last seen: ignored
    GAP = "gap"  # seq > last + 1: applied, worker marked stale until resync
    UNKNOWN_WORKER = "unknown_worker"  # not registered (or removed): ignored


class _Worker:
    """Per-worker bookkeeping."""

    __slots__ = ("worker_id", "bit", "blocks", "last_seq", "stale")

    def __init__(self, worker_id: str, bit: int) -> None:
        self.worker_id = worker_id
        # 1 << slot. Typed Any so that, compiled (setup.py), it stays the one Python int object every lone
        # holder's entry shares: a native int would be boxed anew at each store (a new object per entry).
        self.bit: Any = bit
        self.blocks: set[int] = set()  # hashes this worker has an entry for (either map)
        self.last_seq = -1
        self.stale = False


class KvIndex:
    """Flat hash -> holders index fed by worker events, router predictions and lazy verification.

    Unknown workers: events are answered ``UNKNOWN_WORKER``; ``predict``, ``report_missing`` and
    ``resync`` do nothing for them; ``is_stale`` is False and ``last_seq`` is -1. A removed worker
    is unknown; re-adding the same id starts it from scratch (empty, seq -1, not stale).
    """

    __slots__ = (
        "_ttl",
        "_confirmed",
        "_predicted",
        "_workers",
        "_by_bit",
        "_free_bits",
        "_next_slot",
        "_stale_mask",
        "_expiry_queue",
        "_short_queue",
        "short_ttl",
        "checks",
        "epoch",
    )

    def __init__(self, prediction_ttl: float, double_hash: bool = True) -> None:
        if not prediction_ttl >= 0:  # also rejects NaN
            raise ValueError(
                "prediction_ttl must be >= 0 seconds (0 disables predictions), "
                f"got {prediction_ttl}"
            )
        self._ttl = float(prediction_ttl)
        self._confirmed: dict[int, int] = {}  # hash -> bitmask of confirmed holders (never 0)
        # hash -> its predicted holders: the predicting call's batch (one holder) or a _Predictions (several;
        # never empty)
        self._predicted: dict[int, _PredBatch | _Predictions] = {}
        self._workers: dict[str, _Worker] = {}
        self._by_bit: dict[int, _Worker] = {}
        # Bits of removed workers are reused (after their entries are purged, no mask holds them),
        # so masks stay as narrow as the number of live workers even with churn.
        self._free_bits: list[int] = []
        self._next_slot = 0
        self._stale_mask = 0
        # One item per (expiry, bit, hash) in push order, grouped by predict call: a _PredBatch holds its
        # call's hashes in order and how many the sweep has passed. ttl is constant, so with a
        # non-decreasing ``now`` push order is expiry order and sweeping pops from the left only. An
        # item is a *candidate*: the entry may since have been confirmed, refreshed (a later item
        # exists) or removed; the sweep deletes it only if the stored expiry is still exactly this one.
        self._expiry_queue: deque[_PredBatch] = deque()
        self._short_queue: deque[_PredBatch] = deque()
        self.short_ttl = 1.0  #: seconds a ``predict(short=True)`` entry lives
        #: the double-hash guard (None: off; check hashes passed in are then ignored)
        self.checks: CheckMap | None = CheckMap() if double_hash else None
        self.epoch = 0  #: bumped by add_worker / remove_worker (workers' bits may change)

    # -- workers -------------------------------------------------------------------------------
    def add_worker(self, worker_id: str) -> None:
        """Register a worker (idempotent: an existing worker keeps its state)."""
        if worker_id in self._workers:
            return
        bit = self._free_bits.pop() if self._free_bits else 1 << self._next_slot
        self._next_slot += bit == 1 << self._next_slot  # a fresh slot was taken
        self._workers[worker_id] = self._by_bit[bit] = _Worker(worker_id, bit)
        self.epoch += 1

    def remove_worker(self, worker_id: str) -> int:
        """Forget a worker: purge all its entries (returns how many). Its later events are ignored
        (``UNKNOWN_WORKER``) unless it is added again."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return 0
        n = len(w.blocks)
        self._purge(w)
        del self._by_bit[w.bit]
        self._stale_mask &= ~w.bit
        # Its expiry-queue items stay behind; the sweep skips them (no entry carries that expiry): the bit is free.
        self._free_bits.append(w.bit)
        self.epoch += 1
        return n

    def workers(self) -> list[str]:
        return list(self._workers)

    def is_stale(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.stale

    def stale_workers(self) -> list[str]:
        return [wid for wid, w in self._workers.items() if w.stale]

    def last_seq(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return -1 if w is None else w.last_seq

    # -- events --------------------------------------------------------------------------------
    def apply_event(self, event: KvEvent, now: float) -> EventResult:
        """Apply one worker event. ``now`` is accepted for symmetry with the other feeds (events
        carry no expiry); it is not used today."""
        w = self._workers.get(event.worker_id)
        if w is None:
            return EventResult.UNKNOWN_WORKER
        seq = event.seq
        if seq <= w.last_seq:
            return EventResult.DUPLICATE
        result = EventResult.APPLIED
        if seq != w.last_seq + 1:
            # Events were lost: our view of this worker is wrong in an unknown way. Keep applying
            # (the newest state is still the best base) but stop trusting it until a resync.
            w.stale = True
            self._stale_mask |= w.bit
            result = EventResult.GAP
        w.last_seq = seq

        if isinstance(event, BlockStored):
            # parent_hash is not needed: a chained hash already names its whole prefix.
            self._confirm(w, event.block_hashes)
            if self.checks is not None:
                self.checks.confirm(w.bit, event.block_hashes, event.check_hashes)
        elif isinstance(event, BlockRemoved):
            self._drop(w, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self._purge(w)
        else:  # pragma: no cover - caller bug
            raise TypeError(f"not a KV event: {event!r}")
        return result

    def resync(self, worker_id: str, block_hashes: Sequence[int], last_seq: int,
               check_hashes: Sequence[int] | None = None) -> None:
        """Replace the worker's entries by a snapshot (all confirmed; its predictions are dropped
        too), clear its stale mark and set its last seq (the next expected event is last_seq+1).
        ``check_hashes``: the blocks' (guard on); without them the entries are unverified."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        self._purge(w)
        self._confirm(w, block_hashes)
        if self.checks is not None:
            self.checks.confirm(w.bit, block_hashes, check_hashes)
        w.last_seq = last_seq
        w.stale = False
        self._stale_mask &= ~w.bit

    # -- predictions and lazy verification -----------------------------------------------------
    def predict(
        self, worker_id: str, block_hashes: Sequence[int], now: float, check_hashes: Sequence[int] | None = None,
        short: bool = False,
    ) -> None:
        """Record that the router just sent these blocks to ``worker_id``: they are assumed held
        until ``now + ttl`` (``short``: ``short_ttl``, for what another frontend's index said: see
        ``control/index_shards.py``) unless a ``BlockStored`` confirms them. A confirmed entry is never
        downgraded; an unexpired prediction is extended to the new expiry, never shortened.

        ``check_hashes`` (the prompt's, guard on) bind to every hash: each one has an entry of this
        worker afterwards (confirmed or predicted), so the binding's lifetime is tied to it.

        Also sweeps up to 2 expiry-queue items per hash pushed: the queue is then drained at least
        as fast as it grows, so it stays bounded even if the driver never calls ``expire``.
        """
        w = self._workers.get(worker_id)
        if w is None or not self._ttl or not block_hashes:
            return
        if check_hashes is not None and self.checks is not None:
            self.checks.bind(block_hashes, check_hashes)
        expiry = now + (self.short_ttl if short else self._ttl)
        batch = _record(self._confirmed, self._predicted, w.blocks, w.bit, expiry, now, block_hashes)
        if batch.hashes:  # (one queue per ttl: each stays in expiry order)
            (self._short_queue if short else self._expiry_queue).append(batch)
            self._sweep(now, _SWEEP_PER_PREDICTION * len(batch.hashes))

    def report_missing(self, worker_id: str, block_hashes: Iterable[int], *, predicted_only: bool = False) -> int:
        """Lazy verification: the worker found these blocks missing (predicted or even confirmed,
        e.g. after a lost event). Drop its entries for them; returns how many were dropped.

        ``predicted_only``: drop only the router's unconfirmed predictions (a worker that refused a
        request never computed its blocks, but may hold some of them from events)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        if not predicted_only:
            return self._drop(w, block_hashes)
        bit, confirmed = w.bit, self._confirmed
        return self._drop(w, [h for h in block_hashes if not confirmed.get(h, 0) & bit])

    def expire(self, now: float, max_items: int | None = None) -> int:
        """Sweep predictions expired at ``now`` (expiry <= now); returns how many entries were
        removed. Work bound: at most ``max_items`` expiry-queue items are popped per call (each
        O(1); per ttl's queue); items of predictions since confirmed, refreshed or removed are popped
        without counting. ``None`` sweeps everything already expired.

        Expired-but-unswept entries are already absent for ``find_matches``; sweeping only frees
        memory and keeps ``num_blocks`` honest.
        """
        return self._sweep(now, -1 if max_items is None else max_items)

    # -- queries -------------------------------------------------------------------------------
    def is_confirmed(self, worker_id: str, block_hash: int) -> bool:
        """Whether ``worker_id`` reported storing ``block_hash`` (a confirmed entry, not a
        prediction; a stale worker's entries do not count). A chained hash names its whole prefix:
        one lookup says whether the prefix ending at that block is stored."""
        w = self._workers.get(worker_id)
        return w is not None and not w.stale and bool(self._confirmed.get(block_hash, 0) & w.bit)

    def find_matches(
        self, block_hashes: Sequence[int], now: float, check_hashes: Sequence[int] | None = None
    ) -> dict[str, int]:
        """For each worker, how many LEADING blocks of the query it holds (contiguous from block
        0). Expired predictions count as absent, stale workers are excluded, workers with 0 are
        omitted.

        Work: O(1) mask operations per query block (plus the live predictions of a block when
        some still-matching worker lacks a confirmed entry for it), stopping at the first block
        that no still-matching worker holds. ``check_hashes`` (guard on): the query stops at its
        first block whose primary is bound to another check hash.
        """
        result = self._match(block_hashes, now)
        checks = self.checks
        if check_hashes is None or checks is None or not result:
            return result
        # Verify only the blocks some worker matched (misses and short partial hits cost nothing
        # more); a failed block cuts the query there, which is rare: match again on the cut query.
        n_max = max(result.values())
        n_ok = checks.verified_prefix(block_hashes, check_hashes, n_max)
        if n_ok < n_max:
            result = self._match(block_hashes[:n_ok], now)
        return cut_unverified(result, block_hashes, checks.unverified, self.bit_of) if checks.unverified else result

    def match_levels(
        self, block_hashes: Sequence[int], now: float, check_hashes: Sequence[int] | None = None, within: int = -1
    ) -> list[tuple[int, int]]:
        """``find_matches`` as (blocks, mask of ``bit_of`` bits) pairs, fewest blocks first: O(query
        blocks) whatever the number of holders (a prefix the whole fleet holds is one mask). ``within``:
        only those workers' bits (the walk stops at the first block none of them holds; -1: all)."""
        levels: list[tuple[int, int]] = []
        self._match(block_hashes, now, levels, within)
        if check_hashes is None or self.checks is None or not levels:
            return levels
        n_ok = self.checks.verified_prefix(block_hashes, check_hashes, levels[-1][0])
        if n_ok < levels[-1][0]:
            levels = []
            self._match(block_hashes[:n_ok], now, levels, within)
        unverified = self.checks.unverified
        return cut_levels(levels, block_hashes, unverified) if unverified and levels else levels

    def bit_of(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)  # 0: unknown (bits of removed workers are reused)
        return 0 if w is None else w.bit

    def worker_of(self, bit: int) -> str:  # bit: one ``bit_of`` bit of a known worker
        return self._by_bit[bit].worker_id

    def _match(self, block_hashes: Sequence[int], now: float, levels: list[tuple[int, int]] | None = None,
               within: int = -1) -> dict[str, int]:  # with ``levels``: (blocks, mask) pairs go there, the dict empty
        result: dict[str, int] = {}
        if not block_hashes:
            return result
        confirmed = self._confirmed
        predicted = self._predicted
        # Workers still matching. Before block 0: "everyone not stale" as an infinite mask (~x);
        # the first ``&`` with a real mask makes it finite (block 0 always takes the branch
        # below, since a finite mask never equals a negative one).
        alive = ~self._stale_mask & within  # (within a finite mask: finite from the start, same walk)
        if not alive:  # (only a finite ``within``: empty, or of stale workers)
            return result
        n = 0  # blocks matched so far by every worker in ``alive``
        for h in block_hashes:
            held = confirmed.get(h, 0) & alive
            if held != alive:
                preds = predicted.get(h)
                if preds is not None:
                    if isinstance(preds, _PredBatch):  # one predicted holder
                        if preds.expiry > now:
                            held |= preds.bit
                    elif preds.checked_at <= now < preds.live_until:
                        held |= preds.live_mask  # cached live set (see _Predictions)
                    else:
                        live = 0
                        until = _NEVER
                        for bit, expiry in preds.expiry.items():
                            if expiry > now:
                                live |= bit
                                if expiry < until:
                                    until = expiry
                        preds.live_mask = live
                        preds.live_until = until
                        preds.checked_at = now
                        held |= live
                    held &= alive
                if held != alive:
                    if n and levels is not None:
                        levels.append((n, alive ^ held))
                    elif n:  # workers dropping out at block 0 have 0 blocks: omitted
                        dropped = alive ^ held
                        by_bit = self._by_bit
                        while dropped:
                            low = dropped & -dropped  # lowest set bit
                            result[by_bit[low].worker_id] = n
                            dropped ^= low
                    if not held:
                        return result
                    alive = held
            n += 1
        if levels is not None:
            levels.append((n, alive))
            return result
        by_bit = self._by_bit
        while alive:
            low = alive & -alive
            result[by_bit[low].worker_id] = n
            alive ^= low
        return result

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Number of entries (confirmed or predicted, live or expired-but-unswept), for one worker
        or summed over all."""
        if worker_id is not None:
            w = self._workers.get(worker_id)
            return 0 if w is None else len(w.blocks)
        return sum(len(w.blocks) for w in self._workers.values())

    def confirmed_blocks(self, worker_id: str) -> set[int]:
        """The hashes confirmed on a worker (events or a dump), predictions left out: for checks."""
        w = self._workers[worker_id]
        return {h for h in w.blocks if self._confirmed.get(h, 0) & w.bit}

    def _confirm(self, w: _Worker, block_hashes: Iterable[int]) -> None:
        """Set confirmed entries for ``w`` (moving any prediction of the same hash over)."""
        # Typed Any: compiled (setup.py), an int below 2**62 is a native integer, boxed anew at each store; as
        # objects the event's own hashes are the keys of both maps, as they are interpreted (one int per hash)
        bit: Any = w.bit
        confirmed: dict[Any, Any] = self._confirmed
        predicted: dict[Any, Any] = self._predicted
        mine: set[Any] = w.blocks
        h: Any
        items: Iterable[Any] = block_hashes  # (iterating an Iterable[int] unboxes each item too)
        for h in items:
            old = confirmed.get(h)  # a lone holder shares its worker's bit object (bit 999: a 160-byte int)
            confirmed[h] = bit if old is None else old | bit
            if h in mine:  # only then can a prediction of ours exist for h
                preds = predicted.get(h)
                if preds is None:
                    continue
                if isinstance(preds, _PredBatch):
                    if preds.bit == bit:
                        del predicted[h]
                elif bit in preds.expiry:
                    preds.remove(bit)
                    if not preds.expiry:
                        del predicted[h]
            else:
                mine.add(h)

    def _remove_entry(self, bit: int, h: int) -> None:
        """Delete entry (h, bit) from whichever map holds it (the caller knows it exists)."""
        mask = self._confirmed.get(h, 0)
        if mask & bit:
            mask ^= bit
            if mask:
                self._confirmed[h] = mask
                return
            del self._confirmed[h]
        else:
            preds = self._predicted[h]
            if not isinstance(preds, _PredBatch):  # (a batch: ``bit`` is its one holder)
                preds.remove(bit)
                if preds.expiry:
                    return
            del self._predicted[h]
        self._unbind(h)

    def _unbind(self, h: int) -> None:
        """``h`` left one map: forget its check binding if no entry of it is left in either."""
        if self.checks is not None and h not in self._confirmed and h not in self._predicted:
            self.checks.forget(h)

    def _drop(self, w: _Worker, block_hashes: Iterable[int]) -> int:
        # Hot path (every BlockRemoved): ``_remove_entry`` and ``_unbind`` inlined for the confirmed case.
        mine = w.blocks
        bit = w.bit
        confirmed = self._confirmed
        predicted = self._predicted
        checks = self.checks
        forget = checks.forget if checks is not None else None
        dropped = 0
        unverified = checks.unverified.get(bit) if checks is not None else None
        for h in block_hashes:
            if h in mine:
                mine.discard(h)
                dropped += 1
                mask = confirmed.get(h, 0)
                if mask & bit:
                    if mask ^ bit:
                        confirmed[h] = mask ^ bit
                    else:
                        del confirmed[h]
                        if forget is not None and h not in predicted:
                            forget(h)  # no entry of h is left: its check binding goes
                else:
                    self._remove_entry(bit, h)
                if unverified is not None:
                    unverified.discard(h)
        if unverified is not None and not unverified:
            del self.checks.unverified[bit]  # type: ignore[union-attr]  # (unverified: guard on)
        return dropped

    def _purge(self, w: _Worker) -> None:
        """Delete all of ``w``'s entries."""
        bit = w.bit
        for h in w.blocks:
            self._remove_entry(bit, h)
        w.blocks = set()
        if self.checks is not None:
            self.checks.unverified.pop(bit, None)

    def _sweep(self, now: float, budget: int) -> int:
        """Pop up to ``budget`` expired queue items (``budget < 0``: no limit); delete the entries
        that still carry exactly that expiry. Stops at the first unexpired item: with a constant
        ttl and a non-decreasing clock the queue is in expiry order. (If the driver's clock ever
        went backwards, some expired items could sit behind an unexpired one and be swept late;
        ``find_matches`` ignores them meanwhile, so results stay correct.)"""
        n = _sweep(self._expiry_queue, self._predicted, self._by_bit, self._unbind, now, budget)
        if self._short_queue:
            n += _sweep(self._short_queue, self._predicted, self._by_bit, self._unbind, now, budget)
        return n
