"""Packed little-endian integer lists for the bus wire (``bus.wire``, ``bus.wire_kv``): 8 bytes per
block hash (a msgpack uint64 costs 9) and 4 per token, decoded with one ``array.frombytes`` instead
of a Python loop. Pure."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_BIG_ENDIAN = sys.byteorder == "big"


def pack_u64(values: Sequence[int]) -> bytes:
    a = array("Q", values)
    if _BIG_ENDIAN:  # pragma: no cover - the wire is little-endian
        a.byteswap()
    return a.tobytes()


def unpack_u64(data: bytes) -> list[int]:
    if len(data) % 8:
        raise ValueError(f"packed uint64 list has {len(data)} bytes, not a multiple of 8")
    a = array("Q")
    a.frombytes(data)
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a.tolist()


def pack_u32(values: Sequence[int]) -> bytes:
    a = array("I", values)
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def unpack_u32(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"packed uint32 list has {len(data)} bytes, not a multiple of 4")
    a = array("I")
    a.frombytes(data)
    if _BIG_ENDIAN:  # pragma: no cover
        a.byteswap()
    return a.tolist()
