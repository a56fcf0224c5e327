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
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: sender queue length at which a warning is logged (the bus is slower than its publishers)
_OUTBOX_WARN = 10_000
#: nats-server's default max_payload
DEFAULT_MAX_PAYLOAD = 1024 * 1024


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
    #: largest message the server accepts (NATS's max_payload; 1 MiB by default), known once connected
    max_payload: int

    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    async def subscribe(self, subject: str, handler: Handler) -> None:
        """Handle every message on ``subject`` (wildcards allowed), one at a time, in order."""

    async def unsubscribe(self, subject: str) -> None:
        """Stop handling ``subject`` (every subscription made to exactly that subject)."""

    def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        """Enqueue a message; messages leave in enqueue order. Never blocks, never raises for a
        message the server would refuse (it is logged and dropped)."""

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until everything enqueued so far reached the server."""

    async def request_many(
        self, subject: str, data: bytes, timeout: float, done: Callable[[BusMsg], bool], reply: str
    ) -> list[BusMsg]:
        """Publish with the reply subject ``reply`` (unique to this call) and collect replies until
        ``done(reply)`` is true. Raises TimeoutError after ``timeout`` seconds, BusError on no
        responders."""


class NatsBus:
    """:class:`Bus` over a NATS server or cluster (nats-py), reconnecting forever once connected.

    ``options`` are further ``nats.connect`` arguments: TLS context and credentials
    (:func:`thunderagent.bus.connect.connect_options` builds them from the config)."""

    def __init__(self, servers: str | list[str], name: str, connect_timeout: float = 10.0,
                 options: dict[str, Any] | None = None) -> None:
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.url = ",".join(self.servers)
        self.name = name
        self.connect_timeout = connect_timeout
        self.options = dict(options or {})
        self._nc: Any = None
        self._out: asyncio.Queue[tuple[str, bytes, str]] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        self._subs: dict[str, list[Any]] = {}  # subject -> its nats-py subscriptions (unsubscribe)
        self._busy = False  # the sender holds a message it has not handed to nats-py yet
        self._closing = False

    @property
    def max_payload(self) -> int:
        return DEFAULT_MAX_PAYLOAD if self._nc is None else int(self._nc.max_payload)

    async def connect(self) -> None:
        try:
            import nats
            from nats.errors import AuthorizationError
        except ImportError as exc:
            raise BusError("the NATS deployment needs nats-py: pip install 'thunderagent[nats]'") from exc
        refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def on_error(exc: Exception) -> None:
            # Refused credentials or an unverifiable server do not get better by retrying: the first
            # connection fails at once, naming why (a client that was connected keeps retrying).
            if self._nc is None and not refused.done() and _is_refusal(exc, AuthorizationError):
                refused.set_result(exc)
            log.warning("nats (%s): %s", self.name, exc)

        async def on_disconnect() -> None:
            if self._closing:
                return
            log.warning("nats (%s): disconnected from %s, reconnecting", self.name, self.url)

        async def on_reconnect() -> None:
            log.info("nats (%s): reconnected", self.name)

        connecting = asyncio.ensure_future(nats.connect(
            servers=self.servers, name=self.name, connect_timeout=2, allow_reconnect=True,
            max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=on_error,
            disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, **self.options,
        ))
        # With unlimited reconnects nats-py retries the first connection forever too: bound it here.
        done, _ = await asyncio.wait({connecting, refused}, timeout=self.connect_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if connecting not in done:
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            if refused in done:
                raise BusError(f"NATS at {self.url} refused {self.name}: {refused.result()!r}")
            raise BusError(f"cannot connect to NATS at {self.url} within {self.connect_timeout:g}s")
        self._nc = connecting.result()
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
            # nats-py runs a subscription as one task that takes its next message without suspending
            # while any is pending, and most handlers never suspend: under a backlog (KV events
            # faster than this process applies them) that task kept the loop to itself, and this
            # frontend's heartbeat (its requests' lease), HTTP and other subscriptions starved for
            # seconds (bench/nats_events.py found it). One yield per message; order is unchanged.
            await asyncio.sleep(0)

        self._subs.setdefault(subject, []).append(await self._nc.subscribe(subject, cb=cb))
        await self._nc.flush(timeout=5)  # the server has the interest before we announce ourselves

    async def unsubscribe(self, subject: str) -> None:
        for sub in self._subs.pop(subject, []):
            with contextlib.suppress(Exception):  # (closing, or the connection went: nothing to stop)
                await sub.unsubscribe()

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
        self, subject: str, data: bytes, timeout: float, done: Callable[[BusMsg], bool], reply: str
    ) -> list[BusMsg]:
        # The reply subject is the caller's, not a NATS _INBOX: a worker may publish only under its
        # own name, and its replies must be told from another worker's (see bus/wire.py).
        sub = await self._nc.subscribe(reply)
        try:
            self.publish(subject, data, reply=reply)
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


def _is_refusal(exc: Exception, auth_error: type[Exception]) -> bool:
    """The server refused our credentials, or TLS failed (certificate not trusted, no TLS there)."""
    text = str(exc).lower()
    return (isinstance(exc, (auth_error, ssl.SSLError)) or "authorization violation" in text
            or "authentication" in text or "tls" in text)
