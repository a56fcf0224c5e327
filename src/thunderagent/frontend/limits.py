"""Request-level guards against hostile or broken clients, applied before any handler runs.

- A body must be JSON: ``Content-Type: application/json`` (or ``application/*+json``). ``text/plain``
  and form bodies are what a browser page may send cross-origin without a CORS preflight; they get
  415. A POST with an ``Origin`` header (only browsers send one) gets 403: together, no web page can
  drive this API from a user's browser. No CORS header is ever set.
- ``Content-Encoding`` is identity, gzip or deflate (aiohttp decodes those); others get 415, a
  body that does not decode gets 400.
- A ``Content-Length`` over ``control_plane.max_body_bytes`` gets 413 before anything is read.
- The whole body must arrive within ``control_plane.body_timeout_s``: a slow body, or a
  ``Content-Length`` larger than what is sent, gets 408 and the connection is closed. The body is
  read here (aiohttp caches it, so handlers' ``request.read()`` returns it at once).

Header-size limits, the idle/header timeout and the connection limit act in the protocol layer
(``frontend/server.py``), before a request exists.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

from aiohttp import http_exceptions, web

from thunderagent.config import ControlPlaneConfig
from thunderagent.frontend.protocol import RequestError, error_body
from thunderagent.types import AUDIO_PATHS

LIMITS_KEY = web.AppKey("limits", ControlPlaneConfig)

_JSON = re.compile(r"application/(?:[a-z0-9.+-]*\+)?json")
#: what aiohttp decodes with no optional package installed
ENCODINGS = ("identity", "gzip", "deflate")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def closing_error(err: RequestError) -> web.Response:
    """An OpenAI-shaped error that also closes the connection (its body was not, or not fully, read)."""
    resp = web.Response(body=error_body(err), status=err.status, content_type="application/json")
    resp.force_close()
    return resp


def check_origin_and_media_type(request: web.Request) -> None:
    if "Origin" in request.headers:
        # Only browsers send Origin on a POST, and we serve no page of our own: a web page is trying
        # to drive the API from a user's browser (a body-less POST such as a release needs no preflight).
        raise RequestError("cross-origin requests from browsers are not accepted (this API sets no CORS headers)",
                           status=403, code="cross_origin_refused")
    if not request.body_exists or request.content_length == 0:
        return  # a body-less POST (release a program by path)
    declared = request.headers.get("Content-Type")
    form = request.path in AUDIO_PATHS  # (speech to text: the audio file in a form, as OpenAI's API takes it)
    if not (request.content_type == "multipart/form-data" if form else _JSON.fullmatch(request.content_type)):
        raise RequestError(
            f"Content-Type must be {'multipart/form-data' if form else 'application/json'}, got {declared or 'none'!r}",
            status=415, code="unsupported_media_type",
        )
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ENCODINGS:
        raise RequestError(
            f"Content-Encoding {encoding[:40]!r} is not supported: send {', '.join(ENCODINGS)}",
            status=415, code="unsupported_content_encoding",
        )


async def read_body(request: web.Request, cp: ControlPlaneConfig) -> web.Response | None:
    """Read the whole body within the body timeout; an error response (closing) when it cannot be."""
    length = request.content_length
    if length is not None and length > cp.max_body_bytes:
        return closing_error(RequestError(
            f"request body too large: {length} bytes, limit is {cp.max_body_bytes} (control_plane.max_body_bytes)",
            status=413, code="body_too_large",
        ))
    try:
        async with asyncio.timeout(cp.body_timeout_s):
            await request.read()  # over max_body_bytes (chunked, decompressed): 413 from errors_middleware
    except TimeoutError:
        return closing_error(RequestError(
            f"request body not received within {cp.body_timeout_s:g}s (control_plane.body_timeout_s); "
            "is Content-Length larger than the body?", status=408, code="request_timeout",
        ))
    except web.RequestPayloadError as exc:
        if isinstance(exc.__cause__, http_exceptions.ContentEncodingError):
            encoding = request.headers.get("Content-Encoding", "")[:40]
            msg = f"request body does not decode as Content-Encoding {encoding!r}"
        else:
            msg = f"request body is malformed: {type(exc.__cause__ or exc).__name__}"
        return closing_error(RequestError(msg, code="bad_request_body"))
    return None


@web.middleware
async def limits_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method in _BODY_METHODS:
        check_origin_and_media_type(request)
        refused = await read_body(request, request.app[LIMITS_KEY])
        if refused is not None:
            return refused
    return await handler(request)
