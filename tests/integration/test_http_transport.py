"""The engine transport's streamed POSTs never ride on a pooled connection.

A server closes an idle keep-alive connection after a while (vLLM's uvicorn: 5 s); a POST written on
one as it closes fails ("Can not write request body") and aiohttp does not retry a POST. Seen with
100 streams on real vLLM under load: the failed request took the surviving worker out of routing.
The server here makes that race certain: it answers the first request on a connection and hangs up
on any second one without answering.
"""

from __future__ import annotations

import asyncio
import json

from thunderagent.execution.http_transport import AiohttpTransport

BODY = b'data: {"ok": true}\n\ndata: [DONE]\n\n'


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[int]) -> None:
    n = 0
    try:
        while True:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            n += 1
            seen.append(n)
            if n > 1:  # a reused connection: hang up, as a server whose keep-alive timer just fired
                return
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            json.loads(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
            await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


async def test_each_streamed_post_opens_its_own_connection() -> None:
    seen: list[int] = []
    server = await asyncio.start_server(lambda r, w: _serve(r, w, seen), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = AiohttpTransport(connect_timeout=5)
    transport.open()
    try:
        for i in range(5):
            async with transport.stream_post(f"http://127.0.0.1:{port}/v1/completions", {"i": i}) as resp:
                assert resp.status == 200
                assert [line async for line in resp.lines()] == BODY.splitlines(keepends=True)
            await asyncio.sleep(0.01)  # the response is done: a pooled connection would be idle now
        assert seen == [1] * 5, f"requests per connection: {seen}"
    finally:
        await transport.close()
        server.close()
        await server.wait_closed()
