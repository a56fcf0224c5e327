"""The bus wire's KV-index messages: KV event batches and cache dumps (``bus.wire`` has the subjects,
the version and the other messages, and re-exports these). Pure.

Double-hash guard (``kv.check``): a stored event and a dump carry the blocks' check hashes (packed
u64, the same order as the hashes) when the worker's source computed them; ``None`` otherwise, and
the frontend's index then holds those entries unverified.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from thunderagent.bus.packing import pack_u64, unpack_u64
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

#: hashes per DumpChunk: 32 Ki hashes = 256 KiB, 512 KiB with their check hashes: under NATS's
#: default 1 MiB max_payload
DUMP_CHUNK_HASHES = 32768


# ---------------------------------------------------------------------------------------------
# KV events
# ---------------------------------------------------------------------------------------------
class WireStored(msgspec.Struct, array_like=True, frozen=True, tag=0):
    seq: int
    hashes: bytes  # packed u64
    parent: int | None = None
    checks: bytes | None = None  # packed u64: the double-hash guard's, same order as ``hashes``


class WireRemoved(msgspec.Struct, array_like=True, frozen=True, tag=1):
    seq: int
    hashes: bytes


class WireCleared(msgspec.Struct, array_like=True, frozen=True, tag=2):
    seq: int


WireEvent = WireStored | WireRemoved | WireCleared


class KvBatch(msgspec.Struct, array_like=True, frozen=True):
    instance: str
    events: list[WireEvent]


def events_to_wire(events: Sequence[KvEvent]) -> list[WireEvent]:
    out: list[WireEvent] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            checks = None if ev.check_hashes is None else pack_u64(ev.check_hashes)
            out.append(WireStored(ev.seq, pack_u64(ev.block_hashes), ev.parent_hash, checks))
        elif isinstance(ev, BlockRemoved):
            out.append(WireRemoved(ev.seq, pack_u64(ev.block_hashes)))
        elif isinstance(ev, AllBlocksCleared):
            out.append(WireCleared(ev.seq))
        else:  # pragma: no cover - caller bug
            raise TypeError(f"not a KV event: {ev!r}")
    return out


def events_from_wire(worker_id: str, events: Sequence[WireEvent]) -> list[KvEvent]:
    """Raises ValueError on a stored event whose check hashes do not match its hashes in number."""
    out: list[KvEvent] = []
    for ev in events:
        if isinstance(ev, WireStored):
            hashes = tuple(unpack_u64(ev.hashes))
            checks = None if ev.checks is None else tuple(unpack_u64(ev.checks))
            if checks is not None and len(checks) != len(hashes):
                raise ValueError(f"stored event {ev.seq}: {len(hashes)} hashes but {len(checks)} check hashes")
            out.append(BlockStored(worker_id, ev.seq, hashes, ev.parent, checks))
        elif isinstance(ev, WireRemoved):
            out.append(BlockRemoved(worker_id, ev.seq, tuple(unpack_u64(ev.hashes))))
        else:
            out.append(AllBlocksCleared(worker_id, ev.seq))
    return out


# ---------------------------------------------------------------------------------------------
# cache dumps
# ---------------------------------------------------------------------------------------------
class DumpChunk(msgspec.Struct, array_like=True, frozen=True):
    """Part ``part`` of a worker's cache dump; the last one has ``final``. ``available`` False: the
    worker cannot dump its cache (the frontend then relies on events alone)."""

    instance: str
    last_seq: int
    available: bool
    part: int
    final: bool
    hashes: bytes  # packed u64
    checks: bytes | None = None  # packed u64: the double-hash guard's, same order as ``hashes``


def dump_chunks(instance: str, hashes: Sequence[int] | None, last_seq: int,
                checks: Sequence[int] | None = None, chunk: int = DUMP_CHUNK_HASHES) -> list[DumpChunk]:
    """Split a snapshot (and its check hashes, if any) into chunks (always at least one)."""
    if hashes is None:
        return [DumpChunk(instance, last_seq, False, 0, True, b"")]
    if checks is not None and len(checks) != len(hashes):
        raise ValueError(f"{len(hashes)} hashes but {len(checks)} check hashes")
    n = max(1, -(-len(hashes) // chunk))
    return [
        DumpChunk(instance, last_seq, True, i, i == n - 1, pack_u64(hashes[i * chunk:(i + 1) * chunk]),
                  None if checks is None else pack_u64(checks[i * chunk:(i + 1) * chunk]))
        for i in range(n)
    ]


class Dump(msgspec.Struct, frozen=True):
    instance: str
    last_seq: int
    hashes: list[int] | None  # None: not available
    checks: list[int] | None = None  # None: the worker sent none (its entries are unverified)


def join_dump(chunks: Sequence[DumpChunk]) -> Dump:
    """Reassemble chunks (any arrival order). Raises ValueError if parts are missing or mixed."""
    if not chunks:
        raise ValueError("empty dump")
    ordered = sorted(chunks, key=lambda c: c.part)
    first = ordered[0]
    if [c.part for c in ordered] != list(range(len(ordered))) or not ordered[-1].final:
        raise ValueError(f"dump parts incomplete: {[c.part for c in ordered]}")
    if any(c.instance != first.instance or c.last_seq != first.last_seq for c in ordered):
        raise ValueError("dump chunks from different snapshots")
    if not first.available:
        return Dump(first.instance, first.last_seq, None)
    hashes: list[int] = []
    checks: list[int] | None = [] if all(c.checks is not None for c in ordered) else None
    for c in ordered:
        hashes.extend(unpack_u64(c.hashes))
        if checks is not None:
            checks.extend(unpack_u64(c.checks))  # type: ignore[arg-type]  # all set, checked above
    if checks is not None and len(checks) != len(hashes):
        raise ValueError(f"dump of {len(hashes)} hashes carries {len(checks)} check hashes")
    return Dump(first.instance, first.last_seq, hashes, checks)


decode_kv = msgspec.msgpack.Decoder(KvBatch).decode
decode_dump_chunk = msgspec.msgpack.Decoder(DumpChunk).decode
