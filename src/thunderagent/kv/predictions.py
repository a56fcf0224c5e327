"""Predicted holders of one hash in the KV index (``kv.index``), kept apart so the index module stays
about the maps and their queries."""

from __future__ import annotations


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

    def remove(self, bit: int) -> None:
        del self.expiry[bit]
        self.live_mask &= ~bit
