"""``/abort_requests`` across the frontends of one bus (``thunderagent frontend``, several replicas).

Each frontend holds its own requests in its own scheduler (holding queue, prefix grouping, paused programs), and a
held request is on no server yet, so the servers' abort cannot end it. An RL trainer's ``/abort_requests`` reaches
one frontend (behind a load balancer, any of them); that frontend ends its own held requests
(``Fleet.abort_held``) and asks every other live frontend (``<p>.frontend.abort_held``, ``bus.wire_admin``) to end
theirs, waiting for as many answers as it heard frontends beat within a lease (``control/leadership.py``), at most
``timeout``. The answer counts them all (``held_aborted``); a frontend that did not answer in time is not counted
(its held requests end all the same once the message reaches it).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import msgspec

from thunderagent.bus.nats import Bus, BusError, BusMsg
from thunderagent.bus.wire import Subjects, encode
from thunderagent.bus.wire_admin import HeldAbort, HeldAborted, decode_held_abort, decode_held_aborted

log = logging.getLogger(__name__)

#: how long the frontend asked waits for the others' answers (they answer within milliseconds)
ABORT_TIMEOUT_S = 1.0


class AbortPeers:
    def __init__(self, bus: Bus, subjects: Subjects, frontend_id: str, live: Callable[[], int],
                 timeout: float = ABORT_TIMEOUT_S) -> None:
        """``live``: how many other frontends are live now (the answers to wait for)."""
        self.bus = bus
        self.subjects = subjects
        self.frontend_id = frontend_id
        self.live = live
        self.timeout = timeout
        self.aborted_for_peers = 0  # held requests this frontend ended on another frontend's word
        self._abort: Callable[[list[str] | None], int] | None = None

    async def start(self, abort: Callable[[list[str] | None], int]) -> None:
        """``abort``: end this frontend's held requests that the ids name (None: all); how many ended."""
        self._abort = abort
        await self.bus.subscribe(self.subjects.held_abort(), self._on_abort)

    async def abort_elsewhere(self, ids: list[str] | None) -> int:
        """The other frontends end their held requests that ``ids`` names (None: all): how many they ended."""
        expected = self.live()
        if expected <= 0:
            return 0
        ended: list[int] = []

        def answered(msg: BusMsg) -> bool:
            try:
                ended.append(decode_held_aborted(msg.data).ended)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("held abort: an undecodable answer on %s ignored", msg.subject)
            return len(ended) >= expected

        reply = self.subjects.match_reply(self.frontend_id, secrets.token_hex(6))
        try:
            await self.bus.request_many(self.subjects.held_abort(), encode(HeldAbort(self.frontend_id, ids)),
                                        self.timeout, answered, reply)
        except TimeoutError:
            log.warning("held abort: %d of %d other frontends answered within %.1fs", len(ended), expected,
                        self.timeout)
        except BusError:  # no other frontend listens (they left since their last beat)
            pass
        return sum(ended)

    async def _on_abort(self, msg: BusMsg) -> None:
        try:
            ask = decode_held_abort(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("held abort on %s: undecodable message ignored", msg.subject)
            return
        if ask.origin == self.frontend_id or self._abort is None:
            return  # our own ask comes back to us
        n = self._abort(ask.ids)
        self.aborted_for_peers += n
        if msg.reply:
            self.bus.publish(msg.reply, encode(HeldAborted(n)))
