"""Deterministic text for the simulated engine.

The frontend's tokenizer is byte level (ids 0..255 are bytes, 256 is EOS), so a text source only has
to hand out bytes. Output is a function of ``(seed, index)`` alone: the same prompt always yields the
same completion, on any worker, in any run, and a token can be produced without keeping per-request
state (the engine re-derives the tokens of a block when it hashes it).
"""

from __future__ import annotations

from typing import Protocol

_CORPUS = (
    "The river runs slowly past the old mill, and in the evening the light falls low across the "
    "water. People walk along the bank after work, talking about the weather, the price of bread, "
    "and the small news of the town. Nobody is in a hurry. A dog follows a child to the bridge and "
    "waits there while she throws stones into the current.\n"
    "In the library the shelves are arranged by subject, and each subject by the name of its author. "
    "A student copies a table of numbers into a notebook, checks the sums twice, and then closes the "
    "book. Outside, a bus stops at the corner, opens its doors, and leaves again without anyone "
    "getting on or off.\n"
    "A good plan starts with a clear question. First we write down what we know, then what we need "
    "to find out, and finally the steps that lead from one to the other. Each step should be small "
    "enough to check on its own. When a step fails, we go back, read the notes again, and try a "
    "different path.\n"
    "The market opens early on Saturday. Farmers bring apples, carrots, honey and fresh eggs, and "
    "the baker sells warm loaves from a wooden cart. By noon most of the stalls are empty, the "
    "square is swept, and the pigeons return to look for crumbs between the stones.\n"
    "Good tools are simple to hold and easy to repair. A well made table can last for a hundred "
    "years if it is kept dry and used with care. The same is true of many things: a house, a garden, "
    "a friendship, or a habit of reading a few pages every night before sleep.\n"
)


class TextSource(Protocol):
    def token(self, seed: int, index: int) -> int:
        """Token ``index`` (0-based) of the completion for ``seed``."""
        ...

    def natural_length(self, seed: int) -> int:
        """Tokens the completion has before the model would emit EOS."""
        ...


class CorpusText:
    """Walks a built-in English corpus (ASCII), starting at a word boundary chosen by the seed.

    Natural length is ``16 + seed % 240`` tokens.
    """

    __slots__ = ("_data", "_n", "_starts")

    def __init__(self, corpus: str = _CORPUS) -> None:
        data = corpus.encode("ascii")
        if not data:
            raise ValueError("corpus must not be empty")
        self._data = data
        self._n = len(data)
        # Start offsets at word starts so every completion begins with a whole word.
        starts = [0] + [i + 1 for i in range(self._n - 1) if data[i] in b" \n" and data[i + 1] not in b" \n"]
        self._starts = starts

    def start(self, seed: int) -> int:
        return self._starts[seed % len(self._starts)]

    def token(self, seed: int, index: int) -> int:
        return self._data[(self._starts[seed % len(self._starts)] + index) % self._n]

    def tokens(self, seed: int, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop-1`` at once (the engine uses this, when present, to hash a block)."""
        n = self._n
        off = (self._starts[seed % len(self._starts)] + start) % n
        count = stop - start
        if off + count <= n:
            return list(self._data[off : off + count])
        return [self._data[(off + i) % n] for i in range(count)]

    def natural_length(self, seed: int) -> int:
        return 16 + seed % 240

    def text(self, seed: int, count: int) -> str:
        """The first ``count`` tokens for ``seed`` as a string (tests, debugging)."""
        return bytes(self.token(seed, i) for i in range(count)).decode("ascii")
