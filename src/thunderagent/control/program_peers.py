"""Program releases between the frontends of one bus (``thunderagent frontend``, several replicas).

Each frontend keeps its own program table (README: "Many processes over NATS"), so a client's
``POST /v1/programs/{id}/release`` may reach a frontend that never saw the program, while the
frontend(s) that ran its requests keep it (paced, pinned, counted) until its idle TTL. A release is
therefore told to every frontend: the one the client asked releases its own copy and publishes the
release on ``<p>.programs.release``; every other frontend holding the program releases its copy
too, and answers the message's reply subject. The asking frontend answers the client 200 when it or
any other released a copy; when it held none, it waits for a first answer up to ``timeout`` (the
others answer within milliseconds) and answers 404 without one.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import msgspec

from thunderagent.bus.nats import Bus, BusError, BusMsg
from thunderagent.bus.wire import ProgramRelease, Subjects, decode_program_release, encode

log = logging.getLogger(__name__)

#: how long a frontend that held no copy waits for another frontend to say it released one
RELEASE_TIMEOUT_S = 0.5


class ProgramPeers:
    def __init__(self, bus: Bus, subjects: Subjects, frontend_id: str, timeout: float = RELEASE_TIMEOUT_S) -> None:
        self.bus = bus
        self.subjects = subjects
        self.frontend_id = frontend_id
        self.timeout = timeout
        self.released_for_peers = 0  # copies this frontend released on another frontend's word
        self._release: Callable[[str], bool] | None = None

    async def start(self, release: Callable[[str], bool]) -> None:
        """``release``: forget a program of this frontend's table by key (False: unknown here)."""
        self._release = release
        await self.bus.subscribe(self.subjects.program_release(), self._on_release)

    def tell(self, key: str) -> None:
        """This frontend released its copy of ``key``: the others release theirs (no answer awaited)."""
        self.bus.publish(self.subjects.program_release(), encode(ProgramRelease(self.frontend_id, key)))

    async def release_elsewhere(self, key: str) -> bool:
        """This frontend holds no copy of ``key``: did another frontend hold one (and release it)?"""
        reply = self.subjects.program_reply(self.frontend_id, secrets.token_hex(6))
        try:
            await self.bus.request_many(self.subjects.program_release(),
                                        encode(ProgramRelease(self.frontend_id, key)), self.timeout,
                                        lambda _msg: True, reply)
        except (TimeoutError, BusError):  # no frontend held it (or none but this one listens)
            return False
        return True

    async def _on_release(self, msg: BusMsg) -> None:
        try:
            rel = decode_program_release(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("program release on %s: undecodable message ignored", msg.subject)
            return
        if rel.origin == self.frontend_id or self._release is None:
            return  # our own broadcast comes back to us
        if self._release(rel.key):
            self.released_for_peers += 1
            if msg.reply:
                self.bus.publish(msg.reply, b"released")

