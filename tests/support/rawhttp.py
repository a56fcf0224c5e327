"""Raw HTTP/1.1 over a socket, for requests no well-behaved client sends (lying Content-Length,
trickled bytes, garbage request lines). Every read is bounded by a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field


@dataclass
class Reply:
    status: int | None  # None: the server closed the connection without answering
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    elapsed: float = 0.0

    def json(self) -> dict:
        return json.loads(self.body)


def request(path: str, body: bytes = b"", *, method: str = "POST", ctype: str | None = "application/json",
            headers: dict[str, str] | None = None, length: int | None = None, close: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if ctype is not None:
        lines.append(f"Content-Type: {ctype}")
    if close:
        lines.append("Connection: close")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if method != "GET" or body:
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_reply(reader: asyncio.StreamReader, timeout: float) -> Reply:
    """One response (status, headers, Content-Length body), or status None when the server hung up."""
    t0 = time.monotonic()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except asyncio.IncompleteReadError:
        return Reply(None, elapsed=time.monotonic() - t0)
    except ConnectionResetError:
        return Reply(None, elapsed=time.monotonic() - t0)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(n), timeout) if n else b""
    return Reply(int(status_line.split()[1]), headers, body, time.monotonic() - t0)


async def exchange(port: int, pieces: bytes | list[bytes], *, pause: float = 0.0, timeout: float = 10.0) -> Reply:
    """Send ``pieces`` (``pause`` seconds apart) while waiting for one reply; ``elapsed`` is when the
    reply (or the hang-up) came, from the first byte sent. Sending stops there."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        for i, piece in enumerate([pieces] if isinstance(pieces, bytes) else pieces):
            if i and pause:
                await asyncio.sleep(pause)
            writer.write(piece)
            await writer.drain()

    t0 = time.monotonic()
    sending = asyncio.create_task(send())
    try:
        reply = await read_reply(reader, timeout)
        reply.elapsed = time.monotonic() - t0
        return reply
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sending
        writer.close()
