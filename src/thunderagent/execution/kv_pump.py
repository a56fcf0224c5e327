"""The KV-event pump of one engine server: ZMQ sockets in, our events published.

A SUB socket on the engine's PUB endpoint receives live batches; a DEALER socket on its replay ROUTER
endpoint (when there is one) asks for the batches a gap missed. Frames go through a
:class:`~thunderagent.execution.kv_stream.KvEventStream` (gaps, duplicates, replay, restarts), and
each :class:`~thunderagent.execution.kv_stream.StreamStep` it returns is handed to the publish
callback. Each time the SUB socket's handshake with the engine completes (the first connect, a
reconnect after a drop), the pump asks for a replay from the next expected seq
(:meth:`~thunderagent.execution.kv_stream.KvEventStream.catch_up`): batches the engine published
before our subscription took effect are otherwise only noticed when a later batch arrives.

Needs the ``engines`` extra (pyzmq), imported only once a pump runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from thunderagent.execution.kv_stream import KvEventStream, StreamStep

log = logging.getLogger(__name__)

#: batches read from one socket before the loop yields, so a burst cannot starve request handling
_DRAIN = 1000


def require_pyzmq() -> None:
    try:
        import zmq.asyncio  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("KV events need pyzmq: pip install -e '.[engines]'") from exc


class KvPump:
    """Feeds ``stream`` from the engine's ``events`` (PUB) and ``replay`` (ROUTER) endpoints."""

    def __init__(self, worker_id: str, events: str, replay: str | None, stream: KvEventStream,
                 publish: Callable[[StreamStep], None], *, replay_timeout: float) -> None:
        self.worker_id = worker_id
        self.events = events
        self.replay = replay
        self.stream = stream
        self._publish = publish
        self._replay_timeout = replay_timeout
        self._dealer: Any = None
        self._deadline: float | None = None  # replay answer expected by then

    async def events_loop(self) -> None:
        import zmq.asyncio

        loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context()
        try:
            sub, dealer, monitor, poller = self._connect(ctx)
            self._dealer, self._deadline = dealer, None
            while True:
                deadline = self._deadline
                timeout_ms = None if deadline is None else max(0, int((deadline - loop.time()) * 1000))
                ready = dict(await poller.poll(timeout_ms))
                if monitor is not None and monitor in ready:
                    await self._drain(monitor, self._on_connected)
                if dealer is not None and dealer in ready:
                    await self._drain(dealer, self._on_replay)
                if sub in ready:
                    await self._drain(sub, self._on_live)
                if self._deadline is not None and loop.time() >= self._deadline and self.stream.replaying:
                    log.warning("%s: replay endpoint %s did not answer within %.1fs: resyncing", self.worker_id,
                                self.replay, self._replay_timeout)
                    self._handle(self.stream.replay_failed())
                    self._deadline = None
        finally:
            self._dealer = None
            ctx.destroy(linger=0)

    def _connect(self, ctx: Any) -> tuple[Any, Any, Any, Any]:
        """The SUB socket, the DEALER socket and the SUB's handshake monitor (both None without a replay
        endpoint), and a poller on them."""
        import zmq
        import zmq.asyncio

        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        dealer = monitor = None
        if self.replay:
            # the monitor is attached before the SUB connects: a loopback handshake can complete before
            # the next line runs, and a handshake the monitor did not see asks for no catch-up
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            poller.register(monitor, zmq.POLLIN)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay)
            poller.register(dealer, zmq.POLLIN)
        sub.connect(self.events)
        return sub, dealer, monitor, poller

    @staticmethod
    async def _drain(sock: Any, on_frames: Callable[[Sequence[bytes]], None]) -> None:
        import zmq

        for _ in range(_DRAIN):
            try:
                frames = await sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            on_frames(frames)

    def _on_connected(self, frames: Sequence[bytes]) -> None:
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        if parse_monitor_message(list(frames))["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            log.debug("%s: subscribed to %s: asking for what was published before", self.worker_id, self.events)
            self._handle(self.stream.catch_up())

    def _on_live(self, frames: Sequence[bytes]) -> None:
        self._handle(self.stream.on_live(frames))

    def _on_replay(self, frames: Sequence[bytes]) -> None:
        if self.stream.replaying:
            self._deadline = asyncio.get_running_loop().time() + self._replay_timeout  # still answering
        self._handle(self.stream.on_replay(frames))

    def _handle(self, step: StreamStep) -> None:
        self._publish(step)
        if step.replay_from is not None and self._dealer is not None:
            self._dealer.send_multipart([b"", step.replay_from.to_bytes(8, "big")])
            self._deadline = asyncio.get_running_loop().time() + self._replay_timeout
        elif not self.stream.replaying:
            self._deadline = None
