"""The double-hash guard: a second, independent 64-bit hash that verifies the index's primary keys.

The index (``kv.index``) is keyed by the primary chained hash alone. A primary collision (two
different prefixes, one 64-bit hash) would otherwise read as a cache hit on the wrong content. With
the guard on (``routing.double_hash``), the index also keeps, per primary hash, the *check* hash
(``kv.hashing.block_hash_pairs``: xxh64 on its own seed chain) of the content indexed under it:

- a source that hashed the tokens itself passes the check hashes along and *binds* them: the
  router's predictions (the request's prompt, hashed by ``Dispatcher.prepare``), ``BlockStored``
  events that carry ``check_hashes`` (the simulated engine, the vLLM / SGLang translator, the NATS
  wire) and cache dumps that carry them (``KvIndex.resync``);
- if two sources bind different check hashes to one primary, the primary is *poisoned*
  (:data:`CONFLICT`): no query matches it until its last entry leaves the index;
- a query that carries check hashes matches a block only if the block's binding is absent (only a
  prediction made without check hashes leaves none; the router always passes them) or equal to its
  own check hash; the first block that fails ends the match, exactly as a block no worker holds
  would.

Unverified entries. With the guard on, a confirmed entry whose source sent no check hashes (a
producer with the guard off, an older one) is *unverified*: the index keeps, per worker, the
hashes it holds unverified, and a query that carries check hashes ends that worker's match before
its first unverified block (:func:`cut_unverified`, :func:`cut_levels`). Every producer of this code
base sends check hashes when the guard is on (the simulated engine, the vLLM / SGLang translator,
the NATS wire, cache dumps), so this is a safety net that costs nothing while no unverified entry
exists.

Guarantee. A query with check hashes matches a worker's block only if that worker's entry is
verified (its source hashed the content, or the router predicted it with its own check hashes) and
the primary's binding equals the query's check hash: a primary collision alone can never produce a
false hit, only a miss (the poisoned block and what follows it). A false hit would need the
independent check chain to collide on the same pair of prefixes as well (2**-64 for
non-adversarial input; neither hash is cryptographic). Queries without check hashes (the
scheduler's grouping and pacing estimates) are not checked.

Lifetime: a binding lives exactly as long as some entry (any worker, confirmed or predicted) of its
primary; ``forget`` is called when the last one goes, so the map never outgrows the index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

#: binding of a poisoned primary: real check hashes are unsigned, so no query ever equals it
CONFLICT = -1


class CheckMap:
    """primary hash -> check hash of the content indexed under it (or :data:`CONFLICT`)."""

    __slots__ = ("_check", "unverified")

    def __init__(self) -> None:
        self._check: dict[int, int] = {}
        #: worker bit -> hashes that worker holds confirmed but unverified (its source sent no
        #: check hashes); the index keeps it in step with the worker's entries
        self.unverified: dict[int, set[int]] = {}

    def confirm(self, bit: int, hashes: Sequence[int], checks: Sequence[int] | None) -> None:
        """A worker's blocks were confirmed (an event, a dump): bind their check hashes, or (none
        sent) mark them unverified for that worker."""
        unverified = self.unverified.get(bit)
        if checks is not None:
            self.bind(hashes, checks)
            if unverified:  # the same content announced again, verified this time
                unverified.difference_update(hashes)
                if not unverified:
                    del self.unverified[bit]
        elif unverified is None:
            self.unverified[bit] = set(hashes)
        else:
            unverified.update(hashes)

    def bind(self, hashes: Sequence[int], checks: Sequence[int]) -> None:
        if len(hashes) != len(checks):
            raise ValueError(f"{len(hashes)} block hashes but {len(checks)} check hashes")
        check = self._check
        setdefault = check.setdefault  # one dict operation per block in the common case
        for h, c in zip(hashes, checks):
            if setdefault(h, c) != c:
                check[h] = CONFLICT  # two contents under one primary: trust neither

    def forget(self, h: int) -> None:
        self._check.pop(h, None)

    def verified_prefix(self, hashes: Sequence[int], checks: Sequence[int], limit: int) -> int:
        """How many of the first ``limit`` query blocks pass the check, leading (a block without
        binding passes)."""
        if len(hashes) != len(checks):
            raise ValueError(f"{len(hashes)} block hashes but {len(checks)} check hashes")
        get = self._check.get
        for i in range(min(limit, len(hashes))):
            s = get(hashes[i])
            if s is not None and s != checks[i]:
                return i
        return min(limit, len(hashes))

    def get(self, h: int) -> int | None:
        return self._check.get(h)

    def __len__(self) -> int:
        return len(self._check)


def cut_unverified(result: dict[str, int], hashes: Sequence[int], unverified: Mapping[int, set[int]],
                   bit_of: Callable[[str], int]) -> dict[str, int]:
    """``result`` (worker -> leading blocks) with each worker's count ended before its first
    unverified block (``unverified``: worker bit -> hashes it holds unverified); a worker left with
    0 blocks is dropped. Changes ``result`` in place and returns it."""
    for wid, n in list(result.items()):
        blocks = unverified.get(bit_of(wid))
        if blocks is None:
            continue
        for i in range(n):
            if hashes[i] in blocks:
                if i:
                    result[wid] = i
                else:
                    del result[wid]
                break
    return result


def cut_levels(levels: list[tuple[int, int]], hashes: Sequence[int],
               unverified: Mapping[int, set[int]]) -> list[tuple[int, int]]:
    """:func:`cut_unverified` on ``KvIndex.match_levels``' (blocks, mask) pairs, fewest blocks first."""
    counts: dict[int, int] = {}  # worker bit -> blocks
    cut = False
    for n, mask in levels:
        while mask:
            bit = mask & -mask
            mask ^= bit
            blocks = unverified.get(bit)
            if blocks is not None:
                i = next((i for i in range(n) if hashes[i] in blocks), n)
                cut |= i < n
                n_bit = i
            else:
                n_bit = n
            if n_bit:
                counts[bit] = n_bit
    if not cut:
        return levels
    by_n: dict[int, int] = {}
    for bit, n in counts.items():
        by_n[n] = by_n.get(n, 0) | bit
    return sorted(by_n.items())
