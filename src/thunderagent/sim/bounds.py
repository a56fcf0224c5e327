"""Reference bounds on prefix reuse for a trace, independent of any router.

:func:`reuse_bounds` replays the requests in arrival order through

1. **one global LRU cache** of ``capacity_blocks`` engine blocks: the whole fleet's KV capacity
   as if it were a single engine. No router can beat this with the same total memory by much
   (it is the reuse of a perfect router whose workers never compete for memory or hold active,
   unevictable blocks; an oracle with future knowledge could still do better than LRU);
2. an **infinite cache**: every block ever computed stays; the trace's ceiling.

Per request the rules are those of the engines (Dynamo 1.6.1's mocker and its trace replay):
the engine-block chained hashes of the request's synthetic tokens
(``block_hashes(tr.tokens(), block_size)``; only full blocks); hit = the longest prefix of them
present in the cache, capped at ``floor((input_length - 1) / block_size)`` blocks because an engine
always recomputes at least one token; reused tokens = ``hit * block_size``. Then all of the
request's full blocks are inserted or touched, from first to last (so touched blocks become the
most recent and its deepest block the most recent of all); inserting over capacity evicts the least
recently used block. Reuse = sum of reused tokens / sum of input tokens.

Simplifications against a real run (all in the bound's favour or neutral): requests are
instantaneous (no concurrency, so no active blocks pinned while others need space), generated
tokens are not cached, and arrival order is the processing order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from thunderagent.kv.hashing import block_hashes
from thunderagent.sim.traces import TraceRequest

__all__ = ["Bounds", "reuse_bounds"]


@dataclass(slots=True, frozen=True)
class Bounds:
    """``global_lru_reuse`` / ``infinite_cache_reuse``: reused prompt tokens / prompt tokens."""

    global_lru_reuse: float
    infinite_cache_reuse: float
    prompt_tokens: int


def reuse_bounds(requests: Iterable[TraceRequest], block_size: int, capacity_blocks: int) -> Bounds:
    """Prefix reuse of ``requests`` (processed in arrival order, input order breaking ties) with one
    global LRU cache of ``capacity_blocks`` blocks of ``block_size`` tokens, and with an infinite
    cache. See the module docstring for the exact rules."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    reqs = sorted(requests, key=lambda r: r.arrival_s)  # stable: input order breaks ties
    lru: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    lru_hit_tokens = 0
    inf_hit_tokens = 0
    prompt_tokens = 0
    touch = lru.move_to_end
    evict = lru.popitem
    for tr in reqs:
        n = tr.input_length
        prompt_tokens += n
        hashes = block_hashes(tr.tokens(), block_size)
        cap = (n - 1) // block_size if n > 0 else 0

        hit = 0
        for h in hashes[:cap]:
            if h not in lru:
                break
            hit += 1
        lru_hit_tokens += hit * block_size

        hit = 0
        for h in hashes[:cap]:
            if h not in seen:
                break
            hit += 1
        inf_hit_tokens += hit * block_size

        seen.update(hashes)
        if capacity_blocks:
            for h in hashes:
                if h in lru:
                    touch(h)
                else:
                    lru[h] = None
                    if len(lru) > capacity_blocks:
                        evict(last=False)
    if prompt_tokens == 0:
        return Bounds(0.0, 0.0, 0)
    return Bounds(lru_hit_tokens / prompt_tokens, inf_hit_tokens / prompt_tokens, prompt_tokens)
