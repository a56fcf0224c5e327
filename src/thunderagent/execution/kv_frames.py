"""The wire format of real engines' KV-event streams (vLLM, SGLang): frames in, decoded engine events out.

Pure and synchronous; the sockets live in :mod:`thunderagent.execution.kv_pump`, the translation to our
hashes in :mod:`thunderagent.execution.kv_translate`, the sequence logic in
:mod:`thunderagent.execution.kv_stream`.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

EngineHash = int | bytes

#: the replay stream's end marker (``seq`` = -1, signed)
END_SEQ = -1


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
