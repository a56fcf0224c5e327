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
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import aiohttp

TransportError = aiohttp.ClientError
TransportConnectionError = aiohttp.ClientConnectionError
#: a non-2xx answer to a ``GET`` (its ``status`` says which)
TransportStatusError = aiohttp.ClientResponseError
_JSON_HEADERS = {"Content-Type": "application/json"}


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
    def stream_post(self, url: str, json: Any) -> AbstractAsyncContextManager[StreamedResponse]:
        """POST ``json`` (bytes: already encoded JSON, sent as they are); leaving the context closes
        the connection (an engine aborts the request)."""
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

    def __init__(self, connect_timeout: float) -> None:
        self._connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        self._posts: aiohttp.ClientSession | None = None

    def open(self) -> None:
        # limit=0: no cap (the router bounds the load). No read timeout: a request may wait in the
        # engine's queue for long; a hung engine is caught by the liveness rule instead (no keepalives
        # once its metrics stop answering).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
        # Streamed POSTs each open their own connection (force_close: never a pooled one). A server
        # closes an idle keep-alive connection after a while (uvicorn, vLLM's server: 5 s); a POST
        # sent on one just as it closes fails ("Can not write request body"), and aiohttp retries only
        # idempotent methods. Seen under load with 100 streams on vLLM: the failed request took a
        # healthy worker out of routing. A connect on the engine's network costs far less than a
        # generation; the GETs (metrics every heartbeat) keep their pool, retried by aiohttp.
        self._posts = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                            timeout=timeout)

    async def close(self) -> None:
        for session in (self._session, self._posts):
            if session is not None:
                await session.close()

    def _opened(self) -> aiohttp.ClientSession:
        assert self._session is not None, "open() was not called"
        return self._session

    @contextlib.asynccontextmanager
    async def stream_post(self, url: str, json: Any) -> AsyncIterator[StreamedResponse]:
        assert self._posts is not None, "open() was not called"
        if isinstance(json, bytes):  # a relayed client body (engine openai): byte for byte
            cm = self._posts.post(url, data=json, headers=_JSON_HEADERS)
        else:
            cm = self._posts.post(url, json=json)
        async with cm as resp:
            yield _AiohttpStream(resp)

    async def get_text(self, url: str, timeout: float) -> str:
        async with self._opened().get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            return await resp.text()

    async def get_json(self, url: str, timeout: float) -> Any:
        async with self._opened().get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            resp.raise_for_status()
            return await resp.json()
