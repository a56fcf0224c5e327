"""KvIndex: events, predictions, lazy verification, staleness, expiry. Exact expectations only."""

from __future__ import annotations

import pytest

from thunderagent.kv.index import EventResult, KvIndex
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored

TTL = 10.0
A, B, C = "a", "b", "c"


def stored(w: str, seq: int, *hashes: int) -> BlockStored:
    return BlockStored(worker_id=w, seq=seq, block_hashes=tuple(hashes))


def removed(w: str, seq: int, *hashes: int) -> BlockRemoved:
    return BlockRemoved(worker_id=w, seq=seq, block_hashes=tuple(hashes))


def cleared(w: str, seq: int) -> AllBlocksCleared:
    return AllBlocksCleared(worker_id=w, seq=seq)


def make(*workers: str) -> KvIndex:
    idx = KvIndex(prediction_ttl=TTL)
    for w in workers:
        idx.add_worker(w)
    return idx


def test_rejects_bad_ttl() -> None:
    with pytest.raises(ValueError, match="prediction_ttl"):
        KvIndex(prediction_ttl=-1.0)
    with pytest.raises(ValueError, match="prediction_ttl"):
        KvIndex(prediction_ttl=float("nan"))


# -- leading-block matches -------------------------------------------------------------------------
# A: 1 2 3 4 5     B: 1 2 3 . 5 (hole at 4)     C: . 2 3 4 5 (no block 0)
HOLDINGS = {A: (1, 2, 3, 4, 5), B: (1, 2, 3, 5), C: (2, 3, 4, 5)}


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ((), {}),
        ((1,), {A: 1, B: 1}),
        ((1, 2, 3), {A: 3, B: 3}),
        ((1, 2, 3, 4, 5), {A: 5, B: 3}),  # B stops at its hole even though it holds 5
        ((1, 2, 3, 4, 5, 6), {A: 5, B: 3}),
        ((1, 2, 99, 4), {A: 2, B: 2}),  # unknown block: everybody stops
        ((2, 3, 4), {A: 3, B: 2, C: 3}),  # order of the query, not of the chain, is what counts
        ((99, 1, 2), {}),
        ((5,), {A: 1, B: 1, C: 1}),
        ((4, 5), {A: 2, C: 2}),
    ],
)
def test_find_matches_leading_blocks(query: tuple[int, ...], expected: dict[str, int]) -> None:
    idx = make(A, B, C)
    for w, hs in HOLDINGS.items():
        assert idx.apply_event(stored(w, 0, *hs), now=0.0) is EventResult.APPLIED
    assert idx.find_matches(query, now=0.0) == expected
    assert idx.find_matches(list(query), now=1e9) == expected  # confirmed entries never expire


# -- stored / removed / cleared --------------------------------------------------------------------
def test_stored_removed_cleared_sequence() -> None:
    idx = make(A, B)
    q = (1, 2, 3, 4)
    assert idx.apply_event(stored(A, 0, 1, 2, 3, 4), 0.0) is EventResult.APPLIED
    assert idx.apply_event(stored(B, 0, 1, 2), 0.0) is EventResult.APPLIED
    assert idx.find_matches(q, 0.0) == {A: 4, B: 2}
    assert idx.num_blocks(A) == 4 and idx.num_blocks(B) == 2 and idx.num_blocks() == 6

    assert idx.apply_event(removed(A, 1, 3, 4, 77), 0.0) is EventResult.APPLIED  # 77: not held
    assert idx.find_matches(q, 0.0) == {A: 2, B: 2}
    assert idx.num_blocks(A) == 2

    assert idx.apply_event(removed(B, 1, 1), 0.0) is EventResult.APPLIED
    assert idx.find_matches(q, 0.0) == {A: 2}  # B lost block 0: 0 leading blocks, omitted

    assert idx.apply_event(cleared(A, 2), 0.0) is EventResult.APPLIED
    assert idx.find_matches(q, 0.0) == {}
    assert idx.num_blocks(A) == 0 and idx.num_blocks(B) == 1

    assert idx.apply_event(stored(A, 3, 1, 2, 3), 0.0) is EventResult.APPLIED
    assert idx.find_matches(q, 0.0) == {A: 3}
    assert [idx.last_seq(A), idx.last_seq(B)] == [3, 1]


def test_stored_twice_is_one_entry() -> None:
    idx = make(A)
    idx.apply_event(stored(A, 0, 1, 2), 0.0)
    idx.apply_event(stored(A, 1, 2, 3), 0.0)
    assert idx.num_blocks(A) == 3
    assert idx.find_matches((1, 2, 3), 0.0) == {A: 3}


def test_cleared_drops_predictions_too() -> None:
    idx = make(A)
    idx.predict(A, (1, 2), now=0.0)
    idx.apply_event(stored(A, 0, 3), 0.0)
    idx.apply_event(cleared(A, 1), 0.0)
    assert idx.num_blocks(A) == 0
    assert idx.find_matches((1, 2), 0.0) == {}
    assert idx.expire(now=100.0) == 0  # the leftover queue items find nothing to remove


# -- sequence numbers ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("seqs", "results", "last", "stale"),
    [
        ([0, 1, 2], ["APPLIED", "APPLIED", "APPLIED"], 2, False),
        ([0, 0], ["APPLIED", "DUPLICATE"], 0, False),
        ([0, 1, 1, 0], ["APPLIED", "APPLIED", "DUPLICATE", "DUPLICATE"], 1, False),
        ([1], ["GAP"], 1, True),  # the first expected seq is 0
        ([0, 2], ["APPLIED", "GAP"], 2, True),
        ([0, 2, 3], ["APPLIED", "GAP", "APPLIED"], 3, True),  # stays stale until resync
        ([0, 5, 1], ["APPLIED", "GAP", "DUPLICATE"], 5, True),  # late old event: ignored
    ],
)
def test_sequence_numbers(seqs: list[int], results: list[str], last: int, stale: bool) -> None:
    idx = make(A)
    assert idx.last_seq(A) == -1
    got = [idx.apply_event(stored(A, s, 100 + s), 0.0).name for s in seqs]
    assert got == results
    assert idx.last_seq(A) == last
    assert idx.is_stale(A) is stale
    assert idx.stale_workers() == ([A] if stale else [])


def test_duplicate_is_not_applied() -> None:
    idx = make(A)
    idx.apply_event(stored(A, 0, 1), 0.0)
    idx.apply_event(stored(A, 1, 2), 0.0)
    assert idx.apply_event(removed(A, 1, 1, 2), 0.0) is EventResult.DUPLICATE
    assert idx.find_matches((1, 2), 0.0) == {A: 2}


def test_gap_event_is_applied_but_worker_excluded_until_resync() -> None:
    idx = make(A, B)
    idx.apply_event(stored(A, 0, 1, 2, 3), 0.0)
    idx.apply_event(stored(B, 0, 1), 0.0)
    assert idx.apply_event(stored(A, 2, 4), 0.0) is EventResult.GAP
    assert idx.num_blocks(A) == 4  # applied ...
    assert idx.find_matches((1, 2, 3, 4), 0.0) == {B: 1}  # ... but A is ignored while stale
    assert idx.stale_workers() == [A]

    idx.resync(A, [1, 2, 9], last_seq=7)
    assert not idx.is_stale(A) and idx.stale_workers() == []
    assert idx.last_seq(A) == 7
    assert idx.num_blocks(A) == 3  # snapshot replaced 1,2,3,4
    assert idx.find_matches((1, 2, 3, 4), 0.0) == {A: 2, B: 1}
    assert idx.find_matches((9,), 0.0) == {A: 1}
    assert idx.apply_event(stored(A, 7, 3), 0.0) is EventResult.DUPLICATE
    assert idx.apply_event(stored(A, 8, 3), 0.0) is EventResult.APPLIED
    assert idx.find_matches((1, 2, 3, 4), 0.0) == {A: 3, B: 1}


def test_resync_confirms_and_drops_predictions() -> None:
    idx = make(A)
    idx.predict(A, (1, 2, 3), now=0.0)
    idx.resync(A, [1, 2], last_seq=-1)
    assert idx.num_blocks(A) == 2
    assert idx.find_matches((1, 2, 3), now=1000.0) == {A: 2}  # confirmed: no expiry
    assert idx.expire(now=1000.0) == 0
    assert idx.apply_event(stored(A, 0, 3), 0.0) is EventResult.APPLIED


def test_stale_worker_predictions_also_ignored() -> None:
    idx = make(A)
    idx.apply_event(stored(A, 3, 1), 0.0)  # gap
    idx.predict(A, (1, 2), now=0.0)
    assert idx.find_matches((1, 2), 0.0) == {}


# -- predictions -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (0.0, {A: 3}),
        (5.0, {A: 3}),
        (14.999, {A: 3}),
        (15.0, {}),  # predicted at 5 with ttl 10: valid while now < 15, expired at 15 exactly
        (100.0, {}),
    ],
)
def test_prediction_expires_after_ttl(now: float, expected: dict[str, int]) -> None:
    idx = make(A)
    idx.predict(A, (1, 2, 3), now=5.0)
    assert idx.find_matches((1, 2, 3), now=now) == expected


def test_prediction_confirmed_by_stored_never_expires() -> None:
    idx = make(A)
    idx.predict(A, (1, 2, 3), now=0.0)
    idx.apply_event(stored(A, 0, 1, 2), 1.0)
    assert idx.find_matches((1, 2, 3), now=9.0) == {A: 3}
    assert idx.find_matches((1, 2, 3), now=10.0) == {A: 2}  # 3 was only predicted
    assert idx.expire(now=10.0) == 1  # only block 3's prediction is removed
    assert idx.num_blocks(A) == 2
    assert idx.find_matches((1, 2, 3), now=1e6) == {A: 2}


def test_predict_never_downgrades_confirmed() -> None:
    idx = make(A)
    idx.apply_event(stored(A, 0, 1, 2), 0.0)
    idx.predict(A, (1, 2, 3), now=0.0)
    assert idx.num_blocks(A) == 3
    assert idx.find_matches((1, 2, 3), now=50.0) == {A: 2}
    assert idx.expire(now=50.0) == 1
    assert idx.find_matches((1, 2), now=1e9) == {A: 2}


def test_predict_refreshes_unexpired_prediction() -> None:
    idx = make(A)
    idx.predict(A, (1, 2), now=0.0)
    idx.predict(A, (1,), now=8.0)  # block 1 now valid until 18, block 2 still until 10
    assert idx.find_matches((1, 2), now=9.0) == {A: 2}
    assert idx.find_matches((1, 2), now=10.0) == {A: 1}
    assert idx.expire(now=10.0) == 1  # block 2; block 1's old queue item is skipped (refreshed)
    assert idx.find_matches((1, 2), now=17.9) == {A: 1}
    assert idx.expire(now=18.0) == 1
    assert idx.num_blocks() == 0


def test_predictions_per_worker_and_mixed_with_confirmed() -> None:
    idx = make(A, B)
    idx.apply_event(stored(A, 0, 1, 2), 0.0)
    idx.predict(A, (1, 2, 3, 4), now=0.0)  # router sent the longer request to A
    idx.predict(B, (1,), now=5.0)
    assert idx.find_matches((1, 2, 3, 4), now=6.0) == {A: 4, B: 1}
    assert idx.find_matches((1, 2, 3, 4), now=10.0) == {A: 2, B: 1}
    assert idx.find_matches((1, 2, 3, 4), now=15.0) == {A: 2}


def test_predict_unknown_worker_is_ignored() -> None:
    idx = make(A)
    idx.predict("ghost", (1, 2), now=0.0)
    assert idx.num_blocks() == 0
    assert idx.find_matches((1, 2), 0.0) == {}
    assert idx.workers() == [A]


def test_zero_ttl_disables_predictions() -> None:
    idx = KvIndex(prediction_ttl=0.0)
    idx.add_worker(A)
    idx.predict(A, (1, 2), now=0.0)
    assert idx.num_blocks() == 0
    assert idx.find_matches((1, 2), 0.0) == {}


# -- lazy verification -----------------------------------------------------------------------------
def test_report_missing() -> None:
    idx = make(A, B)
    idx.apply_event(stored(A, 0, 1, 2), 0.0)
    idx.predict(A, (1, 2, 3, 4), now=0.0)
    idx.predict(B, (1, 2, 3), now=0.0)
    assert idx.report_missing(A, [3, 4, 99]) == 2  # 99 never indexed
    assert idx.find_matches((1, 2, 3, 4), 1.0) == {A: 2, B: 3}
    assert idx.report_missing(A, [2]) == 1  # a confirmed entry can be reported missing too
    assert idx.find_matches((1, 2, 3, 4), 1.0) == {A: 1, B: 3}
    assert idx.report_missing(A, [2]) == 0
    assert idx.report_missing("ghost", [1]) == 0
    assert idx.num_blocks(A) == 1 and idx.num_blocks(B) == 3
    assert idx.expire(now=100.0) == 3  # B's three; A's dropped predictions are skipped


def test_report_missing_predicted_only_keeps_what_events_confirmed() -> None:
    """A worker that refused a request never computed its blocks: only the router's predictions go."""
    idx = make(A, B)
    idx.apply_event(stored(A, 0, 1, 2), 0.0)
    idx.predict(A, (1, 2, 3, 4), now=0.0)
    idx.predict(B, (1, 2, 3, 4), now=0.0)
    assert idx.report_missing(A, [1, 2, 3, 4], predicted_only=True) == 2  # 3 and 4
    assert idx.find_matches((1, 2, 3, 4), 1.0) == {A: 2, B: 4}
    assert idx.num_blocks(A) == 2 and idx.num_blocks(B) == 4
    assert idx.report_missing("ghost", [1], predicted_only=True) == 0


# -- workers ---------------------------------------------------------------------------------------
def test_remove_worker_purges_and_ignores_later_events() -> None:
    idx = make(A, B)
    idx.apply_event(stored(A, 0, 1, 2, 3), 0.0)
    idx.predict(A, (4, 5), now=0.0)
    idx.apply_event(stored(B, 0, 1), 0.0)
    assert idx.remove_worker(A) == 5
    assert idx.workers() == [B]
    assert idx.num_blocks(A) == 0 and idx.num_blocks() == 1
    assert idx.find_matches((1, 2, 3, 4, 5), 0.0) == {B: 1}

    assert idx.apply_event(stored(A, 1, 1, 2), 0.0) is EventResult.UNKNOWN_WORKER
    assert idx.apply_event(removed(A, 2, 1), 0.0) is EventResult.UNKNOWN_WORKER
    assert idx.apply_event(cleared(A, 3), 0.0) is EventResult.UNKNOWN_WORKER
    idx.resync(A, [1, 2], last_seq=9)
    idx.predict(A, (1,), now=0.0)
    assert idx.find_matches((1, 2), 0.0) == {B: 1}  # nothing resurrected
    assert idx.num_blocks() == 1
    assert idx.expire(now=100.0) == 0
    assert idx.remove_worker(A) == 0
    assert idx.last_seq(A) == -1 and not idx.is_stale(A)


def test_remove_stale_worker_clears_stale_and_readd_starts_fresh() -> None:
    idx = make(A)
    idx.apply_event(stored(A, 4, 1), 0.0)
    assert idx.stale_workers() == [A]
    assert idx.remove_worker(A) == 1
    assert idx.stale_workers() == []
    idx.add_worker(A)
    assert idx.last_seq(A) == -1 and not idx.is_stale(A) and idx.num_blocks(A) == 0
    assert idx.apply_event(stored(A, 0, 1), 0.0) is EventResult.APPLIED
    assert idx.find_matches((1,), 0.0) == {A: 1}


def test_add_worker_is_idempotent() -> None:
    idx = make(A)
    idx.apply_event(stored(A, 0, 1), 0.0)
    idx.add_worker(A)
    assert idx.workers() == [A]
    assert idx.last_seq(A) == 0 and idx.num_blocks(A) == 1


def test_unknown_worker_events() -> None:
    idx = make(A)
    for ev in (stored("x", 0, 1), removed("x", 0, 1), cleared("x", 0)):
        assert idx.apply_event(ev, 0.0) is EventResult.UNKNOWN_WORKER
    assert idx.num_blocks() == 0
    assert idx.workers() == [A]
    assert idx.last_seq("x") == -1


def test_shared_block_survives_other_workers_removal() -> None:
    idx = make(A, B)
    idx.apply_event(stored(A, 0, 1, 2), 0.0)
    idx.apply_event(stored(B, 0, 1, 2), 0.0)
    idx.apply_event(removed(A, 1, 1), 0.0)
    assert idx.find_matches((1, 2), 0.0) == {B: 2}
    idx.remove_worker(B)
    assert idx.find_matches((1, 2), 0.0) == {}
    assert idx.num_blocks() == 1  # A still has block 2 (unreachable as a leading block)


# -- expire() --------------------------------------------------------------------------------------
def test_expire_is_bounded_and_ordered() -> None:
    idx = make(A, B)
    idx.predict(A, (1, 2, 3), now=0.0)  # expire at 10
    idx.predict(B, (1, 2), now=1.0)  # expire at 11
    idx.predict(A, (4,), now=2.0)  # expire at 12
    assert idx.num_blocks() == 6
    assert idx.expire(now=9.99) == 0
    assert idx.expire(now=10.0, max_items=2) == 2  # bounded: A's 1 and 2
    assert idx.num_blocks(A) == 2
    assert idx.expire(now=10.0, max_items=2) == 1  # only A's 3 is expired at t=10
    assert idx.expire(now=11.5, max_items=0) == 0
    assert idx.expire(now=11.5) == 2  # B's
    assert idx.num_blocks() == 1
    assert idx.expire(now=1000.0, max_items=5) == 1
    assert idx.num_blocks() == 0
    assert idx.expire(now=1000.0) == 0


def test_expire_budget_counts_skipped_items() -> None:
    # max_items bounds the queue items examined, not the entries removed: confirmed predictions
    # still cost one pop each.
    idx = make(A)
    idx.predict(A, (1, 2, 3), now=0.0)
    idx.apply_event(stored(A, 0, 1, 2), 0.0)
    assert idx.expire(now=10.0, max_items=2) == 0
    assert idx.expire(now=10.0, max_items=2) == 1
    assert idx.num_blocks(A) == 2


def test_predict_sweeps_expired_items_amortized() -> None:
    # predict() pops up to 2 expired queue items per hash it pushes, so the queue stays bounded
    # even without expire() calls.
    idx = make(A)
    idx.predict(A, (1, 2, 3, 4), now=0.0)
    assert idx.num_blocks() == 4
    idx.predict(A, (5,), now=20.0)  # pushes 1 item -> sweeps up to 2 expired ones
    assert idx.num_blocks() == 3
    idx.predict(A, (6, 7), now=20.0)  # pushes 2 -> sweeps the remaining 2 old ones
    assert idx.num_blocks() == 3  # 5, 6, 7
    assert idx.find_matches((5,), now=20.0) == {A: 1}


def test_expired_entries_are_absent_before_sweep() -> None:
    idx = make(A)
    idx.predict(A, (1, 2), now=0.0)
    assert idx.find_matches((1, 2), now=10.0) == {}
    assert idx.num_blocks(A) == 2  # still counted until swept
    # a store after expiry (but before the sweep) confirms; the sweep must not delete it
    idx.apply_event(stored(A, 0, 1, 2), 11.0)
    assert idx.expire(now=11.0) == 0
    assert idx.find_matches((1, 2), now=11.0) == {A: 2}


def test_negative_times() -> None:
    # a virtual clock may start below 0: "absent" must still compare as absent
    idx = make(A, B)
    idx.predict(A, (1, 2), now=-100.0)  # valid until -90
    idx.predict(B, (1,), now=-100.0)
    assert idx.find_matches((1, 2), now=-95.0) == {A: 2, B: 1}
    assert idx.find_matches((1, 2), now=-90.0) == {}


def test_predicted_holders_expire_individually_across_queries() -> None:
    # find_matches caches the live set of a predicted-only block; it must track expiries and
    # queries whose ``now`` goes backwards.
    idx = make(A, B, C)
    idx.predict(A, (1, 2), now=0.0)  # until 10
    idx.predict(B, (1, 2), now=4.0)  # until 14
    idx.predict(C, (1,), now=8.0)  # until 18
    q = (1, 2)
    assert idx.find_matches(q, 9.0) == {A: 2, B: 2, C: 1}
    assert idx.find_matches(q, 10.0) == {B: 2, C: 1}
    assert idx.find_matches(q, 9.5) == {A: 2, B: 2, C: 1}  # clock went back: still exact
    assert idx.find_matches(q, 13.0) == {B: 2, C: 1}
    idx.predict(A, (1, 2), now=13.0)  # A again, until 23
    assert idx.find_matches(q, 13.0) == {A: 2, B: 2, C: 1}
    assert idx.find_matches(q, 14.0) == {A: 2, C: 1}
    idx.report_missing(C, [1])
    assert idx.find_matches(q, 14.0) == {A: 2}
    idx.apply_event(stored(B, 0, 1), 14.0)  # B confirms block 1 only
    assert idx.find_matches(q, 20.0) == {A: 2, B: 1}
    assert idx.find_matches(q, 23.0) == {B: 1}


def test_worker_slot_reuse_does_not_leak_entries() -> None:
    idx = make(A, B)
    idx.predict(A, (1, 2), now=0.0)
    idx.apply_event(stored(A, 0, 3), 0.0)
    idx.remove_worker(A)
    idx.add_worker(C)  # may reuse A's internal slot
    assert idx.find_matches((1, 2), 1.0) == {}
    assert idx.find_matches((3,), 1.0) == {}
    idx.predict(C, (1,), now=5.0)  # until 15
    assert idx.expire(now=10.0) == 0  # A's old queue items (expiry 10) must not hit C's entry
    assert idx.find_matches((1, 2), 10.0) == {C: 1}
    assert idx.num_blocks(C) == 1
    assert sorted(idx.workers()) == [B, C]


def test_many_workers() -> None:
    idx = KvIndex(prediction_ttl=TTL)
    names = [f"w{i}" for i in range(200)]
    for i, w in enumerate(names):
        idx.add_worker(w)
        idx.apply_event(stored(w, 0, *range(1, 1 + i % 7)), 0.0)  # w_i holds i % 7 blocks
    got = idx.find_matches(tuple(range(1, 10)), 0.0)
    assert got == {w: i % 7 for i, w in enumerate(names) if i % 7}


# -- model check against a naive reference ------------------------------------------------------
class _Reference:
    """Obviously-correct model: {worker: {hash: expiry}}, +inf for confirmed."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.entries: dict[str, dict[int, float]] = {}
        self.last: dict[str, int] = {}
        self.stale: set[str] = set()

    def matches(self, q: tuple[int, ...], now: float) -> dict[str, int]:
        out = {}
        for w, ent in self.entries.items():
            if w in self.stale:
                continue
            n = 0
            while n < len(q) and ent.get(q[n], -1e18) > now:
                n += 1
            if n:
                out[w] = n
        return out


def _live(entries: dict[int, float], now: float) -> int:
    return sum(1 for e in entries.values() if e > now)


def test_random_operations_match_reference() -> None:
    # The reference never sweeps, so entry counts are compared as bounds (expired predictions
    # may or may not be swept yet); find_matches at the current time is compared exactly.
    import random

    rnd = random.Random(1234)
    ttl = 5.0
    idx = KvIndex(prediction_ttl=ttl)
    ref = _Reference(ttl)
    pool = ["w0", "w1", "w2", "w3", "w4"]
    hashes = list(range(1, 13))
    now = 0.0
    for step in range(4000):
        now += rnd.choice((0.0, 0.25, 1.0))
        w = rnd.choice(pool)
        op = rnd.randrange(10)
        hs = tuple(rnd.sample(hashes, rnd.randrange(0, 5)))
        if op == 0:
            idx.add_worker(w)
            if w not in ref.entries:
                ref.entries[w], ref.last[w] = {}, -1
        elif op == 1 and rnd.random() < 0.3:
            ent = ref.entries.pop(w, {})
            # exact up to expired predictions a sweep may already have removed
            assert _live(ent, now) <= idx.remove_worker(w) <= len(ent)
            ref.last.pop(w, None)
            ref.stale.discard(w)
        elif op in (2, 3, 4):
            seq = ref.last.get(w, -1) + rnd.choice((1, 1, 1, 1, 0, 2))
            kind = rnd.choice(("s", "s", "r", "c"))
            ev = stored(w, seq, *hs) if kind == "s" else removed(w, seq, *hs)
            if kind == "c":
                ev = cleared(w, seq)
            res = idx.apply_event(ev, now)
            if w not in ref.entries:
                assert res is EventResult.UNKNOWN_WORKER
            elif seq <= ref.last[w]:
                assert res is EventResult.DUPLICATE
            else:
                assert res is (EventResult.GAP if seq > ref.last[w] + 1 else EventResult.APPLIED)
                if seq > ref.last[w] + 1:
                    ref.stale.add(w)
                ref.last[w] = seq
                ent = ref.entries[w]
                if kind == "s":
                    ent.update(dict.fromkeys(hs, float("inf")))
                elif kind == "r":
                    for h in hs:
                        ent.pop(h, None)
                else:
                    ent.clear()
        elif op in (5, 6):
            idx.predict(w, hs, now)
            ent = ref.entries.get(w)
            if ent is not None:
                for h in hs:
                    if ent.get(h, -1e18) < now + ttl:
                        ent[h] = now + ttl
        elif op == 7:
            ent = ref.entries.get(w, {})
            gone = {h: ent.pop(h) for h in hs if h in ent}
            assert _live(gone, now) <= idx.report_missing(w, hs) <= len(gone)
        elif op == 8 and rnd.random() < 0.2:
            snap = tuple(rnd.sample(hashes, rnd.randrange(0, 6)))
            idx.resync(w, snap, last_seq=step)
            if w in ref.entries:
                ref.entries[w] = dict.fromkeys(snap, float("inf"))
                ref.last[w] = step
                ref.stale.discard(w)
        else:
            n_expired = sum(1 for ent in ref.entries.values() for e in ent.values() if e <= now)
            swept = idx.expire(now, max_items=rnd.choice((None, 3)))
            assert swept <= n_expired
        # the sweep (explicit or inside predict) removes only expired predictions
        for wid, ent in ref.entries.items():
            assert _live(ent, now) <= idx.num_blocks(wid) <= len(ent)
        q = tuple(rnd.sample(hashes, rnd.randrange(1, 7)))
        assert idx.find_matches(q, now) == ref.matches(q, now), (step, q, now)
        # A query from the past is exact except for predictions that expired between then and
        # now, which a sweep may already have removed: bounded by the two reference answers.
        past = now - rnd.choice((0.5, 2.0))
        lo, hi, got = ref.matches(q, now), ref.matches(q, past), idx.find_matches(q, past)
        for wid in hi.keys() | got.keys():
            assert lo.get(wid, 0) <= got.get(wid, 0) <= hi.get(wid, 0), (step, q, past, wid)
        assert sorted(idx.stale_workers()) == sorted(ref.stale)
