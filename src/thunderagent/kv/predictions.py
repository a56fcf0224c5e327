"""Predicted holders of a hash in the KV index (``kv.index``), kept apart so the index module stays about the
maps and their queries.

Two shapes, both values of ``KvIndex._predicted``:

- :class:`PredBatch`: one ``predict`` call (one worker, one expiry) for all the hashes it recorded. A hash
  predicted on a single worker (the common case: a routed prompt's new blocks) maps to that call's batch
  itself, so a prediction costs one dict store per block instead of an object and a dict per block. The
  batch is also the call's item in the expiry queue (``hashes`` in push order, ``swept``: how many of them
  the sweep has passed).
- :class:`Predictions`: a hash predicted on several workers (a dict bit -> expiry, with a cached live set).

:func:`record` (``KvIndex.predict``'s writes) and :func:`sweep` (the expiry queue) keep the two shapes in step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol


class PredBatch:
    """The hashes one ``predict`` call recorded on worker ``bit``, valid while ``now < expiry``.

    Immutable once queued except ``swept``. A hash maps to the batch only while the batch is its one
    predicted holder's latest prediction: a refresh maps it to the newer batch, a second holder to a
    :class:`Predictions`; the sweep therefore re-checks each hash (same bit, same expiry) before deleting."""

    __slots__ = ("bit", "expiry", "hashes", "swept")

    def __init__(self, bit: int, expiry: float) -> None:
        self.bit = bit
        self.expiry = expiry
        self.hashes: list[int] = []
        self.swept = 0


class Predictions:
    """Predicted holders of one hash, with a cached "live set" so queries on a predicted-only prefix (approximate
    mode: engines without KV events) stay O(1) per block.

    Cache invariant: for any ``now`` with ``checked_at <= now < live_until``, the holders whose prediction is valid
    at ``now`` are exactly ``live_mask``. It holds because every bit in ``live_mask`` has ``expiry >= live_until``,
    and every other bit was already expired at ``checked_at`` (inserts and refreshes add their bit and lower
    ``live_until`` if needed; removals clear their bit). Outside that window ``find_matches`` rescans and re-anchors.
    """

    __slots__ = ("expiry", "live_mask", "live_until", "checked_at")

    def __init__(self, bit: int, expiry: float, now: float) -> None:
        self.expiry: dict[int, float] = {bit: expiry}
        self.live_mask = bit
        self.live_until = expiry
        self.checked_at = now

    @classmethod
    def of(cls, batch: PredBatch, now: float) -> Predictions:
        """A second holder joins a single-holder hash: the batch's entry as a :class:`Predictions` whose cache
        is anchored at ``now`` (live set: the batch's bit if still valid)."""
        p = cls(batch.bit, batch.expiry, now)
        if not batch.expiry > now:  # expired (not swept yet): no live holder, nothing to expire before a rescan
            p.live_mask = 0
            p.live_until = float("inf")
        return p

    def remove(self, bit: int) -> None:
        del self.expiry[bit]
        self.live_mask &= ~bit


def record(confirmed: Mapping[int, int], predicted: dict[int, PredBatch | Predictions], mine: set[int], bit: int,
           expiry: float, now: float, block_hashes: Iterable[int]) -> PredBatch:
    """``KvIndex.predict``'s writes: worker ``bit``'s entries for ``block_hashes`` valid until ``expiry``
    (confirmed ones untouched, valid-as-long ones kept), added to ``mine`` (its entry set). Returns the
    call's batch; ``hashes``: those pushed (each one expiry-queue item), the caller queues it if any."""
    # One batch for the whole call: a block nobody else predicted maps to it, which costs one dict
    # store, and the batch is the call's single expiry-queue item.
    batch = PredBatch(bit, expiry)
    # Typed Any: compiled (setup.py), an int below 2**62 is a native integer, boxed anew at each store; as
    # objects the request's own hashes are the keys and the queue's items, as they are interpreted
    hashes: list[Any] = batch.hashes
    push = hashes.append
    table: dict[Any, Any] = predicted
    h: Any
    items: Iterable[Any] = block_hashes  # (iterating an Iterable[int] unboxes each item too)
    for h in items:
        if confirmed.get(h, 0) & bit:
            continue  # never downgrade a confirmed entry
        preds = table.get(h)
        if preds is None:
            table[h] = batch
        elif isinstance(preds, PredBatch):
            if preds.bit == bit:
                if preds.expiry >= expiry:
                    continue  # already valid at least as long
                table[h] = batch  # refreshed
            else:  # a second holder
                many = table[h] = Predictions.of(preds, now)
                many.expiry[bit] = expiry
                many.live_mask |= bit
                if expiry < many.live_until:
                    many.live_until = expiry
        else:
            old = preds.expiry.get(bit)
            if old is not None and old >= expiry:
                continue  # already valid at least as long
            preds.expiry[bit] = expiry
            preds.live_mask |= bit
            if expiry < preds.live_until:  # live set was empty (inf), or clock went back
                preds.live_until = expiry
        push(h)
    mine.update(hashes)  # one C-level call for the whole prompt instead of an add per block
    return batch


class _HasBlocks(Protocol):  # the index's per-worker record, as far as the sweep needs it
    blocks: set[int]


def sweep(queue: deque[PredBatch], predicted: dict[int, PredBatch | Predictions], by_bit: Mapping[int, _HasBlocks],
          unbind: Callable[[int], None], now: float, budget: int) -> int:
    """``KvIndex._sweep``: pop up to ``budget`` expired (expiry, bit, hash) items (``budget < 0``: no limit), a
    batch's hashes in order, and delete the entries that still carry exactly that expiry (``unbind``: a
    hash left the predictions). Returns how many entries were deleted."""
    removed = 0
    while queue and budget != 0:
        batch = queue[0]
        expiry = batch.expiry
        if expiry > now:
            break
        bit, hashes, start = batch.bit, batch.hashes, batch.swept
        end = len(hashes) if budget < 0 or budget >= len(hashes) - start else start + budget
        if budget > 0:
            budget -= end - start
        if end == len(hashes):
            queue.popleft()
        else:
            batch.swept = end
        for k in range(start, end):
            h = hashes[k]
            preds = predicted.get(h)
            if preds is None:
                continue
            if isinstance(preds, PredBatch):
                if preds.bit != bit or preds.expiry != expiry:
                    continue  # confirmed, refreshed, removed, or the worker is gone
                del predicted[h]
                unbind(h)
            else:
                if preds.expiry.get(bit) != expiry:
                    continue
                preds.remove(bit)
                if not preds.expiry:
                    del predicted[h]
                    unbind(h)
            # An entry existed, so ``bit`` belongs to a live worker (bits are reused only after a
            # purge; a re-added worker's own prediction with this exact expiry is expired too).
            by_bit[bit].blocks.discard(h)
            removed += 1
    return removed
