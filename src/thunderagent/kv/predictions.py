"""Predicted holders of a hash in the KV index (``kv.index``), kept apart so the index module stays about the
maps and their queries.

Two shapes, both values of ``KvIndex._predicted``:

- :class:`PredBatch`: one ``predict`` call (one worker, one expiry) for all the hashes it recorded. A hash
  predicted on a single worker (the common case: a routed prompt's new blocks) maps to that call's batch
  itself, so a prediction costs one dict store per block instead of an object and a dict per block. The
  batch is also the call's item in the expiry queue (``hashes`` in push order, ``swept``: how many of them
  the sweep has passed).
- :class:`Predictions`: a hash predicted on several workers (a dict bit -> expiry, with a cached live set).
"""

from __future__ import annotations


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
