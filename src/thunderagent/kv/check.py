"""The double-hash guard: a second, independent 64-bit hash that verifies the index's primary keys.

The index (``kv.index``) is keyed by the primary chained hash alone. A primary collision (two
different prefixes, one 64-bit hash) would otherwise read as a cache hit on the wrong content. With
the guard on (``routing.double_hash``), the index also keeps, per primary hash, the *check* hash
(``kv.hashing.block_hash_pairs``: xxh64 on its own seed chain) of the content indexed under it:

- a source that hashed the tokens itself passes the check hashes along and *binds* them: the
  router's predictions (the request's prompt) and ``BlockStored`` events that carry
  ``check_hashes`` (no producer sends them yet: the vLLM / SGLang translator could, it has the
  ``token_ids``);
- if two sources bind different check hashes to one primary, the primary is *poisoned*
  (:data:`CONFLICT`): no query matches it until its last entry leaves the index;
- a query that carries check hashes matches a block only if the block's binding is absent or equal
  to its own check hash; the first block that fails ends the match, exactly as a block no worker
  holds would.

Guarantee. For every primary hash that carries a binding, a hit needs both hashes to agree: a
primary collision alone can never produce a false hit, only a miss (the poisoned block and what
follows it). A false hit would need the independent check chain to collide on the same pair of
prefixes as well (2**-64 for non-adversarial input; neither hash is cryptographic). Entries whose
source sent no check hashes (hash-only cache dumps, the simulated engine's events, the NATS wire,
the engine-event translator today) do not bind: a primary with *only* such entries matches on the primary alone, as with the
guard off, and such an entry sharing a primary with bound entries of the same content is not
checked itself. Queries without check hashes (the scheduler's grouping and pacing estimates) are
not checked either.

Lifetime: a binding lives exactly as long as some entry (any worker, confirmed or predicted) of its
primary; ``forget`` is called when the last one goes, so the map never outgrows the index.
"""

from __future__ import annotations

from collections.abc import Sequence

#: binding of a poisoned primary: real check hashes are unsigned, so no query ever equals it
CONFLICT = -1


class CheckMap:
    """primary hash -> check hash of the content indexed under it (or :data:`CONFLICT`)."""

    __slots__ = ("_check",)

    def __init__(self) -> None:
        self._check: dict[int, int] = {}

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
