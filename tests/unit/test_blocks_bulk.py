"""The block manager's bulk caching path (``_cache_fresh``) against its per-block loop: random
workloads with shared prefixes, duplicate copies, check hashes, evictions and releases leave the
same blocks, LRU order, hashes and events either way."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import thunderagent.engine
from thunderagent.engine.blocks import BlockManager


def _interpreted_blocks():  # type: ignore[no-untyped-def]
    """``engine/blocks.py`` run from its source: the build compiles it (``native.py``), and a compiled
    class cannot be subclassed from Python."""
    path = Path(thunderagent.engine.__file__).with_name("blocks.py")
    spec = importlib.util.spec_from_file_location("_blocks_interpreted", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class PerBlock(_interpreted_blocks().BlockManager):  # type: ignore[misc]
    """The reference: every ``cache_blocks`` call takes the per-block loop."""

    __slots__ = ()

    def _cache_fresh(self, *args: object) -> bool:
        return False


def state(bm: BlockManager) -> tuple:
    n = bm.num_blocks
    return (bm.lru_order(), sorted(bm.cached_hashes()), [bm.ref_count(b) for b in range(n)],
            [bm.block_hash(b) for b in range(n)], bm.active_blocks, bm.cached_blocks, bm.evictable_blocks,
            bm.cached_checks(), bm.drain_events())


def run(bm: BlockManager, seed: int, checks_on: bool) -> list[tuple]:
    rng = random.Random(seed)
    # a few chains; requests take a random prefix of one, sometimes a private tail (fresh hashes)
    chains = [[c * 1000 + k for k in range(12)] for c in range(3)]
    tables: list[tuple[list[int], list[int]]] = []
    snaps = []
    for step in range(300):
        if tables and rng.random() < 0.4:
            t, _ = tables.pop(rng.randrange(len(tables)))
            bm.release(t)
        else:
            hs = chains[rng.randrange(3)][: rng.randint(1, 12)]
            if rng.random() < 0.3:
                hs = hs + [10**6 + step * 10 + k for k in range(rng.randint(1, 4))]
            # sometimes ignore the cache (as if matched before another request cached the same
            # blocks): its blocks become duplicate copies, which the bulk path must leave alone
            hits = 0 if rng.random() < 0.2 else bm.match_prefix(hs, len(hs) - 1)[0]
            t: list[int] = []
            if not bm.allocate(t, hs, hits, len(hs)):
                continue
            ck = [h ^ 0x5A5A for h in hs] if checks_on else None
            # cache in one or two calls, from the first non-hit block (as the engine does)
            mid = rng.randint(hits, len(hs))
            bm.cache_blocks(t, hs, hits, mid, ck)
            bm.cache_blocks(t, hs, mid, len(hs), ck)
            tables.append((t, hs))
        snaps.append(state(bm))
    return snaps


def test_bulk_caching_matches_the_per_block_loop() -> None:
    for seed in range(20):
        for checks_on in (False, True):
            assert run(BlockManager(24, 4, "w"), seed, checks_on) == run(PerBlock(24, 4, "w"), seed, checks_on)


def test_bulk_path_declines_duplicates_and_cached_blocks() -> None:
    bm = BlockManager(8, 4, "w")
    t: list[int] = []
    assert bm.allocate(t, [], 0, 3)
    assert not bm._cache_fresh(t, [7, 8, 7], 0, 3, None)  # a hash twice in the run: per-block loop
    assert bm.cached_blocks == 0 and bm.drain_events() == []
    assert bm._cache_fresh(t, [7, 8, 9], 0, 2, None)
    assert not bm._cache_fresh(t, [7, 8, 9], 1, 3, None)  # block 1 holds a hash already
    u: list[int] = []
    assert bm.allocate(u, [], 0, 2)
    assert not bm._cache_fresh(u, [5, 8], 0, 2, None)  # 8 is visible elsewhere: a duplicate copy
