"""Paged block manager: exact block ids, LRU eviction order, prefix reuse, events."""

from __future__ import annotations

from thunderagent.engine.blocks import BlockManager
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored

H = [1001, 1002, 1003, 1004, 1005, 1006]  # a chain of block hashes (values are opaque)


def filled(bm: BlockManager, hashes: list[int], n: int) -> list[int]:
    """Allocate ``n`` fresh blocks and register the first len(hashes) of them as computed."""
    t: list[int] = []
    assert bm.allocate(t, hashes, 0, n)
    bm.cache_blocks(t, hashes, 0, len(hashes))
    return t


def test_fresh_allocation_ids_and_counters() -> None:
    bm = BlockManager(8, 4, "w")
    a: list[int] = []
    assert bm.allocate(a, [], 0, 3)
    b: list[int] = []
    assert bm.allocate(b, [], 0, 2)
    assert a == [0, 1, 2] and b == [3, 4]
    assert bm.active_blocks == 5 and bm.free_blocks == 3 and bm.cached_blocks == 0
    assert bm.allocate(a, [], 0, 4)  # grows in place
    assert a == [0, 1, 2, 5]
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 1, 1, 0, 0]
    assert bm.drain_events() == []  # nothing cached, nothing evicted


def test_cache_blocks_one_event_per_run_with_parent() -> None:
    bm = BlockManager(8, 4, "w")
    t: list[int] = []
    assert bm.allocate(t, H, 0, 4)
    bm.cache_blocks(t, H, 0, 2)
    bm.cache_blocks(t, H, 2, 3)
    ev = bm.drain_events()
    assert ev == [
        BlockStored("w", 0, (H[0], H[1]), None),
        BlockStored("w", 1, (H[2],), H[1]),
    ]
    assert bm.cached_blocks == 3 and bm.active_blocks == 4
    assert [bm.block_hash(b) for b in t] == [H[0], H[1], H[2], None]
    assert sorted(bm.cached_hashes()) == sorted(H[:3])
    assert bm.drain_events() == []


def test_release_is_tail_first_and_clean_blocks_are_reused_first() -> None:
    bm = BlockManager(6, 4, "w")
    a = filled(bm, H[:3], 4)  # blocks 0,1,2 cached; block 3 partial (no hash)
    assert a == [0, 1, 2, 3]
    bm.release(a)
    assert a == []
    assert bm.active_blocks == 0
    assert bm.lru_order() == [2, 1, 0]  # deepest block first in line for eviction
    assert bm.evictable_blocks == 3 and bm.cached_blocks == 3
    bm.drain_events()
    # Clean blocks (3, then the never-used 4, 5) go before any cached block is evicted.
    b: list[int] = []
    assert bm.allocate(b, [], 0, 3)
    assert b == [3, 4, 5]
    assert bm.drain_events() == []
    c: list[int] = []
    assert bm.allocate(c, [], 0, 2)
    assert c == [2, 1]  # LRU head first
    assert bm.drain_events() == [BlockRemoved("w", 1, (H[2], H[1]))]
    assert bm.lru_order() == [0]
    assert sorted(bm.cached_hashes()) == [H[0]]
    assert bm.cached_blocks == 1


def test_lru_is_ordered_by_release_time() -> None:
    bm = BlockManager(4, 4, "w")
    a = filled(bm, [H[0]], 1)
    b = filled(bm, [H[1]], 1)
    c = filled(bm, [H[2]], 1)
    bm.release(b)
    bm.release(a)
    bm.release(c)
    assert bm.lru_order() == [b_id for b_id in (1, 0, 2)]
    bm.drain_events()
    t: list[int] = []
    assert bm.allocate(t, [], 0, 3)  # clean block 3, then evict 1, then 0
    assert t == [3, 1, 0]
    assert bm.drain_events() == [BlockRemoved("w", 3, (H[1], H[0]))]


def test_prefix_match_and_reactivation() -> None:
    bm = BlockManager(8, 4, "w")
    a = filled(bm, H[:3], 3)
    bm.release(a)
    bm.drain_events()
    # inactive hit: no active discount
    assert bm.match_prefix(H[:5], 10) == (3, 0)
    assert bm.match_prefix(H[:5], 2) == (2, 0)  # capped
    assert bm.match_prefix([999, H[1], H[2]], 10) == (0, 0)  # the chain starts at block 0
    assert bm.match_prefix([H[0], 999, H[2]], 10) == (1, 0)  # and stops at the first miss
    t: list[int] = []
    assert bm.allocate(t, H[:5], 3, 5)
    assert t == [0, 1, 2, 3, 4]  # hits reactivate their blocks, then fresh ones
    assert bm.lru_order() == []  # reactivation took them off the free list
    assert bm.active_blocks == 5 and bm.evictable_blocks == 0
    # now the hits are active, and shared blocks are ref counted
    assert bm.match_prefix(H[:5], 10) == (3, 3)
    assert bm.match_prefix(H[:5], 1) == (1, 1)
    u: list[int] = []
    assert bm.allocate(u, H[:2], 2, 3)
    assert u == [0, 1, 5]
    assert [bm.ref_count(i) for i in range(6)] == [2, 2, 1, 1, 1, 1]
    bm.release(t)
    assert [bm.ref_count(i) for i in range(6)] == [1, 1, 0, 0, 0, 1]
    assert bm.lru_order() == [2]  # 3 and 4 had no hash: they went back clean
    bm.release(u)
    assert bm.lru_order() == [2, 1, 0]
    assert bm.active_blocks == 0
    assert bm.drain_events() == []


def test_allocation_is_all_or_nothing_and_pinned_hits_are_not_evicted() -> None:
    bm = BlockManager(4, 4, "w")
    a = filled(bm, H[:3], 3)
    bm.release(a)  # LRU [2, 1, 0], clean [3]
    bm.drain_events()
    t: list[int] = []
    # 2 hits (inactive) + 3 fresh: only 1 clean + 1 evictable left once the hits are pinned
    assert not bm.allocate(t, H[:2], 2, 5)
    assert t == [] and bm.active_blocks == 0 and bm.lru_order() == [2, 1, 0]
    assert bm.drain_events() == []
    # 2 hits + 2 fresh fits: clean 3, then evict 2 (never the pinned 0, 1)
    assert bm.allocate(t, H[:2], 2, 4)
    assert t == [0, 1, 3, 2]
    assert bm.drain_events() == [BlockRemoved("w", 1, (H[2],))]  # seq 0 was the BlockStored
    assert not bm.append_fresh(t)
    assert bm.free_blocks == 0


def test_append_fresh_evicts_when_no_clean_block() -> None:
    bm = BlockManager(2, 4, "w")
    a = filled(bm, [H[0]], 1)
    bm.release(a)
    t: list[int] = []
    assert bm.append_fresh(t) and bm.append_fresh(t)
    assert t == [1, 0]
    assert bm.drain_events() == [BlockStored("w", 0, (H[0],), None), BlockRemoved("w", 1, (H[0],))]


def test_duplicate_copies_announce_once_and_remove_with_the_last_copy() -> None:
    bm = BlockManager(4, 4, "w")
    a = filled(bm, H[:2], 2)  # blocks 0, 1
    b: list[int] = []
    assert bm.allocate(b, H[:2], 1, 2)  # hit block 0, fresh block 2 for the same H[1]
    bm.cache_blocks(b, H[:2], 1, 2)
    assert b == [0, 2]
    assert bm.cached_blocks == 3  # two physical copies of H[1]
    assert bm.drain_events() == [BlockStored("w", 0, (H[0], H[1]), None)]
    bm.release(a)  # LRU [1, 0]... block 0 still held by b
    assert bm.lru_order() == [1]
    t: list[int] = []
    assert bm.allocate(t, [], 0, 2)  # clean 3, then evict 1: H[1] survives in block 2
    assert t == [3, 1]
    assert bm.drain_events() == []
    assert bm.match_prefix(H[:2], 5) == (2, 2)
    bm.release(b)
    assert bm.lru_order() == [2, 0]
    bm.release(t)
    u: list[int] = []
    assert bm.allocate(u, [], 0, 4)  # clean 3, 1 (a stack), then evict 2 (last H[1]), 0 (H[0])
    assert u == [3, 1, 2, 0]
    assert bm.drain_events() == [BlockRemoved("w", 1, (H[1], H[0]))]
    assert bm.cached_blocks == 0 and bm.cached_hashes() == []


def test_dedup_run_is_split_around_a_duplicate() -> None:
    bm = BlockManager(8, 4, "w")
    filled(bm, [H[0], H[1]], 2)
    bm.drain_events()
    t: list[int] = []
    assert bm.allocate(t, H[:4], 0, 4)
    bm.cache_blocks(t, [H[0], 7, 8, 9], 0, 4)  # H[0] already visible: no event for it
    assert bm.drain_events() == [BlockStored("w", 1, (7, 8, 9), H[0])]


def test_sequence_numbers_and_reset() -> None:
    bm = BlockManager(4, 4, "w")
    a = filled(bm, H[:2], 3)
    bm.release(a)
    b = filled(bm, [H[3]], 1)  # takes clean block 2
    assert b == [2]
    bm.reset()
    ev = bm.drain_events()
    assert [e.seq for e in ev] == [0, 1, 2]
    assert ev[2] == AllBlocksCleared("w", 2)
    assert bm.cached_blocks == 0 and bm.cached_hashes() == [] and bm.lru_order() == []
    assert bm.active_blocks == 1 and bm.block_hash(2) is None
    assert bm.match_prefix(H[:2], 5) == (0, 0)
    # freed cached blocks became clean: no eviction events on reuse
    t: list[int] = []
    assert bm.allocate(t, [], 0, 3)
    assert sorted(t) == [0, 1, 3]
    assert bm.drain_events() == []
    bm.release(b)
    assert bm.lru_order() == []  # it lost its hash: back to clean, not to the LRU
    t2: list[int] = []
    assert bm.append_fresh(t2)
    bm.cache_blocks(t2, [H[4]], 0, 1)
    assert bm.drain_events() == [BlockStored("w", 3, (H[4],), None)]
