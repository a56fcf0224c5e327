"""Chained block hashing (kv.hashing): pinned values and chain properties."""

from __future__ import annotations

import pytest

from thunderagent.kv.hashing import BASE_SEED, block_hashes, hash_block, hash_seed

TOKENS = list(range(100, 140))  # 40 tokens: 5 full blocks of 8
BS = 8


# -- pinned values: an accidental change of the hash function (algorithm, token packing, seed
# mixing) must fail here, since hashes may be persisted/compared across processes and versions.
def test_pinned_values() -> None:
    assert BASE_SEED == 32765950870971762
    assert hash_seed() == BASE_SEED
    assert hash_seed("tenant-a") == 7798340560721300762
    assert hash_seed(None, "lora-x") == 1913418945933417934
    assert hash_seed("ab", "c") == 14450447573891541176
    assert hash_seed("a", "bc") == 499391155668504647
    assert block_hashes(list(range(10)), 4) == [9742743345569933584, 6113215311724891313]
    assert block_hashes(list(range(10)), 4, seed=hash_seed("tenant-a")) == [
        18209044056903913666,
        3268312357161319360,
    ]
    assert hash_block([1, 2, 3, 4], BASE_SEED) == 4390039465642341947


@pytest.mark.parametrize(
    ("n_tokens", "block_size", "expected_blocks"),
    [(0, 4, 0), (3, 4, 0), (4, 4, 1), (7, 4, 1), (8, 4, 2), (40, 8, 5), (41, 8, 5), (5, 1, 5)],
)
def test_only_full_blocks_hashed(n_tokens: int, block_size: int, expected_blocks: int) -> None:
    assert len(block_hashes(list(range(n_tokens)), block_size)) == expected_blocks


def test_partial_tail_does_not_change_full_block_hashes() -> None:
    assert block_hashes(TOKENS + [1, 2, 3], BS) == block_hashes(TOKENS, BS)


def test_chain_property() -> None:
    hs = block_hashes(TOKENS, BS)
    assert hs[0] == hash_block(TOKENS[:BS], BASE_SEED)  # first block uses the seed
    for i in range(1, len(hs)):
        assert hash_block(TOKENS[i * BS : (i + 1) * BS], hs[i - 1]) == hs[i]


def test_chain_property_with_custom_seed() -> None:
    seed = hash_seed("tenant-a", "lora-x")
    hs = block_hashes(TOKENS, BS, seed=seed)
    assert hs[0] == hash_block(TOKENS[:BS], seed)
    for i in range(1, len(hs)):
        assert hash_block(TOKENS[i * BS : (i + 1) * BS], hs[i - 1]) == hs[i]


@pytest.mark.parametrize("pos", [0, 7, 8, 20, 39])
def test_changing_one_token_changes_its_block_and_all_after(pos: int) -> None:
    base = block_hashes(TOKENS, BS)
    changed_tokens = list(TOKENS)
    changed_tokens[pos] += 1
    changed = block_hashes(changed_tokens, BS)
    k = pos // BS
    assert changed[:k] == base[:k]
    for i in range(k, len(base)):
        assert changed[i] != base[i]


def test_same_tokens_different_position_differ() -> None:
    # Two identical blocks at different depths hash differently (the parent is in the hash).
    toks = [5] * 16
    h0, h1 = block_hashes(toks, 8)
    assert h0 != h1


@pytest.mark.parametrize(
    ("salt", "lora"),
    [("tenant-a", None), (None, "lora-x"), ("tenant-a", "lora-x"), ("tenant-b", None)],
)
def test_salt_and_lora_change_every_hash(salt: str | None, lora: str | None) -> None:
    plain = block_hashes(TOKENS, BS)
    salted = block_hashes(TOKENS, BS, seed=hash_seed(salt, lora))
    assert len(salted) == len(plain)
    assert all(a != b for a, b in zip(plain, salted))


def test_salt_lora_are_length_prefixed_and_distinct() -> None:
    assert hash_seed("ab", "c") != hash_seed("a", "bc")
    assert hash_seed("x", None) != hash_seed(None, "x")  # salt and lora are different slots
    assert hash_seed("tenant-a") != hash_seed("tenant-b")
    # empty salt/lora is "no salt/lora"
    assert hash_seed("", "") == hash_seed(None, None) == BASE_SEED
    # deterministic
    assert hash_seed("t", "l") == hash_seed("t", "l")


@pytest.mark.parametrize("split_blocks", [1, 2, 4])
def test_parent_continuation_equals_concatenation(split_blocks: int) -> None:
    whole = block_hashes(TOKENS, BS)
    cut = split_blocks * BS
    head = block_hashes(TOKENS[:cut], BS)
    tail = block_hashes(TOKENS[cut:], BS, parent=head[-1])
    assert head + tail == whole


def test_parent_overrides_seed() -> None:
    head = block_hashes(TOKENS[:BS], BS)
    tail_a = block_hashes(TOKENS[BS:], BS, seed=123, parent=head[-1])
    tail_b = block_hashes(TOKENS[BS:], BS, parent=head[-1])
    assert tail_a == tail_b


def test_large_token_ids() -> None:
    # Token ids up to 2**32 - 1 are valid vocab indices for the uint32 packing.
    hs = block_hashes([2**32 - 1, 0, 150_000, 7], 4)
    assert len(hs) == 1 and hs[0] == hash_block([2**32 - 1, 0, 150_000, 7], BASE_SEED)


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, block_size)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([], block_size)
