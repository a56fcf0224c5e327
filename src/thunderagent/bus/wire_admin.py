"""The bus wire's operator calls to a worker process (``bus.wire`` has the subjects and the other messages). Pure.

    <p>.rpc.<id>.reset_cache   frontend -> worker    ResetCache request; a CacheResetReply to its reply subject

A prefix-cache reset (``/v1/admin/reset_prefix_cache``: ``control/cache_reset.py``) runs in the worker process,
which holds the server's connection; the frontend that asked waits for the answer of the instance it knows.
"""

from __future__ import annotations

import msgspec


class ResetCache(msgspec.Struct, array_like=True, frozen=True):
    running: bool  # vLLM's reset_running_requests
    external: bool  # vLLM's reset_external


class CacheResetReply(msgspec.Struct, array_like=True, frozen=True):
    instance: str  # the worker process that answers (a frontend takes only the one it knows)
    success: bool
    error: str | None = None


decode_reset_cache = msgspec.msgpack.Decoder(ResetCache).decode
decode_cache_reset_reply = msgspec.msgpack.Decoder(CacheResetReply).decode
