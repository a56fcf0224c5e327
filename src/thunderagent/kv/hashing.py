"""Chained 64-bit block hashes over full token blocks.

A block's hash is ``xxh3_64(tokens of the block, seed = parent hash)``; the first block is seeded by
:func:`hash_seed`, which mixes the tenant salt (``cache_salt``) and the LoRA adapter name, so two
tenants or two adapters never share a prefix by accident. Only full blocks are hashed: the partial
tail can never be reused by an engine, so it must not count as an overlap either.

Double hash (the index's guard against primary collisions, ``routing.double_hash``):
:func:`block_hash_pairs` also returns a *check* hash per block, a second 64-bit chain that is
independent of the first: another algorithm (xxh64, not xxh3) and its own seed chain
(:func:`check_seed`), so a collision of two prefixes in the primary chain says nothing about
theirs in the check chain. The index keys everything by the primary and uses the check hash only to
verify (``kv.check``).

Hashes are computed once per request (the frontend) and carried along in ``RouteRequest`` /
``EngineRequest``; no later stage re-hashes the prompt.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
_xxh64 = xxhash.xxh64_intdigest

#: signature of a primary block hash: ``(block bytes, seed=parent) -> 64-bit int``. Injectable in
#: :func:`block_hash_pairs` only so tests can force primary collisions.
PrimaryHash = Callable[..., int]

#: mixes a chain seed into the check chain's seed: the check chain never starts from the same
#: number as the primary one.
_CHECK_SEED = 0x636865636B  # "check"

#: seed of a request with neither salt nor LoRA. Non-zero so an empty-seed chain is still mixed.
BASE_SEED = 0x7468756E646572  # "thunder"


def hash_seed(cache_salt: str | None = None, lora_name: str | None = None) -> int:
    """Seed of a request's chain. Salt and LoRA name are length-prefixed so ("ab", "c") and
    ("a", "bc") cannot collide."""
    if not cache_salt and not lora_name:
        return BASE_SEED
    salt = (cache_salt or "").encode()
    lora = (lora_name or "").encode()
    payload = len(salt).to_bytes(4, "little") + salt + len(lora).to_bytes(4, "little") + lora
    return _xxh3(payload, seed=BASE_SEED)


def block_hashes(
    tokens: Sequence[int], block_size: int, seed: int = BASE_SEED, parent: int | None = None
) -> list[int]:
    """Hashes of every *full* block of ``tokens``, chained from ``parent`` (or ``seed``).

    The whole prompt is packed into one uint32 array once and hashed through a memoryview of it, so no
    bytes object is built, neither per block nor for the prompt (this runs once per request on the routing
    hot path); the seed goes positionally (a keyword costs ~0.1 µs per block in the C call).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(tokens)
    end = n - n % block_size
    if end == 0:
        return []
    # a memoryview of the uint32 array hashes its native bytes, the same bytes as ``tobytes()``. A list (the
    # frontend's tokens) is packed by ``fromlist``: 0.7x the time of ``array("I", list)``, which goes through
    # the iterator protocol; the tail past the last full block is cut off the array, not copied off the list.
    if isinstance(tokens, list):
        packed = array("I")
        packed.fromlist(tokens)
        if end != n:
            del packed[end:]
    else:
        packed = array("I", tokens if end == n else tokens[:end])
    view = memoryview(packed)
    h = seed if parent is None else parent
    out: list[int] = []
    push = out.append
    for i in range(0, end, block_size):
        h = _xxh3(view[i : i + block_size], h)
        push(h)
    return out


def hash_block(tokens: Sequence[int], parent: int) -> int:
    """Hash of one block given its parent's hash (or the chain seed for the first block).
    Used by engines to extend a chain over generated tokens as blocks fill up."""
    return _xxh3(array("I", tokens).tobytes(), seed=parent)


def check_seed(seed: int) -> int:
    """First parent of the check chain, derived from the primary chain's seed (salt, LoRA)."""
    return _xxh64(seed.to_bytes(8, "little"), seed=_CHECK_SEED)


def block_hash_pairs(
    tokens: Sequence[int], block_size: int, seed: int = BASE_SEED, *, primary: PrimaryHash = _xxh3
) -> tuple[list[int], list[int]]:
    """Primary and check hashes of every full block: ``(block_hashes(...), checks)``.

    One packing of the prompt serves both chains (the only extra work is the xxh64 pass).
    ``primary`` replaces xxh3 in the primary chain (tests force collisions with it); the check
    chain always uses xxh64.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n_full = len(tokens) // block_size
    if n_full == 0:
        return [], []
    view = memoryview(array("I", tokens[: n_full * block_size]).tobytes())
    step = block_size * 4
    h, c = seed, check_seed(seed)
    out, checks = [0] * n_full, [0] * n_full
    for i in range(n_full):
        block = view[i * step : (i + 1) * step]
        h = primary(block, seed=h)
        c = _xxh64(block, seed=c)
        out[i] = h
        checks[i] = c
    return out, checks


def check_block(tokens: Sequence[int], parent_check: int) -> int:
    """Check hash of one block given its parent's check hash (or ``check_seed(seed)``)."""
    return _xxh64(array("I", tokens).tobytes(), seed=parent_check)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks ``a`` and ``b`` share (chained hashes: equal at ``i`` means equal before it,
    so bisection finds the first difference)."""
    if a is b:
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
