"""Engine block hashes -> our chained block hashes, per worker.

Engine block hashes are opaque ids (vLLM: sha256 bytes or ints, salted per process; SGLang: its own
ints). We recompute *our* chained hashes (:mod:`thunderagent.kv.hashing`) from ``token_ids`` and keep,
per worker, a map engine hash -> our hash, used to find a block's parent and to translate removals.
A stored block whose parent we never saw (we joined late, or lost events) cannot be hashed: it is
skipped and counted as *unlinked*; its children are unlinked too.

Double-hash guard (``checks``, from ``routing.double_hash``): the translator also chains the check
hash (:func:`~thunderagent.kv.hashing.check_block`) over the same ``token_ids``, so the events and
snapshots it yields carry them and the index verifies these blocks like the router's own
predictions (``kv.check``).

Pure and synchronous; decoded events come from :mod:`thunderagent.execution.kv_frames`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from thunderagent.execution.kv_frames import (
    EngineBlockRemoved,
    EngineBlockStored,
    EngineHash,
    EventDecodeError,
    salt_of,
)
from thunderagent.kv.hashing import check_block, check_seed, hash_block, hash_seed

#: media whose blocks serve prefix hits for requests routed to the worker (vLLM "GPU", SGLang "GPU";
#: None = the engine did not say). CPU / storage tiers are not indexed.
_INDEXED_MEDIA = (None, "GPU")


@dataclass(slots=True)
class TranslatorStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    unlinked_blocks: int = 0  # parent never seen: cannot be hashed
    skipped_events: int = 0  # other media / KV groups, unsupported token payloads, unknown types


class BlockTranslator:
    """Per worker: engine block hashes -> our chained hashes.

    ``_ours`` maps every engine hash we could translate; ``_refs`` counts engine hashes per our
    hash, because two engine blocks can carry the same tokens under the same parent as we hash them
    (engine-side keys we do not model, such as multimodal ids): our block stays cached until the last
    one is removed.
    """

    __slots__ = ("_ours", "_checks", "_refs", "block_size", "mismatch", "stats")

    def __init__(self, block_size: int, checks: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self._ours: dict[EngineHash, int] = {}
        #: engine hash -> check hash of our block (guard on; None: off). Keyed like ``_ours``: two
        #: engine blocks under one of our hashes may hold different content (a primary collision).
        self._checks: dict[EngineHash, int] | None = {} if checks else None
        self._refs: dict[int, int] = {}
        self.stats = TranslatorStats()
        #: (engine block size, configured) once an event disagreed with the configured block size
        self.mismatch: tuple[int, int] | None = None

    def stored(self, ev: EngineBlockStored) -> tuple[list[int], int | None]:
        """Our hashes of the stored blocks (chain order) and their parent's; ``[]`` if none could be
        translated. Sets :attr:`mismatch` (and translates nothing) on a foreign block size."""
        if ev.medium not in _INDEXED_MEDIA or ev.group_idx not in (None, 0):
            self.stats.skipped_events += 1
            return [], None
        bs = self.block_size
        if ev.block_size != bs:
            self.mismatch = (ev.block_size, bs)
            return [], None
        n = len(ev.block_hashes)
        if len(ev.token_ids) != n * bs:
            raise EventDecodeError(
                f"BlockStored: {len(ev.token_ids)} token ids for {n} blocks of {bs} tokens"
            )
        if ev.token_ids and not isinstance(ev.token_ids[0], int):  # SGLang EAGLE bigram pages
            self.stats.skipped_events += 1
            return [], None
        checks = self._checks
        if ev.parent_block_hash is None:
            parent = hash_seed(salt_of(ev), ev.lora_name)
            our_parent = None
            check = check_seed(parent)
        else:
            got = self._ours.get(ev.parent_block_hash)
            if got is None:
                self.stats.unlinked_blocks += n
                return [], None
            parent = our_parent = got
            check = 0 if checks is None else checks[ev.parent_block_hash]
        out = []
        ours, refs = self._ours, self._refs
        tokens = ev.token_ids
        for i, eh in enumerate(ev.block_hashes):
            block = tokens[i * bs : (i + 1) * bs]
            h = hash_block(block, parent)
            if checks is not None:
                check = checks[eh] = check_block(block, check)
            old = ours.get(eh)
            if old != h:
                if old is not None:  # engine reused the id for other content: drop the old link
                    self._unref(old)
                ours[eh] = h
                refs[h] = refs.get(h, 0) + 1
            out.append(h)
            parent = h
        self.stats.stored_blocks += n
        return out, our_parent

    def removed(self, ev: EngineBlockRemoved) -> list[int]:
        """Our hashes no engine block maps to any more."""
        if ev.medium not in _INDEXED_MEDIA or ev.group_idx not in (None, 0):
            self.stats.skipped_events += 1
            return []
        out = []
        checks = self._checks
        for eh in ev.block_hashes:
            h = self._ours.pop(eh, None)
            if checks is not None:
                checks.pop(eh, None)
            if h is not None and self._unref(h):
                out.append(h)
        self.stats.removed_blocks += len(out)
        return out

    def _unref(self, h: int) -> bool:
        n = self._refs[h] - 1
        if n:
            self._refs[h] = n
            return False
        del self._refs[h]
        return True

    def clear(self) -> None:
        self._ours.clear()
        self._refs.clear()
        if self._checks is not None:
            self._checks.clear()

    def cached(self) -> list[int]:
        """Our hashes of every block we believe cached."""
        return list(self._refs)

    def checks_of(self, engine_hashes: Sequence[EngineHash]) -> list[int] | None:
        """Check hashes of blocks :meth:`stored` just translated (None: the guard is off)."""
        checks = self._checks
        return None if checks is None else [checks[eh] for eh in engine_hashes]

    def cached_pairs(self) -> tuple[list[int], list[int] | None]:
        """:meth:`cached` and their check hashes (None: guard off). A hash that holds two contents
        (a primary collision) is listed once per content: the index then trusts neither."""
        checks = self._checks
        if checks is None:
            return self.cached(), None
        pairs = {(h, checks[eh]) for eh, h in self._ours.items()}
        return [h for h, _ in pairs], [c for _, c in pairs]

    def leading_cached(self, block_hashes: Sequence[int]) -> int:
        refs = self._refs
        n = 0
        for h in block_hashes:
            if h not in refs:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._refs)
