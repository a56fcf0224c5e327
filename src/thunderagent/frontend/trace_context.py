"""The client headers ThunderAgent passes on to the engine server that serves a request.

- ``traceparent`` / ``tracestate`` (W3C Trace Context): a vLLM or SGLang server started with tracing
  (``--otlp-traces-endpoint``) makes its spans children of the client's trace, so one trace shows the
  client, ThunderAgent's hop and the engine;
- ``x-request-id``: vLLM with ``--enable-request-id-headers`` takes it as its own request id (its logs and
  answer then carry the client's id).

Only these, and only well-formed: a ``traceparent`` that is not ``version-traceid-parentid-flags`` is dropped,
and ``tracestate`` with it, as the W3C specification asks of a party that cannot parse the parent (the server
then starts a trace of its own); any value over 512 characters or with characters outside printable ASCII is
dropped. Nothing else from the client's headers reaches a server (its API key, cookies...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from aiohttp import web

#: what is passed on, lower-case (aiohttp's header lookup ignores case)
FORWARDED = ("traceparent", "tracestate", "x-request-id")
MAX_VALUE = 512
# version 00-fe, trace id and parent id not all zeros (checked below), two flag digits
_PARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?")
_PRINTABLE = re.compile(r"[\x20-\x7e]+")
_NONE: tuple[tuple[str, str], ...] = ()
#: the traceparent of ThunderAgent's own span of a request (``frontend/tracing.py``), sent in place of the client's
OUR_PARENT = web.RequestKey("our_traceparent", str)


def trace_headers(headers: Mapping[str, str], ours: str | None = None) -> tuple[tuple[str, str], ...]:
    """The forwarded headers of a client's request, as ``(name, value)`` pairs (usually none: one dict miss each).
    ``ours``: the traceparent of ThunderAgent's own span of the request (``frontend/tracing.py``), sent in place of
    the client's (whose ``tracestate`` goes with it, as the W3C specification asks of a span of the same trace)."""
    if ours is None and not any(name in headers for name in FORWARDED):
        return _NONE
    out = []
    parent = headers.get("traceparent") if ours is None else ours
    if parent is not None and (ours is not None or _valid_parent(parent)):
        out.append(("traceparent", parent))
        state = headers.get("tracestate")
        if state is not None and _fits(state) and (ours is None or _valid_parent(headers.get("traceparent", ""))):
            out.append(("tracestate", state))
    rid = headers.get("x-request-id")
    if rid is not None and _fits(rid):
        out.append(("x-request-id", rid))
    return tuple(out)


def _fits(value: str) -> bool:
    return len(value) <= MAX_VALUE and _PRINTABLE.fullmatch(value) is not None


def _valid_parent(value: str) -> bool:
    m = _PARENT.fullmatch(value)
    if m is None or value.startswith("ff") or len(value) > MAX_VALUE:
        return False
    # version 00 has exactly four parts; trace and parent ids of zeros are invalid
    return (m.group(3) is None or not value.startswith("00")) and m.group(1) != "0" * 32 and m.group(2) != "0" * 16
