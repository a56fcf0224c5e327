"""Reuse bounds (sim.bounds) against hand-computed traces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from thunderagent.sim.bounds import Bounds, reuse_bounds
from thunderagent.sim.traces import TraceRequest, load_trace

DATA = Path(__file__).parents[1] / "data"


def _tr(i: int, ids: list[int], n: int, bs: int = 4) -> TraceRequest:
    return TraceRequest(f"r{i}", float(i), n, 1, ids, bs)


A, B, C, D, E = 10, 11, 12, 13, 14

# Engine block size 4 = trace block size 4, so each listed id is one engine block and a request's
# chained hashes are its id prefixes: [A], [A,B], [A,B,C] ... written A, AB, ABC below.
# Global LRU of 3 blocks; the list is written oldest -> newest.
HAND = [
    # R1 8 tok [A,B]: cap (8-1)//4 = 1. LRU miss, inf miss. insert A, AB -> LRU [A, AB]; seen {A, AB}
    _tr(1, [A, B], 8),
    # R2 12 tok [A,B,C]: cap 11//4 = 2. LRU hits A, AB = 2 blocks = 8 tok; inf 8 tok.
    #    touch A, AB, insert ABC -> LRU [A, AB, ABC] (full)
    _tr(2, [A, B, C], 12),
    # R3 8 tok [D,E]: cap 1. miss both. insert D -> evict A -> [AB, ABC, D]; DE -> evict AB -> [ABC, D, DE]
    _tr(3, [D, E], 8),
    # R4 12 tok [A,B,C]: cap 2. LRU: A evicted -> 0 (ABC is cached but not a prefix hit). inf: A, AB -> 8 tok.
    #    insert A -> evict ABC -> [D, DE, A]; AB -> evict D -> [DE, A, AB]; ABC -> evict DE -> [A, AB, ABC]
    _tr(4, [A, B, C], 12),
    # R5 8 tok [A,B]: cap (8-1)//4 = 1 although AB is cached too: LRU 4 tok, inf 4 tok.
    #    touch A, AB -> [ABC, A, AB]
    _tr(5, [A, B], 8),
    # R6 13 tok [A,B,C] + 1 padding token: 3 full blocks, cap 12//4 = 3. LRU: A, AB, ABC -> 12 tok; inf 12 tok.
    _tr(6, [A, B, C], 13),
]
# input: 8 + 12 + 8 + 12 + 8 + 13 = 61; LRU reused: 0 + 8 + 0 + 0 + 4 + 12 = 24; inf: 0 + 8 + 0 + 8 + 4 + 12 = 32
HAND_EXPECTED = Bounds(24 / 61, 32 / 61, 61)


def test_hand_computed_trace() -> None:
    assert reuse_bounds(HAND, block_size=4, capacity_blocks=3) == HAND_EXPECTED


def test_processed_in_arrival_order() -> None:
    shuffled = HAND[:]
    random.Random(1).shuffle(shuffled)
    assert reuse_bounds(shuffled, 4, 3) == HAND_EXPECTED


def test_capacity_extremes() -> None:
    # no cache at all: LRU reuse 0, infinite unchanged
    assert reuse_bounds(HAND, 4, 0) == Bounds(0.0, 32 / 61, 61)
    # capacity >= all distinct blocks (A, AB, ABC, D, DE = 5): LRU = infinite
    assert reuse_bounds(HAND, 4, 5) == Bounds(32 / 61, 32 / 61, 61)
    assert reuse_bounds([], 4, 3) == Bounds(0.0, 0.0, 0)


def test_capacity_smaller_than_a_request() -> None:
    # capacity 1: R2 inserts A, AB, ABC and keeps only ABC; R4 then misses A in LRU.
    # R1: miss; LRU [AB]. R2: A missing -> 0; ends [ABC]. R3: 0; ends [DE]. R4: 0; [ABC]. R5: A missing -> 0; [AB].
    # R6: A missing -> 0.
    assert reuse_bounds(HAND, 4, 1) == Bounds(0.0, 32 / 61, 61)


def test_mocker_examples() -> None:
    # reference/dynamo-mocker.md §2.4, 512-token trace blocks, 64-token engine blocks
    # 700 tokens [1,2] then 800 tokens [1,2]: the 1st caches 10 full blocks (640 tok), the 2nd reuses them
    b = reuse_bounds([_tr(0, [1, 2], 700, 512), _tr(1, [1, 2], 800, 512)], 64, 1000)
    assert b == Bounds(640 / 1500, 640 / 1500, 1500)
    # a repeated 1024-token prompt reuses 960 (cap floor(1023/64) = 15 blocks)
    b = reuse_bounds([_tr(0, [1, 2], 1024, 512), _tr(1, [1, 2], 1024, 512)], 64, 1000)
    assert b.infinite_cache_reuse == 960 / 2048
    # a half hit reuses 512
    b = reuse_bounds([_tr(0, [1, 2], 1024, 512), _tr(1, [1, 3], 1024, 512)], 64, 1000)
    assert b.infinite_cache_reuse == 512 / 2048
    # a repeated 700-token prompt reuses 640
    b = reuse_bounds([_tr(0, [1, 2], 700, 512), _tr(1, [1, 2], 700, 512)], 64, 1000)
    assert b.infinite_cache_reuse == 640 / 1400


def test_engine_block_independent_of_trace_block() -> None:
    # trace blocks of 8, engine blocks of 4: a shared 8-token trace block = 2 engine blocks.
    # R1 16 tok [1,2] caches 4 engine blocks; R2 12 tok [1,3]: cap 11//4 = 2 -> blocks of trace
    # block 1 (2 engine blocks = 8 tok) hit, the 3rd (trace block 3) misses. reuse 8 / 28.
    b = reuse_bounds([_tr(0, [1, 2], 16, 8), _tr(1, [1, 3], 12, 8)], 4, 100)
    assert b == Bounds(8 / 28, 8 / 28, 28)


def test_excerpt_sanity() -> None:
    reqs = load_trace(DATA / "mooncake_excerpt.jsonl")
    big = reuse_bounds(reqs, 64, 10**9)
    small = reuse_bounds(reqs, 64, 2_000)
    assert big.prompt_tokens == 2_782_179
    assert big.global_lru_reuse == big.infinite_cache_reuse
    assert 0.0 < small.global_lru_reuse < big.infinite_cache_reuse < 1.0
    assert small.infinite_cache_reuse == big.infinite_cache_reuse


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        reuse_bounds(HAND, 0, 3)
    with pytest.raises(ValueError):
        reuse_bounds(HAND, 4, -1)
