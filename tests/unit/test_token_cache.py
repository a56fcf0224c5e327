"""The cache of recent long prompts' token ids (``frontend/token_cache.py``): exact reuse positions, the kept entries,
eviction by bytes."""

from __future__ import annotations

import random
from array import array

import pytest

from thunderagent.frontend.token_cache import PrefixTokenCache, common_prefix


@pytest.mark.parametrize(("a", "b", "n"), [
    ("", "", 0), ("abc", "", 0), ("abc", "abc", 3), ("abc", "abd", 2), ("abcdef", "abc", 3), ("abc", "abcdef", 3),
    ("xbc", "abc", 0),
])
def test_common_prefix_small(a: str, b: str, n: int) -> None:
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_common_prefix_across_chunks_finds_the_first_difference() -> None:
    rng = random.Random(3)
    base = "".join(rng.choice("abcdefgh") for _ in range(300_000))
    for at in (0, 1, 65_535, 65_536, 65_537, 131_072, 200_001, 299_999):
        other = base[:at] + ("z" if base[at] != "z" else "y") + base[at + 1 :]
        assert common_prefix(base, other) == at, at
    assert common_prefix(base, base + "tail") == len(base)


def _entry(text: str, specials: str = "|") -> tuple[list[int], list[int], list[int]]:
    """A toy tokenization: one id per character (its code point); a cut after every ``|``."""
    ids = [ord(c) for c in text]
    cuts = [i + 1 for i, c in enumerate(text) if c in specials and i + 1 < len(text)]
    return ids, cuts, list(cuts)  # (one token a character: token positions equal character positions)


def test_a_longer_prompt_reuses_the_ids_up_to_the_last_cut_it_shares() -> None:
    cache = PrefixTokenCache(1 << 20, key_chars=4)
    first = "sys|user one|assistant|"
    ids, cc, ct = _entry(first)
    cache.store(first, ids, cc, ct)
    assert cc == [4, 13]  # (a cut at the very end has nothing after it: not kept)
    # the next turn: the whole previous prompt and more (the cut at 23, past the old text, is not known yet)
    reuse = cache.lookup(first + "reply|user two|")
    assert reuse is not None and (reuse.chars, list(reuse.ids)) == (13, ids[:13])
    assert (reuse.cut_chars, reuse.cut_tokens) == ([4, 13], [4, 13])
    # a prompt that parts from it inside the second message reuses up to the first cut only
    reuse = cache.lookup("sys|user ONE|x")
    assert reuse is not None and (reuse.chars, list(reuse.ids)) == (4, ids[:4])
    # one that parts before the first cut, or has another key, reuses nothing
    assert cache.lookup("sysX|user one|") is None
    assert cache.lookup("other|text|") is None
    assert (cache.lookups, cache.hits, cache.reused_tokens) == (4, 2, 17)


def test_the_same_prompt_again_reuses_all_of_it() -> None:
    cache = PrefixTokenCache(1 << 20, key_chars=4)
    text = "sys|user|assistant"
    ids, cc, ct = _entry(text)
    cache.store(text, ids, cc, ct)
    reuse = cache.lookup(text)
    assert reuse is not None and (reuse.chars, list(reuse.ids), reuse.cut_chars) == (len(text), ids, cc)


def test_a_conversation_keeps_one_entry_and_others_sharing_its_key_stay() -> None:
    cache = PrefixTokenCache(1 << 20, key_chars=4)
    turns = ["sys|a1|", "sys|a1|r1|a2|", "sys|a1|r1|a2|r2|a3|"]
    for t in turns:
        cache.store(t, *_entry(t))
    assert len(cache) == 1  # each turn held the previous one whole: replaced
    other = "sys|b1|"
    cache.store(other, *_entry(other))
    assert len(cache) == 2
    best = cache.lookup("sys|a1|r1|a2|r2|a3|r3|")  # the longer match of the two sharing the key, to its last cut
    assert best is not None and best.chars == 16  # (the "|" ending the kept text has nothing after it: no cut)
    # text + 4 bytes an id + 24 a cut (turns[-1] has cuts at 4, 7, 10, 13, 16; other at 4)
    assert cache.nbytes == sum(5 * len(t) for t in (turns[-1], other)) + 24 * (5 + 1)


def test_least_recent_prompts_leave_first_when_the_bytes_run_out() -> None:
    texts = [f"k{k}|" + "x" * 40 + "|end" for k in range(6)]
    size = 5 * len(texts[0]) + 2 * 24  # (a character and a 4-byte id each, 24 bytes for each of its two cuts)
    cache = PrefixTokenCache(size * 4, key_chars=2)
    for t in texts[:4]:
        cache.store(t, *_entry(t))
    assert cache.lookup(texts[0] + "more") is not None  # k0 used: now the most recent
    cache.store(texts[4], *_entry(texts[4]))  # over the budget: k1, the least recent, goes
    assert cache.lookup(texts[1] + "more") is None
    assert all(cache.lookup(t + "more") is not None for t in (texts[0], texts[2], texts[3], texts[4]))
    assert cache.nbytes == size * 4 and len(cache) == 4
    cache.store("k9|" + "y" * 2000, *_entry("k9|" + "y" * 2000))  # larger than the whole budget: not kept
    assert cache.nbytes == size * 4 and cache.lookup("k9|" + "y" * 2000 + "z") is None


def test_a_key_holds_at_most_max_per_key_prompts() -> None:
    cache = PrefixTokenCache(1 << 20, key_chars=4, max_per_key=2)
    for k in range(3):
        t = f"sys|p{k}|x"
        cache.store(t, *_entry(t))
    assert len(cache) == 2 and cache.lookup("sys|p0|x|y") is not None  # (p0 gone: reuse at its first cut only)
    assert cache.lookup("sys|p0|x|y").chars == 4  # type: ignore[union-attr]
    assert cache.lookup("sys|p2|x|y").chars == 7  # type: ignore[union-attr]


def test_a_cut_holds_only_for_a_prompt_that_shares_its_need() -> None:
    """A line cut (``HfTokenizer``'s) needs the character at the cut shared too: a newline followed by more whitespace
    is one piece with it, so a prompt that parts right at the cut reuses only up to the cut before."""
    cache = PrefixTokenCache(1 << 20, key_chars=2)
    text = "ab|line one\nline two\nline three"
    ids = [ord(c) for c in text]
    cuts = [3, 12, 21]  # after "|" (need 3), at "line two" and "line three" (need one character more)
    cache.store(text, ids, cuts, list(cuts), cut_needs=[3, 13, 22])
    reuse = cache.lookup(text + " and more")  # shares all: the last cut
    assert reuse is not None and (reuse.chars, reuse.cut_needs) == (21, [3, 13, 22])
    reuse = cache.lookup(text[:21] + "\n\nline three")  # parts at 21: cut 21 needs 22, so cut 12 is the last
    assert reuse is not None and (reuse.chars, list(reuse.ids), reuse.cut_chars) == (12, ids[:12], [3, 12])
    reuse = cache.lookup(text[:12] + " x")  # parts at 12: back to the added token's cut (need 3)
    assert reuse is not None and (reuse.chars, reuse.cut_needs) == (3, [3])
    assert cache.nbytes == 5 * len(text) + 3 * 24


def test_a_prompt_changed_near_its_end_and_grown_replaces_the_one_it_was_tokenized_from() -> None:
    """A message growing inside a template: each turn changes the previous prompt's closing ("|end") and grows; it
    replaces that prompt (no pile-up). A branch that parts far from a kept prompt's end (another rollout from the
    same prefix) is kept beside it, and so is anything a shorter prompt was tokenized from."""
    cache = PrefixTokenCache(1 << 20, key_chars=2, replace_tail=8)
    text = "ab|" + "line\n" * 10 + "|end"
    for n in range(11, 15):
        grown = "ab|" + "line\n" * n + "|end"
        reuse = cache.lookup(grown)
        cache.store(grown, *_entry(grown), reused=reuse)
        if reuse is not None:
            assert reuse.entry is not None and reuse.shared == len(text) - 4
        text = grown
    assert len(cache) == 1 and cache.nbytes == 5 * len(text) + 24 * 2  # (cuts after each "|")
    branch = "ab|" + "line\n" * 5 + "other|tail" * 3  # parts 49 characters before the kept one's end
    cache.store(branch, *_entry(branch), reused=cache.lookup(branch))
    assert len(cache) == 2
    short = "ab|" + "line\n" * 5 + "other|"  # (changed near the branch's end, but shorter: kept beside it)
    cache.store(short, *_entry(short), reused=cache.lookup(short))
    assert len(cache) == 3
    # rollouts of one task: each parts from the other near its end with a reply of its own: both kept
    task = "ab|" + "line\n" * 14 + "|"
    cache.store(task + "reply A", *_entry(task + "reply A"), reused=cache.lookup(task + "reply A"))
    n = len(cache)
    cache.store(task + "reply B!", *_entry(task + "reply B!"), reused=cache.lookup(task + "reply B!"))
    assert len(cache) == n + 1


def test_stored_ids_are_compact() -> None:
    cache = PrefixTokenCache(1 << 20, key_chars=4)
    cache.store("sys|abc", [5, 6, 7, 8, 9, 10, 11], [4], [4])
    reuse = cache.lookup("sys|abd")
    assert reuse is not None and isinstance(reuse.ids, array) and reuse.ids.typecode == "I"
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixTokenCache(0)


def test_a_prompt_is_matched_only_within_its_scope() -> None:
    """Scopes are cache salts (a tenant's): how fast a prompt tokenizes tells no tenant what another one sent."""
    cache = PrefixTokenCache(1 << 20, key_chars=4)
    text = "sys|user one|assistant|"
    cache.store(text, *_entry(text), scope="tenant:a")
    assert cache.lookup(text + "more|", scope="tenant:b") is None and cache.lookup(text + "more|") is None
    reuse = cache.lookup(text + "more|", scope="tenant:a")
    assert reuse is not None and reuse.chars == 13
    cache.store(text, *_entry(text), scope="tenant:b")  # the same text in another scope: an entry of its own
    assert len(cache) == 2
