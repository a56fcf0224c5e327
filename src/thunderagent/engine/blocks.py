"""Paged KV block manager with a prefix cache (vLLM block pool, as Dynamo's mocker models it).

Physical blocks are ids ``0..N-1``. A block is in exactly one of three states:

* **active**: referenced by at least one running request (``ref > 0``);
* **free, cached**: ``ref == 0`` but it still holds a full block's hash, so a later request can
  reuse it; these sit in an LRU list and are evicted head-first when capacity runs out;
* **free, clean**: ``ref == 0`` and no hash (never filled, or its hash was evicted/cleared).

Allocation takes clean blocks first and evicts cached ones only when no clean block is left. That is
the mocker's pool (``vllm_block_pool.rs``: anonymous free capacity before LRU eviction), and it is
what we calibrate against; vLLM itself mixes both kinds in one queue.

The per-block state lives in parallel ``list``s indexed by block id rather than one object per
block: attribute access on a million slot objects is slower than list indexing, and nothing is
allocated while blocks move between states. The LRU is intrusive (``_prev``/``_next`` arrays with a
sentinel node at index ``N``), like vLLM's ``FreeKVCacheBlockQueue``: unlinking a block that a
prefix hit reactivates is O(1) and allocates nothing.

A hash may be held by several physical copies (two requests computed the same block, or the
forced-recompute last block of a fully cached prompt). Lookups use the first copy; the cache
reports ``BlockStored`` only when a hash becomes visible (0 -> 1 copies) and ``BlockRemoved`` only
when its last copy is evicted, so an index fed by these events never loses a hash still present.
"""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class BlockManager:
    __slots__ = (
        "worker_id",
        "num_blocks",
        "block_size",
        "_ref",
        "_hash",
        "_check",
        "_prev",
        "_next",
        "_clean",
        "_by_hash",
        "_dups",
        "_lru_len",
        "_active",
        "_cached",
        "_events",
        "_seq",
    )

    def __init__(self, num_blocks: int, block_size: int, worker_id: str = "") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        n = num_blocks
        self._ref = [0] * n
        self._hash: list[int | None] = [None] * n
        # The double-hash guard's check hash of each block's content (``kv.check``), set with its hash
        # when the request carried check hashes; read only while the block holds a hash.
        self._check: list[int | None] = [None] * n
        # LRU of free cached blocks; node n is the sentinel (head = _next[n], tail = _prev[n]).
        self._prev = [n] * (n + 1)
        self._next = [n] * (n + 1)
        # Clean free blocks as a stack; reversed so the first allocations get ids 0, 1, 2, ...
        self._clean = list(range(n - 1, -1, -1))
        self._by_hash: dict[int, int] = {}  # hash -> first (lookup) copy
        self._dups: dict[int, list[int]] = {}  # hash -> further copies (rare)
        self._lru_len = 0
        self._active = 0
        self._cached = 0
        self._events: list[KvEvent] = []
        self._seq = 0

    # ------------------------------------------------------------------------------ counters
    @property
    def active_blocks(self) -> int:
        """Blocks referenced by running requests."""
        return self._active

    @property
    def cached_blocks(self) -> int:
        """Physical blocks holding a hash (active or free)."""
        return self._cached

    @property
    def free_blocks(self) -> int:
        """Blocks a request could get: clean ones plus evictable cached ones."""
        return self.num_blocks - self._active

    @property
    def evictable_blocks(self) -> int:
        """Free blocks that still hold a hash (the LRU list)."""
        return self._lru_len

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> int | None:
        return self._hash[block]

    def lru_order(self) -> list[int]:
        """Free cached blocks, next-to-evict first (for tests and debugging)."""
        out, nxt, s = [], self._next, self.num_blocks
        b = nxt[s]
        while b != s:
            out.append(b)
            b = nxt[b]
        return out

    def cached_hashes(self) -> list[int]:
        """Every hash the cache holds (one entry per hash, whatever its copy count)."""
        return list(self._by_hash)

    def cached_checks(self) -> list[int] | None:
        """The check hashes of :meth:`cached_hashes`, in the same order; None if some block was
        cached without one (a request without check hashes: the guard is off)."""
        check = self._check
        out = [check[b] for b in self._by_hash.values()]
        return None if None in out else out  # type: ignore[return-value]

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    # ------------------------------------------------------------------------------ lookup
    def match_prefix(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """Longest chain of cached blocks from block 0 (active or free).

        Returns ``(hit_blocks, active_hit_blocks)`` with ``hit_blocks`` capped at ``max_blocks``.
        As in the mocker, active copies are counted over the whole uncapped overlap and then
        clamped to the capped hit, so the admission check sees the same discount it does.
        """
        by_hash, ref = self._by_hash, self._ref
        n = active = 0
        for h in hashes:
            b = by_hash.get(h)
            if b is None:
                break
            n += 1
            if ref[b]:
                active += 1
        if n > max_blocks:
            n = max_blocks
        return n, (active if active < n else n)

    # ------------------------------------------------------------------------------ allocation
    def allocate(self, table: list[int], hashes: Sequence[int], num_hits: int, num_blocks: int) -> bool:
        """Grow ``table`` (a request's block ids, in sequence order) to ``num_blocks`` blocks.

        Positions ``len(table) .. num_hits-1`` reuse the cached copies of ``hashes[pos]`` (they must
        be resident: the caller matched them in the same scheduling step); the rest are fresh.
        All or nothing: on failure nothing changes and False is returned.
        """
        start = len(table)
        if num_blocks <= start:
            return True
        hit_end = num_hits if num_hits < num_blocks else num_blocks
        by_hash, ref = self._by_hash, self._ref
        fresh = num_blocks - (hit_end if hit_end > start else start)
        if fresh > len(self._clean):
            # Eviction needed: hits about to be pinned cannot be evicted to make room.
            inactive_hits = 0
            for pos in range(start, hit_end):
                if not ref[by_hash[hashes[pos]]]:
                    inactive_hits += 1
            if fresh > len(self._clean) + self._lru_len - inactive_hits:
                return False
        for pos in range(start, hit_end):
            b = by_hash[hashes[pos]]
            if not ref[b]:
                self._unlink(b)
                self._active += 1
            ref[b] += 1
            table.append(b)
        if fresh:
            self._take_fresh(table, fresh)
        return True

    def append_fresh(self, table: list[int]) -> bool:
        """Add one fresh block to ``table`` (decode crossing a block boundary). False when full."""
        if self._clean:
            b = self._clean.pop()
            self._ref[b] = 1
            self._active += 1
            table.append(b)
            return True
        if not self._lru_len:
            return False
        self._take_fresh(table, 1)
        return True

    def _take_fresh(self, table: list[int], count: int) -> None:
        clean, ref = self._clean, self._ref
        removed: list[int] | None = None
        self._active += count
        while count and clean:
            b = clean.pop()
            ref[b] = 1
            table.append(b)
            count -= 1
        if count:
            removed = self._evict_head(table, count)
        if removed:
            self._emit(BlockRemoved(self.worker_id, self._seq, tuple(removed)))

    def _evict_head(self, table: list[int], count: int) -> list[int]:
        """Take ``count`` blocks off the LRU head into ``table``; the hashes that lost their last
        copy. Unlinking and the common no-duplicate case are inlined: a full replay evicts millions
        of blocks, one at a time."""
        nxt, prev, s = self._next, self._prev, self.num_blocks
        ref, hash_, by_hash = self._ref, self._hash, self._by_hash
        self._lru_len -= count
        # Walk the head's ``count`` blocks, then cut them off the list once (their own links go
        # stale: ``release`` rewrites them when they rejoin the LRU).
        taken = []
        b = nxt[s]
        for _ in range(count):
            taken.append(b)
            b = nxt[b]
        nxt[s] = b
        prev[b] = s
        removed: list[int]
        if self._dups:  # some hash has several copies: the general path, block by block in LRU order
            removed = []
            for b in taken:
                h = self._evict_hash(b)
                if h is not None:
                    removed.append(h)
        else:  # no copies anywhere: each block is its hash's only (lookup) copy
            # cached blocks: every hash is set
            removed = [hash_[b] for b in taken]  # type: ignore[misc]
            for h in removed:
                del by_hash[h]
            for b in taken:
                hash_[b] = None
            self._cached -= count
        for b in taken:
            ref[b] = 1
        table.extend(taken)
        return removed

    def _evict_hash(self, b: int) -> int | None:
        """Drop block ``b``'s hash; return it if that was the hash's last copy."""
        h = self._hash[b]
        assert h is not None  # only cached blocks are evicted
        self._hash[b] = None
        self._cached -= 1
        if self._by_hash.get(h) == b:
            dups = self._dups.get(h)
            if not dups:
                del self._by_hash[h]
                return h
            self._by_hash[h] = dups.pop(0)
            if not dups:
                del self._dups[h]
            return None
        dups = self._dups[h]
        dups.remove(b)
        if not dups:
            del self._dups[h]
        return None

    # ------------------------------------------------------------------------------ caching
    def cache_blocks(self, table: Sequence[int], hashes: Sequence[int], start: int, end: int,
                     checks: Sequence[int] | None = None) -> None:
        """Register the now-full blocks ``start..end-1`` of ``table`` under ``hashes[pos]``
        (``checks[pos]``: their check hashes, double-hash guard on; they go out with the events).

        Blocks that became visible consecutively go out as ONE ``BlockStored`` (its ``parent_hash``
        is the hash before the first one), which keeps the event stream short.
        """
        hash_, by_hash, check = self._hash, self._by_hash, self._check
        if end - start > 1 and self._cache_fresh(table, hashes, start, end, checks):
            return
        group: list[int] | None = None
        parent: int | None = None
        first = 0  # position of the group's first block
        for pos in range(start, end):
            b = table[pos]
            if hash_[b] is not None:  # already cached (a prefix hit): nothing new to announce
                if group:
                    self._flush(group, parent, checks, first)
                    group = None
                continue
            h = hashes[pos]
            hash_[b] = h
            check[b] = None if checks is None else checks[pos]
            self._cached += 1
            if h in by_hash:  # another copy already visible: no event, and it ends a group
                dups = self._dups.get(h)
                if dups is None:
                    self._dups[h] = [b]
                else:
                    dups.append(b)
                if group:
                    self._flush(group, parent, checks, first)
                    group = None
                continue
            by_hash[h] = b
            if group is None:
                group = [h]
                parent = hashes[pos - 1] if pos > 0 else None
                first = pos
            else:
                group.append(h)
        if group:
            self._flush(group, parent, checks, first)

    def _cache_fresh(self, table: Sequence[int], hashes: Sequence[int], start: int, end: int,
                     checks: Sequence[int] | None) -> bool:
        """``cache_blocks``'s common case, whole: fresh blocks (no hash yet) under distinct hashes
        no copy holds, so they all become visible as one group. Checked and applied with C-level
        bulk calls instead of the per-block loop; same state, same one event. False (nothing
        changed) when it does not apply."""
        hash_, by_hash, check = self._hash, self._by_hash, self._check
        blocks = table[start:end]
        hs = hashes[start:end]
        if not (hash_[blocks[0]] is None and by_hash.keys().isdisjoint(hs)
                and [hash_[b] for b in blocks].count(None) == len(blocks) and len(set(hs)) == len(hs)):
            return False
        ck = None if checks is None else checks[start:end]
        for b, h in zip(blocks, hs):
            hash_[b] = h
        if ck is None:
            for b in blocks:
                check[b] = None
        else:
            for b, c in zip(blocks, ck):
                check[b] = c
        by_hash.update(zip(hs, blocks))
        self._cached += len(blocks)
        self._emit(BlockStored(self.worker_id, self._seq, tuple(hs), hashes[start - 1] if start > 0 else None,
                               None if ck is None else tuple(ck)))
        return True

    def _flush(self, group: list[int], parent: int | None, checks: Sequence[int] | None, first: int) -> None:
        ck = None if checks is None else tuple(checks[first : first + len(group)])
        self._emit(BlockStored(self.worker_id, self._seq, tuple(group), parent, ck))

    # ------------------------------------------------------------------------------ release
    def release(self, table: list[int]) -> None:
        """Drop a request's references, tail first, and clear ``table``.

        Tail first means a sequence's deepest blocks enter the LRU before its root, so they are
        evicted first and the shared prefix survives longest.
        """
        ref, hash_, clean = self._ref, self._hash, self._clean
        prev, nxt, s = self._prev, self._next, self.num_blocks
        # The freed cached blocks are chained onto the LRU tail one after another and the
        # sentinel is closed once at the end (counters too): fewer stores per block.
        t = prev[s]
        freed = linked = 0
        for b in reversed(table):
            r = ref[b] - 1
            ref[b] = r
            if r:
                continue
            freed += 1
            if hash_[b] is None:
                clean.append(b)
            else:  # append to the LRU tail
                nxt[t] = b
                prev[b] = t
                t = b
                linked += 1
        nxt[t] = s
        prev[s] = t
        self._active -= freed
        self._lru_len += linked
        table.clear()

    def _unlink(self, b: int) -> None:
        prev, nxt = self._prev, self._next
        p, n = prev[b], nxt[b]
        nxt[p] = n
        prev[n] = p
        self._lru_len -= 1

    # ------------------------------------------------------------------------------ events
    def _emit(self, ev: KvEvent) -> None:
        self._events.append(ev)
        self._seq += 1

    def drain_events(self) -> list[KvEvent]:
        """KV events since the last call, in sequence order (sequence numbers start at 0)."""
        ev = self._events
        self._events = []
        return ev

    def reset(self) -> None:
        """Forget every cached hash (free cached blocks become clean) and emit ``AllBlocksCleared``.

        Blocks held by running requests stay allocated but lose their hash, so they are never
        announced again; their owners keep running.
        """
        s = self.num_blocks
        for b in self.lru_order():
            self._clean.append(b)
        self._prev[s] = self._next[s] = s
        self._lru_len = 0
        self._hash = [None] * self.num_blocks
        self._by_hash.clear()
        self._dups.clear()
        self._cached = 0
        self._emit(AllBlocksCleared(self.worker_id, self._seq))
