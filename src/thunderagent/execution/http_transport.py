"""The HTTP seam between an engine worker and its server, and its aiohttp implementation.

An engine worker makes three kinds of calls: a streamed ``POST`` (completions, read line by line),
a ``GET`` for text (Prometheus metrics) and a ``GET`` for JSON (the served model). They go through an
:class:`HttpTransport`, so unit tests can drive :class:`~thunderagent.execution.vllm.EngineWorker`
with a fake one, without sockets.

Errors keep aiohttp's classes (aliased here, so a fake raises the same ones): a transport raises
:data:`TransportConnectionError` when the server cannot be reached (refused, reset, gone), another
:data:`TransportError` for any other HTTP failure (a non-2xx answer to a ``GET`` included), and
:class:`TimeoutError` when a call runs out of time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import aiohttp

from thunderagent.execution.openai_http import DP_RANK_HEADER, RelayClient

log = logging.getLogger(__name__)

TransportError = aiohttp.ClientError
TransportConnectionError = aiohttp.ClientConnectionError
#: a non-2xx answer to a ``GET`` (its ``status`` says which)
TransportStatusError = aiohttp.ClientResponseError
_JSON_HEADERS = {"Content-Type": "application/json"}
#: seconds a pooled POST connection may idle before it is dropped: below the 5 s keep-alive of the
#: servers we front (uvicorn, llama.cpp), so ours closes first (see AiohttpTransport.open)
_POOL_IDLE_S = 2.0


class StreamedResponse(Protocol):
    """An answer to :meth:`HttpTransport.stream_post`, open while its context lasts."""

    @property
    def status(self) -> int: ...

    def lines(self) -> AsyncIterable[bytes]:
        """The body, line by line (each line with its line ending), as it arrives."""
        ...

    async def text(self) -> str:
        """The whole body (for error answers)."""
        ...

    def chunks(self) -> AsyncIterable[bytes]:
        """The body in pieces as they arrive, whatever their boundaries (relayed streams)."""
        ...


class HttpTransport(Protocol):
    def stream_post(self, url: str, json: Any,
                    headers: tuple[tuple[str, str], ...] = ()) -> AbstractAsyncContextManager[StreamedResponse]:
        """POST ``json`` (bytes: already encoded JSON, sent as they are) with ``headers`` besides the transport's
        own (a client's trace context); leaving the context closes the connection (an engine aborts the request)."""
        ...

    def stream_get(self, url: str) -> AbstractAsyncContextManager[StreamedResponse]:
        """GET ``url`` whatever its status (a relayed read of a stored response), open while the context lasts."""
        ...

    async def get_text(self, url: str, timeout: float) -> str:
        """GET a 2xx answer's body as text, within ``timeout`` seconds."""
        ...

    async def get_json(self, url: str, timeout: float) -> Any:
        """GET a 2xx answer's body as JSON, within ``timeout`` seconds."""
        ...


class _AiohttpStream:
    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    @property
    def status(self) -> int:
        return self._resp.status

    def lines(self) -> AsyncIterable[bytes]:
        return self._resp.content

    async def text(self) -> str:
        return await self._resp.text()

    def chunks(self) -> AsyncIterable[bytes]:
        return self._resp.content.iter_any()


class AiohttpTransport:
    """:class:`HttpTransport` over one aiohttp session, opened by :meth:`open` inside the event loop."""

    def __init__(self, connect_timeout: float, api_key: str | None = None, dp_rank: int | None = None) -> None:
        self._connect_timeout = connect_timeout
        #: a server that demands an API key gets it on every call (relayed bodies, polls, the token path); one
        #: data-parallel rank of a vLLM server is named on every call (vLLM sends a request so named to that rank)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if dp_rank is not None:
            headers[DP_RANK_HEADER] = str(dp_rank)
        self._headers = headers or None
        self._api_key = api_key
        self._dp_rank = dp_rank
        self._session: aiohttp.ClientSession | None = None
        self._posts: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._relay: RelayClient | None = None

    def open(self) -> None:
        # limit=0: no cap (the router bounds the load). No read timeout: a request may wait in the
        # engine's queue for long; a hung engine is caught by the liveness rule instead (no keepalives
        # once its metrics stop answering).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                              headers=self._headers)
        # Streamed POSTs reuse pooled keep-alive connections: a connect (and the server's accept and
        # close) per request was most of a relayed request's cost. A server closes an idle keep-alive
        # connection after a while (uvicorn, vLLM's and SGLang's servers, llama.cpp: 5 s); a POST sent
        # on one just as it closes fails ("Can not write request body", or disconnected), and aiohttp
        # retries only idempotent methods (seen under load with 100 streams on vLLM: the failed request
        # took a healthy worker out of routing). Two guards: the pool drops a connection idle for
        # _POOL_IDLE_S, well under those servers' timeouts, so ours closes first; and a POST that still
        # fails that way before any answer is sent once more on a new connection (stream_post).
        self._posts = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_POOL_IDLE_S), timeout=timeout,
            headers=self._headers,
        )
        self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                            timeout=timeout, headers=self._headers)
        # relayed client bodies (engine openai) go through a lean client of their own: the same pool
        # rules, a fraction of aiohttp's CPU per request (execution/openai_http.py)
        self._relay = RelayClient(self._connect_timeout, _POOL_IDLE_S, self._api_key, self._dp_rank)

    async def close(self) -> None:
        for session in (self._session, self._posts, self._fresh):
            if session is not None:
                await session.close()
        if self._relay is not None:
            await self._relay.close()

    def _opened(self) -> aiohttp.ClientSession:
        assert self._session is not None, "open() was not called"
        return self._session

    @contextlib.asynccontextmanager
    async def stream_post(self, url: str, json: Any,
                          headers: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[StreamedResponse]:
        assert self._posts is not None and self._fresh is not None and self._relay is not None, "open() was not called"
        if isinstance(json, bytes) and url.startswith("http://"):  # a relayed client body (engine openai)
            async with self._relay.post(url, json, headers) as relayed:
                yield relayed
            return
        if isinstance(json, bytes):  # byte for byte (https: aiohttp's client)
            kw: dict[str, Any] = {"data": json, "headers": {**_JSON_HEADERS, **dict(headers)}}
        else:
            kw = {"json": json, "headers": dict(headers)} if headers else {"json": json}
        try:
            resp = await self._posts.post(url, **kw)
        except aiohttp.ConnectionTimeoutError:
            # The connect timed out, so nothing was sent. A live server's kernel answers a SYN at once,
            # even when the server itself is busy; a timeout is a host that is gone (the second try
            # times out too: twice the connect timeout before the fleet routes elsewhere) or our own
            # loop starved past the timeout (seen on CI's 2 shared cores: the connect was done, its
            # completion came too late), and then the second try connects at once.
            log.warning("connect to %s timed out: trying once more", url)
            resp = await self._fresh.post(url, **kw)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise  # could not connect at all: nothing to retry here (the fleet routes it again)
            # the server closed a pooled connection as this request went out (no answer came): once
            # more on a connection of its own; a server that really went away refuses that one
            resp = await self._fresh.post(url, **kw)
        try:
            yield _AiohttpStream(resp)
        finally:
            # an answer read to its end leaves its connection in the pool; one left early (a client that
            # went away) is closed, which makes the engine abort the request
            resp.release()
            await resp.wait_for_close()

    @contextlib.asynccontextmanager
    async def stream_get(self, url: str) -> AsyncIterator[StreamedResponse]:
        assert self._posts is not None, "open() was not called"
        # (a GET is idempotent: aiohttp itself retries one sent on a pooled connection the server just closed)
        async with self._posts.get(url) as resp:
            yield _AiohttpStream(resp)

    async def get_text(self, url: str, timeout: float) -> str:
        async with self._opened().get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            return await resp.text()

    async def get_json(self, url: str, timeout: float) -> Any:
        async with self._opened().get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            return await resp.json()
