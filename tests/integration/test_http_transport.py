"""The engine transport's streamed POSTs: pooled keep-alive connections, safe against a server's
keep-alive timer.

A server closes an idle keep-alive connection after a while (vLLM's uvicorn: 5 s); a POST written on
one as it closes fails ("Can not write request body") and aiohttp does not retry a POST. Seen with
100 streams on real vLLM under load: the failed request took the surviving worker out of routing. The
transport therefore drops pooled connections idle for ``_POOL_IDLE_S`` (under those servers' 5 s) and
sends a POST whose pooled connection is hung up before any answer once more on a new connection. The
first server here makes that race certain: it answers the first request on a connection and hangs up
on any second one without answering; the second keeps connections alive, as servers do.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from thunderagent.execution import http_transport
from thunderagent.execution.http_transport import AiohttpTransport

BODY = b'data: {"ok": true}\n\ndata: [DONE]\n\n'


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[int],
                 answered: list[int], keep_alive: bool) -> None:
    n = 0
    try:
        while True:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            n += 1
            seen.append(n)
            if n > 1 and not keep_alive:  # a reused connection: hang up, as a server whose keep-alive timer fired
                return
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            answered.append(json.loads(await reader.readexactly(length))["i"])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
            await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


async def _post_five(keep_alive: bool, pause: float) -> tuple[list[int], list[int]]:
    seen: list[int] = []  # per request received: its rank on its connection
    answered: list[int] = []
    server = await asyncio.start_server(lambda r, w: _serve(r, w, seen, answered, keep_alive), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = AiohttpTransport(connect_timeout=5)
    transport.open()
    try:
        for i in range(5):
            async with transport.stream_post(f"http://127.0.0.1:{port}/v1/completions", {"i": i}) as resp:
                assert resp.status == 200
                assert [line async for line in resp.lines()] == BODY.splitlines(keepends=True)
            await asyncio.sleep(pause)  # the response is done: its pooled connection is idle now
    finally:
        await transport.close()
        server.close()
        await server.wait_closed()
    return seen, answered


async def test_a_post_on_a_connection_the_server_hangs_up_is_sent_again_on_a_new_one() -> None:
    seen, answered = await _post_five(keep_alive=False, pause=0.01)
    assert answered == [0, 1, 2, 3, 4]  # every request answered, once, in order: none failed
    assert seen.count(1) == 5  # each was answered on a connection's first request


async def test_streamed_posts_reuse_a_kept_alive_connection() -> None:
    seen, answered = await _post_five(keep_alive=True, pause=0.01)
    assert answered == [0, 1, 2, 3, 4]
    assert seen == [1, 2, 3, 4, 5]  # one connection: no connect per request


async def test_a_connection_idle_past_the_pool_limit_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_transport, "_POOL_IDLE_S", 0.05)
    seen, answered = await _post_five(keep_alive=True, pause=0.2)
    assert answered == [0, 1, 2, 3, 4]
    assert seen == [1] * 5  # dropped by us before the server's timer could close it under a request


@pytest.mark.parametrize("body", [{"i": 7}, b'{"i": 7}'], ids=["aiohttp", "relay"])
async def test_a_connect_timed_out_by_a_starved_loop_is_tried_once_more(body: object) -> None:
    """Our loop blocked past the connect timeout (CI's 2 shared cores): the kernel connected, but
    the timeout fired first. Nothing was sent, so the POST goes once more and is answered once;
    through aiohttp (a token-id request) and through the relay (a client's body, engine openai)."""
    seen: list[int] = []
    answered: list[int] = []
    server = await asyncio.start_server(lambda r, w: _serve(r, w, seen, answered, True), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = AiohttpTransport(connect_timeout=0.2)
    transport.open()

    async def post() -> list[bytes]:
        async with transport.stream_post(f"http://127.0.0.1:{port}/v1/completions", body) as resp:
            assert resp.status == 200
            return [line async for line in resp.lines()]

    try:
        task = asyncio.create_task(post())
        await asyncio.sleep(0)  # the task starts its connect and waits for it
        time.sleep(0.5)  # the loop is starved past the timeout  # noqa: ASYNC251 (that is the point)
        assert await asyncio.wait_for(task, 5) == BODY.splitlines(keepends=True)
        assert answered == [7]
    finally:
        await transport.close()
        server.close()
        await server.wait_closed()


async def test_forwarded_headers_and_the_servers_key_reach_it_and_nothing_splits_a_request() -> None:
    """A request's forwarded headers (a client's trace context) and the server's API key go on both clients (the
    lean one of relayed bodies, aiohttp's of the token path); a pair a forged request could carry with a CR / LF
    is dropped by the lean client, which writes its head itself, so it cannot smuggle a second request."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                heads.append(head)
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    transport = AiohttpTransport(connect_timeout=5, api_key="sk-server-0123456789")
    transport.open()
    trace = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("x-request-id", "r-1"))
    forged = (("x-request-id", "r\r\nContent-Length: 0\r\n\r\nGET /sleep HTTP/1.1"), ("bad name", "v"))
    try:
        for body in (b'{"relayed": true}', {"token": "path"}):  # bytes: the lean client; a dict: aiohttp's
            async with transport.stream_post(url, body, trace) as resp:
                assert resp.status == 200 and b"".join([c async for c in resp.chunks()]) == BODY
        async with transport.stream_post(url, b'{"forged": true}', forged) as resp:
            assert resp.status == 200 and b"".join([c async for c in resp.chunks()]) == BODY
    finally:
        await transport.close()
        server.close()
        await server.wait_closed()
    assert len(heads) == 3  # three requests, no smuggled fourth
    for head in heads[:2]:
        text = head.decode().lower()
        assert "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" in text
        assert "x-request-id: r-1" in text and "authorization: bearer sk-server-0123456789" in text
    assert b"x-request-id" not in heads[2].lower() and b"/sleep" not in heads[2] and b"bad name" not in heads[2]
