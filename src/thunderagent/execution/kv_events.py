"""Real engines' KV-event streams (vLLM, SGLang) turned into our :mod:`KV events <thunderagent.types>`.

Pure and synchronous: frames in, events out; the sockets live in the adapters (``engine.vllm``).

Wire format (vLLM ``distributed/kv_events.py``; SGLang ``disaggregation/kv_events.py`` is the same)
-------------------------------------------------------------------------------------------------
A ZMQ PUB message is three frames ``[topic, seq, payload]``: ``seq`` is an 8-byte big-endian batch
number counting from 0 per publisher, ``payload`` a msgpack array ``[ts, events, rank]`` (``rank`` is
vLLM's ``data_parallel_rank``, SGLang's ``attn_dp_rank``; it may be missing). An event is either a
tagged **map** ``{"type": "BlockStored", "block_hashes": [...], ...}`` (current releases) or a
positional **array** with the tag first (older releases):

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``
  (the oldest form has ``num_toks_per_block: list[int]`` in place of ``block_size``; trailing fields
  may be absent);
- ``["BlockRemoved", block_hashes, medium]``;
- ``["AllBlocksCleared"]``.

Replay: a DEALER socket sends ``[b"", start_seq]`` to the engine's ROUTER endpoint and receives
``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq``, then the marker
``[b"", b"", seq=-1, b""]``. A buffer that no longer holds ``start_seq`` simply starts later.

Hashes
------
Engine block hashes are opaque ids (vLLM: sha256 bytes or ints, salted per process; SGLang: its own
ints). We recompute *our* chained hashes (:mod:`thunderagent.kv.hashing`) from ``token_ids`` and keep,
per worker, a map engine hash -> our hash, used to find a block's parent and to translate removals.
A stored block whose parent we never saw (we joined late, or lost events) cannot be hashed: it is
skipped and counted as *unlinked*; its children are unlinked too.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from thunderagent.kv.hashing import hash_block, hash_seed
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

log = logging.getLogger(__name__)

EngineHash = int | bytes

#: the replay stream's end marker (``seq`` = -1, signed)
END_SEQ = -1
#: media whose blocks serve prefix hits for requests routed to the worker (vLLM "GPU", SGLang "GPU";
#: None = the engine did not say). CPU / storage tiers are not indexed.
_INDEXED_MEDIA = (None, "GPU")


class EventDecodeError(ValueError):
    """A frame or payload that is not a KV-event batch of a known shape."""


# ---------------------------------------------------------------------------------------------
# Decoded engine events (engine hashes, before translation)
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class EngineBlockStored:
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[object] | None = None  # one entry per block (vLLM); carries the cache salt
    group_idx: int | None = None


@dataclass(slots=True, frozen=True)
class EngineBlockRemoved:
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True, frozen=True)
class EngineAllCleared:
    pass


@dataclass(slots=True, frozen=True)
class EngineUnknown:
    """An event type we do not know (engines add kinds over time): skipped, counted, warned once."""

    tag: object


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllCleared | EngineUnknown


@dataclass(slots=True, frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: list[EngineEvent]
    rank: int | None = None


_decoder = msgspec.msgpack.Decoder()


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_frames(frames: Sequence[bytes]) -> EventBatch:
    """A PUB message ``[topic, seq, payload]`` (or a replay reply with its empty delimiter first).
    The replay end marker decodes to a batch with ``seq == END_SEQ`` and no events."""
    if len(frames) == 4 and frames[0] == b"":  # DEALER reply: [b"", topic, seq, payload]
        frames = frames[1:]
    if len(frames) != 3:
        raise EventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    seq = decode_seq(frames[1])
    if seq == END_SEQ:
        return EventBatch(END_SEQ, 0.0, [])
    return decode_payload(seq, frames[2])


def decode_payload(seq: int, payload: bytes) -> EventBatch:
    try:
        obj = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"batch {seq}: payload is not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise EventDecodeError(f"batch {seq}: payload must be [ts, events, rank], got {type(obj).__name__}")
    rank = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    return EventBatch(seq, float(obj[0]), [decode_event(e) for e in obj[1]], rank)


def _opt(seq: list[object], i: int) -> object:
    return seq[i] if len(seq) > i else None


def decode_event(raw: object) -> EngineEvent:
    """One event, map or array form. Unknown event types decode to :class:`EngineUnknown`: engines
    add event kinds over time and an old router must not stop indexing because of one."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        get = raw.get
        if tag == "BlockStored":
            return EngineBlockStored(
                _hashes(get("block_hashes")), get("parent_block_hash"), _tokens(get("token_ids")),
                _int(get("block_size"), "block_size"), get("lora_name"), get("medium"), get("extra_keys"),
                get("group_idx"),
            )
        if tag == "BlockRemoved":
            return EngineBlockRemoved(_hashes(get("block_hashes")), get("medium"), get("group_idx"))
        if tag == "AllBlocksCleared":
            return EngineAllCleared()
        return EngineUnknown(tag)
    if isinstance(raw, list) and raw:
        tag = raw[0]
        if tag == "BlockStored":
            if len(raw) < 5:
                raise EventDecodeError(f"positional BlockStored needs >= 5 fields, got {len(raw)}")
            tokens = _tokens(raw[3])
            size = raw[4]
            if isinstance(size, list):  # oldest form: num_toks_per_block
                sizes = {int(s) for s in size}
                if len(sizes) != 1:
                    raise EventDecodeError(f"BlockStored with unequal block sizes {sorted(sizes)}")
                size = sizes.pop()
            lora_name = _opt(raw, 7)
            return EngineBlockStored(
                _hashes(raw[1]), raw[2], tokens, _int(size, "block_size"),
                lora_name if isinstance(lora_name, str) else None, _opt(raw, 6),  # type: ignore[arg-type]
            )
        if tag == "BlockRemoved":
            return EngineBlockRemoved(_hashes(_opt(raw, 1)), _opt(raw, 2))  # type: ignore[arg-type]
        if tag == "AllBlocksCleared":
            return EngineAllCleared()
        return EngineUnknown(tag)
    raise EventDecodeError(f"event must be a tagged map or array, got {type(raw).__name__}")


def _hashes(v: object) -> list[EngineHash]:
    if not isinstance(v, list) or not all(isinstance(h, (int, bytes)) for h in v):
        raise EventDecodeError(f"block_hashes must be a list of ints or bytes, got {v!r:.80}")
    return v


def _tokens(v: object) -> list[int]:
    if not isinstance(v, list):
        raise EventDecodeError(f"token_ids must be a list, got {type(v).__name__}")
    return v  # element types are checked where used (SGLang's EAGLE mode sends bigram pairs)


def _int(v: object, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise EventDecodeError(f"{name} must be an int, got {v!r}")
    return v


# ---------------------------------------------------------------------------------------------
# Engine hash -> our hash
# ---------------------------------------------------------------------------------------------
def salt_of(ev: EngineBlockStored) -> str | None:
    """The cache salt of a chain's first block, from vLLM's ``extra_keys[0]``: its entries are, in
    order, the LoRA name (when ``lora_name`` is set), ``(mm_id, offset)`` pairs, the salt string and
    prompt-embedding digests. None when the engine sent no extra keys (SGLang; unsalted requests)."""
    if not ev.extra_keys:
        return None
    first = ev.extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    items = list(first)
    if ev.lora_name is not None and items and items[0] == ev.lora_name:
        items = items[1:]
    for item in items:
        if isinstance(item, str):
            return item
    return None


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

    __slots__ = ("_ours", "_refs", "block_size", "mismatch", "stats")

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self._ours: dict[EngineHash, int] = {}
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
        if ev.parent_block_hash is None:
            parent = hash_seed(salt_of(ev), ev.lora_name)
            our_parent = None
        else:
            got = self._ours.get(ev.parent_block_hash)
            if got is None:
                self.stats.unlinked_blocks += n
                return [], None
            parent = our_parent = got
        out = []
        ours, refs = self._ours, self._refs
        tokens = ev.token_ids
        for i, eh in enumerate(ev.block_hashes):
            h = hash_block(tokens[i * bs : (i + 1) * bs], parent)
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
        for eh in ev.block_hashes:
            h = self._ours.pop(eh, None)
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

    def cached(self) -> list[int]:
        """Our hashes of every block we believe cached."""
        return list(self._refs)

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


# ---------------------------------------------------------------------------------------------
# Sequence tracking: gaps, duplicates, replay, restarts
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class StreamStep:
    """What the adapter must do after feeding a batch: publish ``events`` (in order) and, when
    ``replay_from`` is set, ask the engine's replay socket for batches from that seq on."""

    events: list[KvEvent] = field(default_factory=list)
    replay_from: int | None = None


@dataclass(slots=True)
class StreamStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    resyncs: int = 0
    restarts: int = 0
    decode_errors: int = 0


class KvEventStream:
    """One engine publisher's stream, as seen by one worker handle.

    Live batches arrive on the SUB socket with strictly increasing ``seq``; the next expected one is
    :attr:`next_seq` (0 at start: batches published before we subscribed are a gap too, which
    replay fills when the engine still buffers them).

    - ``seq == next_seq``: applied.
    - ``seq > next_seq`` (a gap): with a replay endpoint, live batches are held back (at most
      ``max_pending``) and the caller is asked to replay from ``next_seq``; replayed batches are
      applied in order, duplicates skipped, then the held-back ones. If the replay cannot cover the
      gap (buffer moved on, timeout, no endpoint), the worker is **resynced**: its blocks are
      dropped (an ``AllBlocksCleared`` of ours) and rebuilt from the events that follow.
    - ``seq < next_seq`` from replay or the held-back queue: a duplicate, skipped.
    - a live ``seq`` not above the previous live one: the engine **restarted** (its counter went
      back); its cache is empty, so ours is cleared and counting starts again from 0.

    Our events carry our own contiguous ``seq`` (the index never sees an engine gap: gaps are
    resolved here).
    """

    def __init__(self, worker_id: str, block_size: int, *, can_replay: bool, max_pending: int = 10_000) -> None:
        self.worker_id = worker_id
        self.translator = BlockTranslator(block_size)
        self.can_replay = can_replay
        self.max_pending = max_pending
        self.next_seq = 0
        self.replaying = False
        self.stats = StreamStats()
        self._last_live = -1
        self._pending: deque[EventBatch] = deque()
        self._our_seq = -1
        self._unknown_tags: set[object] = set()

    # -- inputs ------------------------------------------------------------------------------
    def on_live(self, frames: Sequence[bytes]) -> StreamStep:
        try:
            batch = decode_frames(frames)
        except EventDecodeError as exc:
            return self._decode_error(exc)
        return self.on_live_batch(batch)

    def on_live_batch(self, batch: EventBatch) -> StreamStep:
        step = StreamStep()
        if batch.seq <= self._last_live:
            self.stats.restarts += 1
            log.warning("%s: KV event seq went back from %d to %d: engine restarted, its cache is empty",
                        self.worker_id, self._last_live, batch.seq)
            self._clear(step)
            self.next_seq = 0
            self.replaying = False
            self._pending.clear()
        self._last_live = batch.seq
        if self.replaying:
            self._pending.append(batch)
            if len(self._pending) > self.max_pending:
                log.warning("%s: replay did not answer within %d batches: resyncing", self.worker_id,
                            self.max_pending)
                return self.replay_failed()
            return step
        if batch.seq > self.next_seq and self.can_replay:
            self.stats.gaps += 1
            self.stats.replays += 1
            log.info("%s: KV events %d..%d missed: replaying", self.worker_id, self.next_seq, batch.seq - 1)
            self.replaying = True
            self._pending.append(batch)
            step.replay_from = self.next_seq
            return step
        self._advance(batch, step)
        return step

    def on_replay(self, frames: Sequence[bytes]) -> StreamStep:
        """A reply from the replay socket (``[b"", topic, seq, payload]``)."""
        try:
            batch = decode_frames(frames)
        except EventDecodeError as exc:
            return self._decode_error(exc)
        return self.on_replay_batch(batch)

    def on_replay_batch(self, batch: EventBatch) -> StreamStep:
        step = StreamStep()
        if not self.replaying:  # a late answer to a replay we gave up on
            return step
        if batch.seq == END_SEQ:
            self._finish_replay(step)
        else:
            self._advance(batch, step)
        return step

    def replay_failed(self) -> StreamStep:
        """The replay socket did not answer in time (or is gone): continue from what we hold."""
        step = StreamStep()
        if self.replaying:
            self._finish_replay(step)
        return step

    def engine_restarted(self) -> StreamStep:
        """The engine is a new process (seen by the adapter, e.g. a new start time in its metrics):
        its cache is empty and its seq starts again from 0. Also lifts a block-size refusal, since
        the new process may run with another block size."""
        self.stats.restarts += 1
        step = StreamStep()
        self.translator.mismatch = None
        self._clear(step)
        self.next_seq = 0
        self._last_live = -1
        self.replaying = False
        self._pending.clear()
        return step

    def leading_cached(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a request the engine holds, as far as its events told us."""
        return self.translator.leading_cached(block_hashes)

    # -- state ---------------------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        """Seq of the last event of ours handed out (-1: none yet)."""
        return self._our_seq

    def snapshot(self) -> tuple[list[int], int]:
        return self.translator.cached(), self._our_seq

    @property
    def mismatch(self) -> tuple[int, int] | None:
        return self.translator.mismatch

    # -- internals -----------------------------------------------------------------------------
    def _finish_replay(self, step: StreamStep) -> None:
        self.replaying = False
        pending, self._pending = self._pending, deque()
        for b in pending:
            self._advance(b, step)

    def _advance(self, batch: EventBatch, step: StreamStep) -> None:
        """Apply ``batch`` unless it is a duplicate; a gap that replay did not fill resyncs."""
        if batch.seq < self.next_seq:
            self.stats.duplicates += 1
            return
        if batch.seq > self.next_seq:
            if self.next_seq == 0 and self._our_seq == -1 and not self.can_replay:
                log.info("%s: joined the KV event stream at seq %d", self.worker_id, batch.seq)
            else:
                self.stats.gaps += 1
                self.stats.resyncs += 1
                log.warning("%s: KV events %d..%d lost (no replay): resyncing, its index entries are rebuilt "
                            "from new events", self.worker_id, self.next_seq, batch.seq - 1)
                self._clear(step)
        self.next_seq = batch.seq + 1
        self.stats.batches += 1
        if self.translator.mismatch is not None:
            return
        for ev in batch.events:
            self._translate(ev, step.events)
            if self.translator.mismatch is not None:
                log.error(
                    "%s: engine KV block size %d differs from the configured block_size %d: not routing to "
                    "it (set execution_group.nodes[].block_size to %d, or start the engine with "
                    "--block-size %d)", self.worker_id, *self.translator.mismatch,
                    self.translator.mismatch[0], self.translator.mismatch[1],
                )
                self._clear(step)
                return

    def _translate(self, ev: EngineEvent, out: list[KvEvent]) -> None:
        wid = self.worker_id
        if isinstance(ev, EngineBlockStored):
            try:
                ours, parent = self.translator.stored(ev)
            except EventDecodeError as exc:
                self.stats.decode_errors += 1
                log.warning("%s: bad BlockStored skipped: %s", wid, exc)
                return
            if ours:
                self._our_seq += 1
                out.append(BlockStored(wid, self._our_seq, tuple(ours), parent))
        elif isinstance(ev, EngineBlockRemoved):
            gone = self.translator.removed(ev)
            if gone:
                self._our_seq += 1
                out.append(BlockRemoved(wid, self._our_seq, tuple(gone)))
        elif isinstance(ev, EngineAllCleared):
            self._clear_into(out)
        else:
            self.translator.stats.skipped_events += 1
            if ev.tag not in self._unknown_tags:  # once: a newer engine may send it in every batch
                self._unknown_tags.add(ev.tag)
                log.warning("%s: unknown KV event type %r skipped", wid, ev.tag)

    def _clear(self, step: StreamStep) -> None:
        self._clear_into(step.events)

    def _clear_into(self, out: list[KvEvent]) -> None:
        self.translator.clear()
        self._our_seq += 1
        out.append(AllBlocksCleared(self.worker_id, self._our_seq))

    def _decode_error(self, exc: EventDecodeError) -> StreamStep:
        # A batch we cannot read is a batch lost: the next good one shows up as a gap.
        self.stats.decode_errors += 1
        log.warning("%s: undecodable KV event batch skipped: %s", self.worker_id, exc)
        return StreamStep()


def encode_batch(seq: int, events: Iterable[object], ts: float = 0.0, rank: int | None = 0,
                 topic: bytes = b"kv-events") -> list[bytes]:
    """Frames of one batch as an engine publishes them (tests and tools build streams with it)."""
    payload = msgspec.msgpack.encode([ts, list(events), rank])
    return [topic, seq.to_bytes(8, "big", signed=True), payload]
