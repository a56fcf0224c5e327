"""The relay's lean HTTP/1.1 client (``execution/openai_http.py``) against raw sockets on 127.0.0.1.

Each server below writes exact bytes, cut at awkward places, so the framing (Content-Length, chunked,
end of connection), the keep-alive pool and the error classes are checked byte for byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from thunderagent.execution.http_transport import TransportConnectionError, TransportError
from thunderagent.execution.openai_http import RelayClient

SSE = b'data: {"choices":[{"text":"x"}]}\n\ndata: [DONE]\n\n'
Answer = Callable[[asyncio.StreamWriter, bytes], Awaitable[bool]]  # writes an answer; False: hang up after


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return await reader.readexactly(length)


async def _server(answer: Answer, log: list[tuple[int, bytes]]) -> tuple[asyncio.Server, str]:
    conns = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        me = conns
        try:
            while True:
                body = await asyncio.wait_for(_read_request(reader), 5)
                log.append((me, body))
                if not await answer(writer, body):
                    break
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"


async def _pieces(writer: asyncio.StreamWriter, data: bytes, cut: int) -> None:
    """Write ``data`` in pieces of ``cut`` bytes, each in its own TCP segment (drain + a short pause)."""
    for i in range(0, len(data), cut):
        writer.write(data[i:i + cut])
        await writer.drain()
        await asyncio.sleep(0.001)


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
async def test_a_chunked_stream_arrives_whole_whatever_its_cuts_and_the_connection_is_reused(cut: int) -> None:
    async def answer(w: asyncio.StreamWriter, body: bytes) -> bool:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        await _pieces(w, head + _chunked(SSE[:10], SSE[10:], body), cut)
        return True

    log: list[tuple[int, bytes]] = []
    server, url = await _server(answer, log)
    client = RelayClient(connect_timeout=5, idle_s=2)
    try:
        for i in range(3):
            async with client.post(url, b'{"i":%d}' % i) as resp:
                assert resp.status == 200
                assert b"".join([p async for p in resp.chunks()]) == SSE + b'{"i":%d}' % i
    finally:
        await client.close()
        server.close()
    assert log == [(1, b'{"i":0}'), (1, b'{"i":1}'), (1, b'{"i":2}')]  # one connection for all three


async def test_content_length_and_close_framed_answers() -> None:
    async def answer(w: asyncio.StreamWriter, body: bytes) -> bool:
        if body == b"1":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel")
            await w.drain()
            await asyncio.sleep(0.01)
            w.write(b"lo")
            return True
        w.write(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")  # no length: the body ends with the connection
        await w.drain()
        return False

    log: list[tuple[int, bytes]] = []
    server, url = await _server(answer, log)
    client = RelayClient(connect_timeout=5, idle_s=2)
    try:
        async with client.post(url, b"1") as resp:
            assert await resp.text() == "hello"
        async with client.post(url, b"2") as resp:
            assert [line async for line in resp.lines()] == [b"until the end"]
        async with client.post(url, b"1") as resp:  # the close-framed connection was not pooled
            assert await resp.text() == "hello"
    finally:
        await client.close()
        server.close()
    assert [c for c, _ in log] == [1, 1, 2]


async def test_an_error_answer_keeps_its_status_and_body() -> None:
    async def answer(w: asyncio.StreamWriter, body: bytes) -> bool:
        err = b'{"error":{"message":"bad"}}'
        w.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(err), err))
        return True

    server, url = await _server(answer, [])
    client = RelayClient(connect_timeout=5, idle_s=2)
    try:
        async with client.post(url, b"{}") as resp:
            assert resp.status == 400
            assert await resp.text() == '{"error":{"message":"bad"}}'
    finally:
        await client.close()
        server.close()


async def test_a_pooled_connection_hung_up_before_any_answer_is_retried_on_a_new_one() -> None:
    async def answer(w: asyncio.StreamWriter, body: bytes) -> bool:
        if body == b"hang":  # as a server whose keep-alive timer fired just as the request came
            return False
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    log: list[tuple[int, bytes]] = []
    server, url = await _server(answer, log)
    client = RelayClient(connect_timeout=5, idle_s=2)
    try:
        async with client.post(url, b"first") as resp:
            assert await resp.text() == "ok"
        # sent on the pooled connection, hung up, sent once more on a new one, hung up: an error
        with pytest.raises(TransportConnectionError):
            async with client.post(url, b"hang") as resp:
                pass
        async with client.post(url, b"x") as resp:
            assert await resp.text() == "ok"
    finally:
        await client.close()
        server.close()
    assert log == [(1, b"first"), (1, b"hang"), (2, b"hang"), (3, b"x")]


async def test_the_keep_alive_race_is_retried_once_on_a_new_connection() -> None:
    served = 0

    async def answer(w: asyncio.StreamWriter, body: bytes) -> bool:
        nonlocal served
        served += 1
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        return False  # hangs up after each answer, without saying so (no Connection: close)

    log: list[tuple[int, bytes]] = []
    server, url = await _server(answer, log)
    client = RelayClient(connect_timeout=5, idle_s=2)
    try:
        for i in range(4):
            async with client.post(url, b"%d" % i) as resp:
                assert await resp.text() == "ok"
    finally:
        await client.close()
        server.close()
    assert [b for _, b in log] == [b"0", b"1", b"2", b"3"]  # each answered once, none failed


async def test_an_answer_cut_short_raises_a_payload_error_and_leaving_early_closes() -> None:
    async def answer(w: asyncio.StreamWriter, body: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n5\r\nhel")
        await w.drain()
        return body == b"wait"  # "cut": hang up mid-chunk; "wait": keep the stream open

    log: list[tuple[int, bytes]] = []
    server, url = await _server(answer, log)
    client = RelayClient(connect_timeout=5, idle_s=2)
    try:
        got: list[bytes] = []
        with pytest.raises(TransportError):
            async with client.post(url, b"cut") as resp:
                async for piece in resp.chunks():
                    got.append(piece)
        assert got == [b"hel"]  # the whole chunk was handed on, then the error
        async with client.post(url, b"wait") as resp:
            async for piece in resp.chunks():
                assert piece == b"hel"
                break  # a client that went away: the connection is closed, not pooled
        async with client.post(url, b"cut") as resp:
            assert resp.status == 200
    finally:
        await client.close()
        server.close()
    assert [c for c, _ in log] == [1, 2, 3]


async def test_an_unreachable_server_is_a_connection_error() -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = RelayClient(connect_timeout=5, idle_s=2)
    with pytest.raises(TransportConnectionError) as got:
        async with client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}"):
            pass
    assert not isinstance(got.value, TimeoutError)
    with pytest.raises(ValueError, match="plain http"):
        async with client.post("https://example.invalid/v1/completions", b"{}"):
            pass
    assert issubclass(aiohttp.ConnectionTimeoutError, TimeoutError)  # what a connect timeout raises


async def _heads_server(heads: list[bytes], body_bytes: int) -> asyncio.Server:
    """A server that keeps each request's head, reads its body and answers an empty 200."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        await reader.readexactly(body_bytes)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_the_request_head_names_the_host_and_credentials_in_the_url() -> None:
    heads: list[bytes] = []
    server = await _heads_server(heads, 2)
    port = server.sockets[0].getsockname()[1]
    client = RelayClient(connect_timeout=5, idle_s=2)
    try:
        async with client.post(f"http://u%40x:pw@127.0.0.1:{port}/base/v1/completions?a=1", b"{}") as resp:
            assert resp.status == 200 and await resp.text() == ""
    finally:
        await client.close()
        server.close()
    assert heads == [b"POST /base/v1/completions?a=1 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                     b"Authorization: Basic dUB4OnB3\r\nAccept: */*\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\n\r\n" % port]


async def test_a_body_that_is_not_json_goes_with_its_own_content_type() -> None:
    """An audio form names its Content-Type among the request's headers: it replaces the JSON default, once; a pair
    that would split the request is dropped."""
    heads: list[bytes] = []
    server = await _heads_server(heads, 3)
    port = server.sockets[0].getsockname()[1]
    client = RelayClient(connect_timeout=5, idle_s=2)
    form = ("Content-Type", "multipart/form-data; boundary=xyz")
    try:
        for headers in ((form, ("x-request-id", "r1")), (("x-evil", "a\r\nX-Injected: 1"), ("x-request-id", "r2"))):
            async with client.post(f"http://127.0.0.1:{port}/v1/audio/transcriptions", b"abc", headers) as resp:
                assert resp.status == 200
    finally:
        await client.close()
        server.close()
    base = b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAccept: */*\r\n" % port
    assert heads == [base + b"Content-Type: multipart/form-data; boundary=xyz\r\nx-request-id: r1\r\n"
                            b"Content-Length: 3\r\n\r\n",
                     base + b"x-request-id: r2\r\nContent-Type: application/json\r\nContent-Length: 3\r\n\r\n"]
