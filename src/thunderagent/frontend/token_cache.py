"""Token ids of recent long prompts, so that a prompt extending one is tokenized from where they part.

An agent's conversation grows turn by turn: the prompt of turn k+1 is the prompt of turn k plus the reply and the
tool's result, and every turn the frontend renders and tokenizes all of it again to hash it for routing. With a
model's tokenizer that is the frontend's largest cost on agentic traffic (about 140 ms of CPU for a 100k-token
prompt here, against 0.2 ms to render the template and 1.5 ms to hash the blocks: ``bench/tokenize_prefix.py``).

A tokenizer splits its added (special) tokens out of the text before anything else and tokenizes the pieces
between them on their own, so the ids of a text up to a special token do not depend on what follows it. This cache
keeps, for each recent prompt, its text, its ids and the *cuts*: the character and token positions where a token
starts whose ids before it cannot change with what follows. Each cut comes with how many characters a new prompt
must share with the kept one for it to hold (its *need*): a token following a special token needs the text up to
it; a line's first token (``HfTokenizer``'s line cuts, after a newline, on a character that is not whitespace) also
needs that character, since a newline followed by more whitespace would be one piece with it. A new prompt that
shares a prefix with a kept one reuses the ids up to the last cut whose need lies inside the shared prefix, and
only the rest is tokenized (``HfTokenizer``). Whether a given tokenizer really splits so (some prepend a space to
the text's first piece, so a piece tokenized alone differs) is checked by the tokenizer before it uses the cache,
not here.

Pure and synchronous; bounded by the bytes it holds (text + 4 bytes per id), least recently used first out. A
prompt found to contain the whole of a kept one replaces it, so a conversation holds one entry, its latest turn; so
does a prompt tokenized from a kept one that it grew inside, within that one's last ``replace_tail`` characters and
before the same ending (a message growing inside a chat template: the template's closing lines come after it, so
the next turn is no extension of the last; kept side by side, such turns would pile up in one group and each lookup
would compare them all). Prompts that part near the end with other endings (rollouts of one task, each with its own
reply) are kept side by side.
Prompts are grouped by their first ``key_chars`` characters (agents of one product share a system prompt: a
group holds all of their conversations, and a lookup compares the prompt with each, which costs at most their
shared length each: the comparison stops where they differ), within a *scope*: the request's cache salt (its
tenant's, with API keys on). A prompt is never matched with another scope's, so that how fast a prompt is tokenized
tells no tenant what another one sent (the same reason the KV blocks' hashes are salted per tenant).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

#: compared per step when two prompts are matched (then halved down to the first differing character)
_CHUNK = 1 << 16


@dataclass(slots=True)
class _Entry:
    text: str
    ids: array  # uint32: 4 bytes a token, not a Python int object each (a 100k-token prompt: 400 kB, not 3.6 MB)
    cut_chars: list[int]  # increasing: where a token starts whose ids before it are final, in ``text``
    cut_tokens: list[int]  # that token's index in ``ids``
    cut_needs: list[int]  # the characters a new prompt must share for the cut to hold (non-decreasing)

    @property
    def nbytes(self) -> int:
        return len(self.text) + 4 * len(self.ids) + 24 * len(self.cut_chars)  # (a list slot + a small int, ~3x)


def common_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (C-speed comparisons: a whole-prefix check, then 64 k
    characters at a time, then halving inside the chunk that differs)."""
    n = min(len(a), len(b))
    if a.startswith(b[:n] if n < len(b) else b):
        return n
    lo = 0
    while lo < n:
        hi = min(n, lo + _CHUNK)
        if not a.startswith(b[lo:hi], lo):
            break
        lo = hi
    else:
        return n
    # a[:lo] == b[:lo] and a[lo:hi] != b[lo:hi]: the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True, frozen=True)
class Reuse:
    """What a lookup found: the ids of ``text[:chars]`` and the cuts inside it."""

    ids: array
    chars: int
    cut_chars: list[int]
    cut_tokens: list[int]
    cut_needs: list[int]
    entry: _Entry | None = None  # the kept prompt it came from, and how many characters the two share
    shared: int = 0


class PrefixTokenCache:
    def __init__(self, max_bytes: int, key_chars: int = 256, max_per_key: int = 256,
                 replace_tail: int = 1024) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self.replace_tail = replace_tail
        self.key_chars = key_chars
        self.max_per_key = max_per_key
        self._groups: OrderedDict[tuple[str | None, str], list[_Entry]] = OrderedDict()  # most recent entry first
        self.nbytes = 0
        self.lookups = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def lookup(self, text: str, scope: str | None = None) -> Reuse | None:
        """The longest reusable prefix of ``text`` among the prompts kept in ``scope`` (ending at a cut whose need
        ``text`` shares), or None."""
        self.lookups += 1
        key = (scope, text[: self.key_chars])
        group = self._groups.get(key)
        if not group:
            return None
        best, best_len = None, 0
        for e in group:
            n = common_prefix(text, e.text)
            if n > best_len:
                best, best_len = e, n
        if best is None:
            return None
        self._groups.move_to_end(key)
        if best_len == len(text) == len(best.text):  # the same prompt again (a retry, a repeated rendering)
            self.hits += 1
            self.reused_tokens += len(best.ids)
            return Reuse(best.ids, best_len, best.cut_chars, best.cut_tokens, best.cut_needs, best, best_len)
        k = bisect_right(best.cut_needs, best_len) - 1  # a cut reuses text[:c] when its need is within the shared part
        if k < 0:
            return None
        self.hits += 1
        self.reused_tokens += best.cut_tokens[k]
        return Reuse(best.ids[: best.cut_tokens[k]], best.cut_chars[k], best.cut_chars[: k + 1],
                     best.cut_tokens[: k + 1], best.cut_needs[: k + 1], best, best_len)

    def store(self, text: str, ids: Sequence[int] | array, cut_chars: list[int], cut_tokens: list[int],
              scope: str | None = None, cut_needs: list[int] | None = None, reused: Reuse | None = None) -> None:
        """Keep ``text`` with its ``ids`` and cuts (increasing; ``cut_needs`` their needs, by default each cut's own
        position) in ``scope``, dropping the kept prompts it extends and the one it was tokenized from (``reused``,
        its lookup) when it grew inside that one's last ``replace_tail`` characters, before the same ending."""
        key = (scope, text[: self.key_chars])
        entry = _Entry(text, ids if isinstance(ids, array) else array("I", ids), cut_chars, cut_tokens,
                       list(cut_chars) if cut_needs is None else cut_needs)
        if entry.nbytes > self.max_bytes:
            return
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = []
        else:
            self._groups.move_to_end(key)
            kept = []
            old = None if reused is None else reused.entry  # (grown inside, before the same ending: replaced)
            if old is not None and (len(old.text) - reused.shared > self.replace_tail  # type: ignore[union-attr]
                                    or len(text) < len(old.text) or not text.endswith(old.text[reused.shared :])):
                old = None
            for e in group:
                if e is old or text.startswith(e.text):  # (a conversation's previous turn: this one holds it all)
                    self.nbytes -= e.nbytes
                else:
                    kept.append(e)
            group[:] = kept
        group.insert(0, entry)
        self.nbytes += entry.nbytes
        while len(group) > self.max_per_key:
            self.nbytes -= group.pop().nbytes
        while self.nbytes > self.max_bytes:
            oldest_key, oldest = next(iter(self._groups.items()))
            self.nbytes -= oldest.pop().nbytes  # (the group's least recent entry, of the least recent group)
            if not oldest:
                del self._groups[oldest_key]
