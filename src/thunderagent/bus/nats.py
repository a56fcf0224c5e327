"""The message bus between frontends and workers: a thin, ordered wrapper over nats-py.

Frontends and workers talk to a :class:`Bus` (publish / subscribe / request-many), never to
nats-py directly, so their logic runs in tests on an in-memory bus and nats-py stays an optional
dependency (``pip install 'thunderagent[nats]'``; imported only when a NatsBus connects).

Ordering: ``publish`` is synchronous and enqueues; one sender task publishes in enqueue order. The
control plane's callbacks are synchronous (``WorkerCallbacks``), and this is what keeps "events
before the heartbeat that counts them" and "generate before its abort" true on the wire.

Loss: NATS core is at-most-once. Nothing here retries; the protocol above detects loss instead
(per-worker event seq, per-stream message counter, heartbeat leases, request keepalives).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: sender queue length at which a warning is logged (the bus is slower than its publishers)
_OUTBOX_WARN = 10_000


class BusError(RuntimeError):
    """The bus is unreachable or refused an operation."""


@dataclass(slots=True, frozen=True)
class BusMsg:
    subject: str
    data: bytes
    reply: str = ""
    #: NATS answered a request with "no responders": nobody subscribes to the subject
    no_responders: bool = False


Handler = Callable[[BusMsg], Awaitable[None]]


class Bus(Protocol):
    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    async def subscribe(self, subject: str, handler: Handler) -> None:
        """Handle every message on ``subject`` (wildcards allowed), one at a time, in order."""

    def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        """Enqueue a message; messages leave in enqueue order. Never blocks, never raises for a
        message the server would refuse (it is logged and dropped)."""

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until everything enqueued so far reached the server."""

    async def request_many(
        self, subject: str, data: bytes, timeout: float, done: Callable[[BusMsg], bool]
    ) -> list[BusMsg]:
        """Publish with a private reply subject and collect replies until ``done(reply)`` is true.
        Raises TimeoutError after ``timeout`` seconds, BusError on no responders."""


class NatsBus:
    """:class:`Bus` over a NATS server (nats-py), reconnecting forever once connected."""

    def __init__(self, url: str, name: str, connect_timeout: float = 10.0) -> None:
        self.url = url
        self.name = name
        self.connect_timeout = connect_timeout
        self._nc: Any = None
        self._out: asyncio.Queue[tuple[str, bytes, str]] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        self._busy = False  # the sender holds a message it has not handed to nats-py yet
        self._closing = False

    async def connect(self) -> None:
        try:
            import nats
        except ImportError as exc:
            raise BusError("the NATS deployment needs nats-py: pip install 'thunderagent[nats]'") from exc

        async def on_error(exc: Exception) -> None:
            log.warning("nats (%s): %s", self.name, exc)

        async def on_disconnect() -> None:
            if self._closing:
                return
            log.warning("nats (%s): disconnected from %s, reconnecting", self.name, self.url)

        async def on_reconnect() -> None:
            log.info("nats (%s): reconnected", self.name)

        try:
            # With unlimited reconnects nats-py retries the first connection forever too: bound it here.
            async with asyncio.timeout(self.connect_timeout):
                self._nc = await nats.connect(
                    servers=[self.url], name=self.name, connect_timeout=2, allow_reconnect=True,
                    max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=on_error,
                    disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
                )
        except TimeoutError as exc:
            raise BusError(f"cannot connect to NATS at {self.url} within {self.connect_timeout:g}s") from exc
        self._sender = asyncio.create_task(self._send(), name=f"nats-sender-{self.name}")

    async def close(self) -> None:
        if self._nc is None:
            return
        self._closing = True
        with contextlib.suppress(Exception):
            await self.flush(2.0)
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        with contextlib.suppress(Exception):
            await self._nc.close()
        self._nc = None

    async def subscribe(self, subject: str, handler: Handler) -> None:
        async def cb(msg: Any) -> None:
            status = msg.headers.get("Status") if msg.headers else None
            bm = BusMsg(msg.subject, msg.data, msg.reply or "", status == "503")
            try:
                await handler(bm)
            except Exception:  # one bad message must not end the subscription
                log.exception("handler for %s failed on %s", subject, msg.subject)

        await self._nc.subscribe(subject, cb=cb)
        await self._nc.flush(timeout=5)  # the server has the interest before we announce ourselves

    def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        self._out.put_nowait((subject, data, reply))
        if self._out.qsize() == _OUTBOX_WARN:
            log.warning("nats (%s): %d messages waiting to be sent", self.name, _OUTBOX_WARN)

    async def flush(self, timeout: float = 2.0) -> None:
        async def drained() -> None:
            while not self._out.empty() or self._busy:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(drained(), timeout)
        await self._nc.flush(timeout=max(1, int(timeout)))

    async def _send(self) -> None:
        out = self._out
        while True:
            subject, data, reply = await out.get()
            self._busy = True
            try:
                await self._nc.publish(subject, data, reply=reply)
            except Exception as exc:  # payload too large, closed, buffer full while reconnecting
                log.warning("nats (%s): dropped a message to %s (%d bytes): %r", self.name, subject, len(data), exc)
            finally:
                self._busy = False

    async def request_many(
        self, subject: str, data: bytes, timeout: float, done: Callable[[BusMsg], bool]
    ) -> list[BusMsg]:
        nc = self._nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            self.publish(subject, data, reply=inbox)
            replies: list[BusMsg] = []
            async with asyncio.timeout(timeout):
                while True:
                    msg = await sub.next_msg(timeout=None)
                    status = msg.headers.get("Status") if msg.headers else None
                    if status == "503":
                        raise BusError(f"no responders on {subject}")
                    bm = BusMsg(msg.subject, msg.data, msg.reply or "")
                    replies.append(bm)
                    if done(bm):
                        return replies
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
