"""The HTTP server around the app: connection-level limits and protocol errors in OpenAI's shape.

aiohttp's ``AppRunner`` builds one ``RequestHandler`` (an asyncio protocol) per connection. Ours:

- passes the control plane's header limits (``max_header_bytes``, ``max_headers``) and its idle
  timeout (``idle_timeout_s``: aiohttp's keep-alive timer, which also closes a connection that has
  not delivered a complete request head in that time: slow-loris headers);
- counts open connections and answers one past ``max_connections`` with a 503 and closes it;
- turns what aiohttp rejects before a request exists (a malformed request line, an oversized
  header, an undecodable ``Content-Encoding``) into an OpenAI-shaped 4xx instead of aiohttp's text
  page, and logs it once per cause per interval instead of a traceback per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any, cast

from aiohttp import http_exceptions, web

from thunderagent.frontend.errorlog import ERROR_LOG_KEY, ErrorLog
from thunderagent.gc_policy import tune_gc
from thunderagent.frontend.limits import LIMITS_KEY, ENCODINGS
from thunderagent.frontend.protocol import SERVER, RequestError, error_body

log = logging.getLogger(__name__)


def protocol_error(status: int, exc: BaseException | None, max_header_bytes: int) -> RequestError:
    """What a client gets for a request aiohttp could not parse (or, status 500, could not serve)."""
    if status >= 500:
        return RequestError("internal server error", status=500, type_="server_error")
    if isinstance(exc, http_exceptions.LineTooLong):
        return RequestError(f"request line or a header is longer than {max_header_bytes} bytes "
                            "(control_plane.max_header_bytes)", status=431, code="header_too_large")
    text = exc.message if isinstance(exc, http_exceptions.HttpProcessingError) else str(exc or "")
    if "Too many headers" in text:
        return RequestError(f"{text} (control_plane.max_headers)", status=431, code="too_many_headers")
    if isinstance(exc, http_exceptions.ContentEncodingError):
        return RequestError(f"unsupported Content-Encoding: send {', '.join(ENCODINGS)}", status=415,
                            code="unsupported_content_encoding")
    return RequestError(f"malformed HTTP request: {text[:200] or type(exc).__name__}", status=status,
                        code="bad_http_request")


class _Handler(web.RequestHandler):
    """aiohttp's per-connection protocol, with OpenAI-shaped protocol errors and counted connections."""

    __slots__ = ("_guard",)

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._guard.closed(self)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's own error logs (a body that fails after its response was sent...): once per cause."""
        exc = kw.get("exc_info")
        what = str(args[0]) if args else "error in the HTTP protocol"
        if isinstance(exc, (web.RequestPayloadError, http_exceptions.HttpProcessingError)):  # the client's fault
            self._guard.errlog.warning(f"http:{type(exc).__name__}", "%s: %s", what, str(exc).strip()[:200])
        elif isinstance(exc, BaseException):
            self._guard.errlog.exception(exc, what)
        else:
            self._guard.errlog.warning(f"http:{what}", what)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        err = protocol_error(status, exc, self._guard.max_header_bytes)
        if status >= 500 and exc is not None:
            self._guard.errlog.exception(exc, "internal error on %s %s", request.method, request.path)
        elif status < 500:
            self._guard.errlog.warning(f"http:{err.code}", "refused a malformed request (%s): %s", err.status,
                                       err.message)
        if request.writer.output_size > 0:  # part of a response went out: all that is left is to hang up
            raise ConnectionError("response already started; cannot send the error")
        resp = web.Response(body=error_body(err), status=err.status, content_type="application/json",
                            headers={"Server": SERVER})
        resp.force_close()
        return resp


class _Refused(asyncio.Protocol):
    """A connection past the limit: told so in one response, then closed."""

    def __init__(self, response: bytes) -> None:
        self._response = response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).write(self._response)
        transport.close()


class ConnectionGuard:
    """The protocol factory the listening socket calls per accepted connection, in place of
    aiohttp's ``Server`` (which it wraps; everything else is delegated to it)."""

    def __init__(self, server: web.Server, app: web.Application, handler_kwargs: dict[str, Any]) -> None:
        cp = app[LIMITS_KEY]
        self._server = server
        self._kwargs = handler_kwargs
        self.errlog: ErrorLog = app[ERROR_LOG_KEY]
        self.max_connections = cp.max_connections
        self.max_header_bytes = cp.max_header_bytes
        # Counted from the factory call, not from connection_made: a burst of accepts creates many
        # protocols before any of them is connected.
        self._open: set[_Handler] = set()
        err = RequestError(f"too many open connections (control_plane.max_connections = {cp.max_connections}); "
                           "retry later", status=503, code="too_many_connections", type_="server_error")
        body = error_body(err)
        self._refusal = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self._open) >= self.max_connections:
            self.errlog.warning("connection_limit", "refused a connection: %d open (control_plane.max_connections)",
                                len(self._open))
            return _Refused(self._refusal)
        handler = _Handler(self._server, guard=self, loop=asyncio.get_running_loop(), **self._kwargs)
        self._open.add(handler)
        return handler

    def closed(self, handler: _Handler) -> None:
        self._open.discard(handler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class FrontendRunner(web.AppRunner):
    """``AppRunner`` with the control plane's connection limits (``create_app`` stored them in the app)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        cp = app[LIMITS_KEY]
        self._handler_kwargs: dict[str, Any] = {
            "keepalive_timeout": cp.idle_timeout_s, "max_line_size": cp.max_header_bytes,
            "max_field_size": cp.max_header_bytes, "max_headers": cp.max_headers, "access_log": None,
        }
        # handler_cancellation: a client that hangs up cancels its handler, so a request it left in
        # the scheduler's queue leaves at once
        super().__init__(app, handler_cancellation=True, **self._handler_kwargs, **kwargs)
        self.guard: ConnectionGuard | None = None

    async def _make_server(self) -> web.Server:
        self.guard = ConnectionGuard(await super()._make_server(), self.app, self._handler_kwargs)
        return cast(web.Server, self.guard)


def run_frontend(app: web.Application, host: str, port: int) -> None:
    """Serve ``app`` until SIGTERM or SIGINT, then drain: the listener closes at once (no new connection), idle
    keep-alive connections close, and the requests in flight (held in the scheduler ones included) get the control
    plane's ``shutdown_timeout_s`` to finish before the rest are cut and the fleet stops. A second signal cuts the
    drain short. (``web.run_app``'s own handling raises out of the loop, which cancels every handler at once: a
    restarted frontend cut all its streams.)"""
    timeout = app[LIMITS_KEY].shutdown_timeout_s

    async def main() -> None:
        runner = FrontendRunner(app, shutdown_timeout=timeout)
        await runner.setup()
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        task = asyncio.current_task()
        assert task is not None

        def on_signal() -> None:
            if stop.is_set():  # the second: the operator does not want to wait
                log.warning("second signal: the drain is cut short")
                task.cancel()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            await web.TCPSite(runner, host, port).start()
            tune_gc()  # start-up done: freeze it, and collect rarely (gc_policy: the p99 of a big heap)
            await stop.wait()
            log.warning("stopping: no new connections; the requests in flight get up to %gs to finish", timeout)
        finally:
            await runner.cleanup()

    with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
        asyncio.run(main())
