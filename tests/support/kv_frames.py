"""Engine KV-event frames built by hand: what a vLLM / SGLang publisher sends, for tests that feed
:mod:`thunderagent.execution.kv_stream` without an engine."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


def encode_batch(seq: int, events: Iterable[object], ts: float = 0.0, rank: int | None = 0,
                 topic: bytes = b"kv-events") -> list[bytes]:
    """Frames of one batch as an engine publishes them (tests and tools build streams with it)."""
    payload = msgspec.msgpack.encode([ts, list(events), rank])
    return [topic, seq.to_bytes(8, "big", signed=True), payload]
