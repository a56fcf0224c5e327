"""KvFeed: the seam between a worker's cache dump and its live event stream."""

from __future__ import annotations

from thunderagent.kv.feed import KvFeed
from thunderagent.kv.index import KvIndex
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored


def stored(seq: int, *hashes: int) -> BlockStored:
    return BlockStored("w", seq, hashes)


def held(index: KvIndex) -> set[int]:
    return {h for h in range(100) if index.find_matches([h], 0.0).get("w")}


def make() -> tuple[KvFeed, KvIndex]:
    index = KvIndex(prediction_ttl=10.0)
    feed = KvFeed(index)
    feed.add_worker("w")
    return feed, index


def test_events_before_the_dump_wait_for_it_then_apply_on_top():
    feed, index = make()
    assert feed.is_syncing("w")
    # seq 3 is in the dump, seq 4 and 5 came after it
    assert feed.events("w", [stored(3, 1), stored(4, 2)], 0.0) is False
    assert feed.events("w", [BlockRemoved("w", 5, (10,))], 0.0) is False
    assert held(index) == set()  # nothing applied while syncing
    assert feed.apply_dump("w", [1, 10, 11], 3, 0.0) is False
    assert held(index) == {1, 2, 11}
    assert index.last_seq("w") == 5 and not feed.is_syncing("w")
    assert feed.events("w", [stored(6, 7)], 0.0) is False
    assert held(index) == {1, 2, 7, 11}


def test_dump_newer_than_every_buffered_event_drops_them_as_duplicates():
    feed, index = make()
    feed.events("w", [stored(0, 1), BlockRemoved("w", 1, (1,))], 0.0)
    assert feed.apply_dump("w", [5], 1, 0.0) is False
    assert held(index) == {5} and index.last_seq("w") == 1


def test_events_lost_between_dump_and_buffer_ask_for_another_dump():
    feed, index = make()
    feed.events("w", [stored(6, 2)], 0.0)  # 4 and 5 never arrived
    assert feed.apply_dump("w", [1], 3, 0.0) is True
    assert index.is_stale("w")
    feed.begin_sync("w")
    assert feed.apply_dump("w", [1, 2], 6, 0.0) is False
    assert not index.is_stale("w") and held(index) == {1, 2}


def test_live_gap_and_lost_tail():
    feed, index = make()
    feed.apply_dump("w", [], -1, 0.0)
    assert feed.events("w", [stored(0, 1)], 0.0) is False
    assert feed.heartbeat("w", 0) is False
    assert feed.heartbeat("w", 2) is True  # seq 1, 2 published, never seen: no event would tell
    assert feed.events("w", [stored(2, 3)], 0.0) is True  # gap 1
    feed.begin_sync("w")
    assert feed.heartbeat("w", 9) is False  # a sync is already under way


def test_buffer_overflow_forces_a_fresh_dump():
    index = KvIndex(prediction_ttl=10.0)
    feed = KvFeed(index, max_buffered=2)
    feed.add_worker("w")
    feed.events("w", [stored(0, 1), stored(1, 2)], 0.0)
    feed.events("w", [stored(2, 3)], 0.0)  # over the cap: buffer dropped
    assert feed.apply_dump("w", [1], 0, 0.0) is True


def test_worker_without_dumps_goes_live_on_events():
    feed, index = make()
    feed.events("w", [stored(0, 1), AllBlocksCleared("w", 1), stored(2, 4)], 0.0)
    assert feed.abandon_sync("w", 0.0) is False
    assert held(index) == {4} and not feed.is_syncing("w")


def test_removed_worker_is_purged_and_ignored():
    feed, index = make()
    feed.apply_dump("w", [1, 2], 0, 0.0)
    assert feed.remove_worker("w") == 2
    assert feed.events("w", [stored(1, 3)], 0.0) is False
    assert feed.heartbeat("w", 5) is False
    assert index.num_blocks() == 0
