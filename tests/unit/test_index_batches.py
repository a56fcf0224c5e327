"""KvIndex predictions stored per ``predict`` call (kv/predictions.py ``PredBatch``): a hash predicted on
one worker maps to its call's batch, a second holder turns it into a per-bit ``Predictions``, and the
expiry queue holds one item per call that the sweep walks hash by hash (budgets count hashes)."""

from __future__ import annotations

from thunderagent.kv.index import KvIndex
from thunderagent.kv.predictions import PredBatch, Predictions
from thunderagent.types import BlockRemoved, BlockStored

A, B = "a", "b"


def make() -> KvIndex:
    idx = KvIndex(prediction_ttl=10.0)
    idx.add_worker(A)
    idx.add_worker(B)
    return idx


def test_one_batch_per_call_shared_by_its_new_hashes() -> None:
    idx = make()
    idx.predict(A, [1, 2, 3], now=0.0)
    batch = idx._predicted[1]
    assert isinstance(batch, PredBatch)
    assert idx._predicted[2] is batch and idx._predicted[3] is batch
    assert batch.hashes == [1, 2, 3] and batch.expiry == 10.0
    assert list(idx._expiry_queue) == [batch]


def test_a_second_holder_gets_its_own_expiry() -> None:
    idx = make()
    idx.predict(A, [1, 2], now=0.0)  # until 10
    idx.predict(B, [1], now=4.0)  # until 14
    assert isinstance(idx._predicted[1], Predictions) and isinstance(idx._predicted[2], PredBatch)
    assert idx.find_matches([1, 2], 9.0) == {A: 2, B: 1}
    assert idx.find_matches([1, 2], 10.0) == {B: 1}
    assert idx.expire(now=10.0) == 2  # A's two entries; B's stays
    assert (idx.num_blocks(A), idx.num_blocks(B)) == (0, 1)
    assert idx.find_matches([1], 13.9) == {B: 1}
    assert idx.expire(now=14.0) == 1 and idx.num_blocks() == 0 and not idx._predicted


def test_a_second_holder_joining_an_expired_unswept_one() -> None:
    idx = make()
    idx.predict(A, [1], now=0.0)  # until 10, not swept
    idx.predict(B, [1], now=12.0)  # until 22: joins an expired holder, then sweeps A's item (budget 2)
    assert isinstance(idx._predicted[1], Predictions)
    assert idx.num_blocks(A) == 0
    assert idx.find_matches([1], 12.0) == {B: 1}


def test_second_holder_before_expiry_then_query_after_it() -> None:
    idx = make()
    idx.predict(A, [1], now=0.0)  # until 10
    idx.predict(B, [1], now=5.0)  # until 15; A's still live
    assert idx.find_matches([1], 5.0) == {A: 1, B: 1}
    assert idx.find_matches([1], 11.0) == {B: 1}
    assert idx.num_blocks(A) == 1  # expired, not swept yet: still counted


def test_sweep_budget_counts_hashes_inside_a_batch() -> None:
    idx = make()
    idx.predict(A, [1, 2, 3, 4, 5], now=0.0)
    assert idx.expire(now=10.0, max_items=3) == 3
    assert idx.num_blocks(A) == 2 and len(idx._expiry_queue) == 1  # the batch, partly swept
    assert idx.expire(now=10.0, max_items=3) == 2
    assert idx.num_blocks(A) == 0 and not idx._expiry_queue


def test_refreshed_hashes_move_to_the_newer_batch() -> None:
    idx = make()
    idx.predict(A, [1, 2], now=0.0)  # until 10
    idx.predict(A, [1, 2, 3], now=5.0)  # until 15: all three in the new batch
    assert idx._predicted[1] is idx._predicted[3]
    assert idx.expire(now=10.0) == 0  # the old batch's items are stale: skipped
    assert idx.num_blocks(A) == 3
    assert idx.expire(now=15.0) == 3


def test_confirmed_and_removed_hashes_leave_their_batch() -> None:
    idx = make()
    idx.predict(A, [1, 2, 3], now=0.0)
    idx.apply_event(BlockStored(A, 0, (1,), None), 1.0)  # confirmed: the prediction goes
    assert 1 not in idx._predicted and idx.is_confirmed(A, 1)
    assert idx.report_missing(A, [2]) == 1  # lazy verification drops the predicted entry
    idx.apply_event(BlockRemoved(A, 1, (3,)), 2.0)  # a removal of a predicted block drops it too
    assert idx._predicted == {} and idx.num_blocks(A) == 1
    assert idx.expire(now=10.0) == 0  # nothing left to sweep; the confirmed entry stays
    assert idx.find_matches([1, 2], 20.0) == {A: 1}


def test_remove_worker_leaves_its_batches_to_be_skipped() -> None:
    idx = make()
    idx.predict(A, [1, 2], now=0.0)
    assert idx.remove_worker(A) == 2
    idx.add_worker(A)  # same bit reused
    idx.predict(A, [2, 3], now=1.0)
    assert idx.expire(now=10.0) == 0  # the removed worker's batch matches no entry
    assert idx.num_blocks(A) == 2
    assert idx.expire(now=11.0) == 2
