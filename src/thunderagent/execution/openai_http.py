"""A lean HTTP/1.1 client for the relay's one hop (``engine: openai``): POST bytes, stream the answer.

aiohttp's client cost about as much CPU per relayed request as the rest of the proxy's HTTP side
(``bench/proxy_latency.py``: ~300 µs of a ~2 ms request on a 2-core machine), most of it in
building a general request (URL parsing, header multidicts, cookie jars, tracing hooks, payload
objects) and in its stream reader. A relayed request needs none of that: one ``POST`` of bytes the
client already encoded, to a server we know, and the answer's bytes as they arrive. This module does
exactly that on pooled keep-alive connections:

- the request goes out in one write (head and body);
- the answer's head is parsed once; its body is framed by ``Content-Length``, chunked transfer
  encoding, or the end of the connection, and handed on in pieces as they arrive (``chunks``);
- a connection whose answer was read to its end (and that the server keeps alive) goes back to the
  pool; one left early (a client that went away) is closed, which makes the server abort;
- a pooled connection idle for ``idle_s`` is not reused (ours closes before the server's keep-alive
  timer, 5 s for uvicorn and llama.cpp), and a request whose reused connection is hung up before any
  answer byte is sent once more on a new connection (the race a pooled POST has with that timer).

Errors are aiohttp's classes (what :mod:`~thunderagent.execution.http_transport` names): a server
that cannot be reached or hangs up before answering raises ``ClientConnectionError``; a body cut short
``ClientPayloadError``; a connect that runs out of time ``TimeoutError``. HTTPS is not spoken here
(the transport sends ``https://`` URLs through aiohttp).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import unquote, urlsplit

import aiohttp

log = logging.getLogger(__name__)

_MAX_HEAD = 64 * 1024  # an answer's head past this is refused (aiohttp's own limits are of this order)
_HIGH_WATER = 256 * 1024  # body bytes buffered before reading from the socket pauses
_MAX_CHUNK = 64 * 1024 * 1024  # one chunk of a chunked body is held whole: refused past this
_NO_BODY = frozenset((204, 304))
_NAME = re.compile(r"[A-Za-z0-9-]{1,64}")  # a forwarded header's name ...
_VALUE = re.compile(r"[\x20-\x7e]{1,512}")  # ... and value: printable ASCII, no CR / LF
_JSON = b"Content-Type: application/json\r\n"  # a relayed body's type, unless its request names another
#: vLLM's header naming the data-parallel rank a request goes to (its API server sends it to that engine)
DP_RANK_HEADER = "X-data-parallel-rank"


class _Conn(asyncio.Protocol):
    """One connection: feeds the answer being read (at most one: no pipelining)."""

    __slots__ = ("closed", "paused", "resp", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.resp: RelayResponse | None = None
        self.closed = False
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(data)
        else:  # bytes nobody asked for: the connection is not reusable
            self.close()

    def eof_received(self) -> bool | None:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.resp is not None:
            self.resp._lost(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class RelayResponse:
    """An answer being read (the transport's ``StreamedResponse``): status, then the body in pieces."""

    __slots__ = (
        "_any",
        "_buffered",
        "_chunked",
        "_conn",
        "_eof",
        "_error",
        "_head",
        "_head_done",
        "_left",
        "_pieces",
        "_tail",
        "_waiter",
        "keep_alive",
        "status",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self._head = b""
        self._head_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.keep_alive = True
        self._chunked = False
        self._left = -1  # body bytes still to come (-1: until the end); chunked: 0, -3 after the last chunk
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False  # the body is complete
        self._error: BaseException | None = None
        self._any = False  # a byte of the answer came
        self._tail = b""  # chunked framing not parsed yet

    # -- the protocol's side ----------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._any = True
        if self._eof:  # bytes past the answer's end: this connection cannot carry another request
            self.keep_alive = False
            return
        if not self._head_done.done():
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > _MAX_HEAD:
                    self._fail(aiohttp.ClientPayloadError(f"answer head longer than {_MAX_HEAD} bytes"))
                return
            data = self._head[end + 4:]
            try:
                self._parse_head(self._head[:end])
            except ValueError as exc:
                self._fail(aiohttp.ClientPayloadError(f"malformed answer head: {exc}"))
                return
            self._head = b""
            self._head_done.set_result(None)
            if self._left == 0 and not self._chunked:
                self._end()
        if data and not self._eof:
            try:
                self._body(data)
            except ValueError as exc:  # a chunk size that is not hex
                self._fail(aiohttp.ClientPayloadError(f"malformed chunked body: {exc}"))

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, status = lines[0].split(b" ", 2)[:2]
        self.status = int(status)
        keep_alive = version == b"HTTP/1.1"
        length = -1
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif name == b"connection":
                v = value.strip().lower()
                keep_alive = v != b"close" and (keep_alive or v == b"keep-alive")
        if self.status in _NO_BODY or 100 <= self.status < 200:
            length = 0
        if self._chunked:
            length = 0  # no chunk begun yet
        elif length < 0:
            keep_alive = False  # framed by the end of the connection
        self._left = length
        self.keep_alive = keep_alive

    def _body(self, data: bytes) -> None:
        if not self._chunked:
            if self._left >= 0:
                if len(data) >= self._left:
                    if len(data) > self._left:  # bytes past the answer: not reusable
                        self.keep_alive = False
                    data, self._left = data[:self._left], 0
                else:
                    self._left -= len(data)
            if data:
                self._push(data)
            if self._left == 0:
                self._end()
            return
        # chunked: whole chunks only (a chunk's data is handed on once its CRLF is in). Servers write
        # one chunk per event, so one network read holds many: a tight loop per chunk, no state
        # machine per byte range. _left is -3 once the last (zero) chunk was read.
        buf = self._tail + data if self._tail else data
        pos, n, out = 0, len(buf), []
        while self._left != -3:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            line = buf[pos:nl]
            size = int(line if b";" not in line else line.split(b";", 1)[0], 16)
            if size == 0:
                pos = nl + 2
                self._left = -3
                break
            end = nl + 2 + size
            if end + 2 > n:
                break  # the chunk is not all in yet
            out.append(buf[nl + 2:end])
            pos = end + 2
        if self._left == -3:  # after the last chunk: trailers (rare), then an empty line
            end = buf.find(b"\r\n", pos)
            while end > pos:
                pos = end + 2
                end = buf.find(b"\r\n", pos)
            if end >= 0:
                if end + 2 < n:  # bytes past the answer: the connection is not reused
                    self.keep_alive = False
                if out:
                    self._push(b"".join(out))
                self._end()
                return
            # its last line is not in yet: wait for it (servers send it with the last chunk)
        self._tail = buf[pos:]
        if len(self._tail) > _MAX_CHUNK:
            raise ValueError(f"a chunk of more than {_MAX_CHUNK} bytes")
        if out:
            self._push(b"".join(out) if len(out) > 1 else out[0])

    def _push(self, data: bytes) -> None:
        self._pieces.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._conn.paused and self._conn.transport is not None:
            self._conn.paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None and not self._eof:
            self._error = exc
        self._conn.close()
        if not self._head_done.done():
            self._head_done.set_exception(exc)
        self._wake()

    def _lost(self, exc: Exception | None) -> None:
        if self._eof:
            return
        if not self._head_done.done():
            self._fail(aiohttp.ServerDisconnectedError() if exc is None else
                       aiohttp.ClientOSError(getattr(exc, "errno", 0) or 0, str(exc)))
        elif (self._left < 0 and not self._chunked) or self._left == -3:
            # framed by the end of the connection, or chunked with only its last empty line missing
            self.keep_alive = False
            self._end()
        else:
            self._fail(aiohttp.ClientPayloadError("Response payload is not completed"))

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- the reader's side ------------------------------------------------------------------------
    async def _started(self) -> None:
        await self._head_done

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body in pieces as they arrive (chunked framing removed)."""
        conn = self._conn
        while True:
            if self._pieces:
                piece = self._pieces.popleft()
                self._buffered -= len(piece)
                if conn.paused and self._buffered <= _HIGH_WATER // 4 and conn.transport is not None:
                    conn.paused = False
                    conn.transport.resume_reading()
                yield piece
                continue
            if self._error is not None:
                raise self._error
            if self._eof:
                return
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def lines(self) -> AsyncIterator[bytes]:
        """The body line by line, each with its line ending (a last unterminated line too)."""
        buf = b""
        async for piece in self.chunks():
            buf += piece
            start = 0
            while (nl := buf.find(b"\n", start)) >= 0:
                yield buf[start:nl + 1]
                start = nl + 1
            buf = buf[start:]
        if buf:
            yield buf

    async def text(self) -> str:
        return b"".join([p async for p in self.chunks()]).decode("utf-8", errors="replace")

    @property
    def complete(self) -> bool:
        return self._eof and self._error is None and not self._pieces


class RelayClient:
    """Pooled keep-alive connections per server (``host:port``); open inside the event loop."""

    def __init__(self, connect_timeout: float, idle_s: float, api_key: str | None = None,
                 dp_rank: int | None = None) -> None:
        self._connect_timeout = connect_timeout
        self._idle_s = idle_s
        self._bearer = f"Authorization: Bearer {api_key}\r\n" if api_key else ""  # (checked: no CR/LF in a key)
        self._rank = "" if dp_rank is None else f"{DP_RANK_HEADER}: {int(dp_rank)}\r\n"
        self._idle: dict[tuple[str, int], list[tuple[_Conn, float]]] = {}
        self._heads: dict[str, tuple[tuple[str, int], bytes]] = {}  # url -> (server, request head, no length yet)

    def _head(self, url: str) -> tuple[tuple[str, int], bytes]:
        got = self._heads.get(url)
        if got is None:
            u = urlsplit(url)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"the relay client speaks plain http only, got {url!r}")
            port = u.port or 80
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            auth = self._bearer  # the server's API key; user:password@ in the URL: basic authentication instead
            if u.username is not None:
                cred = f"{unquote(u.username)}:{unquote(u.password or '')}".encode()
                auth = f"Authorization: Basic {base64.b64encode(cred).decode()}\r\n"
            host = u.netloc.rpartition("@")[2]
            head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}{self._rank}Accept: */*\r\n".encode()
            got = self._heads[url] = ((u.hostname, port), head)
        return got

    def _pooled(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn, since = idle.pop()  # the most recently used first
            if not conn.closed and now - since <= self._idle_s:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        try:
            return await self._open(key)
        except TimeoutError:  # once more, as AiohttpTransport.stream_post does (why: there)
            log.warning("connect to %s:%d timed out: trying once more", *key)
        try:
            return await self._open(key)
        except TimeoutError as exc:
            raise aiohttp.ConnectionTimeoutError(f"connecting to {key[0]}:{key[1]} timed out") from exc

    async def _open(self, key: tuple[str, int]) -> _Conn:
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await asyncio.get_running_loop().create_connection(_Conn, key[0], key[1])
        except TimeoutError:  # before OSError, which it is
            raise
        except OSError as exc:
            raise aiohttp.ClientConnectionError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        return conn

    async def _send(self, conn: _Conn, request: bytes) -> RelayResponse:
        resp = conn.resp = RelayResponse(conn)
        assert conn.transport is not None
        conn.transport.write(request)
        await resp._started()
        return resp

    @contextlib.asynccontextmanager
    async def post(self, url: str, body: bytes,
                   headers: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[RelayResponse]:
        key, head = self._head(url)
        # headers: a client's trace context, checked by the frontend; checked again here, where a CR / LF would
        # split the request (a forged request over the bus): a pair that is not a token and printable is dropped
        extra = _JSON
        if headers:  # (a body that is not JSON, an audio form, names its own Content-Type among them)
            sent = [(k, v) for k, v in headers if _NAME.fullmatch(k) and _VALUE.fullmatch(v)]
            extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in sent)
            if not any(k.lower() == "content-type" for k, _ in sent):
                extra += _JSON
        request = b"%s%sContent-Length: %d\r\n\r\n%s" % (head, extra, len(body), body)
        conn = self._pooled(key)
        try:
            if conn is not None:
                try:
                    resp = await self._send(conn, request)
                except aiohttp.ClientConnectionError:
                    if conn.resp is not None and conn.resp._any:
                        raise  # the server answered part: not the keep-alive race
                    # the server closed this idle connection as we sent on it: once more on a new one
                    conn = await self._connect(key)
                    resp = await self._send(conn, request)
            else:
                conn = await self._connect(key)
                resp = await self._send(conn, request)
        except BaseException:
            if conn is not None:
                conn.close()  # cancelled or failed before the answer: the server aborts
            raise
        try:
            yield resp
        finally:
            conn.resp = None
            if resp.complete and resp.keep_alive and not conn.closed:
                if conn.paused and conn.transport is not None:
                    conn.paused = False
                    conn.transport.resume_reading()
                self._idle.setdefault(key, []).append((conn, time.monotonic()))
            else:
                conn.close()

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn, _ in idle:
                conn.close()
        self._idle.clear()
