"""A frontend's heartbeat on the bus, and the other frontends' (``thunderagent frontend``, several replicas).

Every ``control_plane.heartbeat_interval`` a frontend publishes a :class:`~thunderagent.bus.wire.FrontendBeat`
on ``<p>.frontend.<id>.hb``. Workers read the subject only: it is the lease of the frontend's requests (they
abort them when it stops). Frontends read every beat, their own included, to agree on which of them acts
for the scaling planner (:class:`~thunderagent.control.leadership.Leadership`): the others only advise.
Frontends' NATS users need to subscribe to ``<p>.frontend.*.hb`` for that (README: "Security"); one that
cannot hears not even its own beat and acts alone (``/v1/planner`` says ``deaf``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec

from thunderagent.bus.nats import Bus, BusMsg
from thunderagent.bus.wire import FrontendBeat, Subjects, decode_frontend_beat, encode
from thunderagent.control.leadership import Leadership

log = logging.getLogger(__name__)


class FrontendBeats:
    def __init__(self, bus: Bus, subjects: Subjects, frontend_id: str) -> None:
        self.bus = bus
        self.subjects = subjects
        self.frontend_id = frontend_id
        self.started_at = time.time()  # wall clock: comparable with other hosts' (only to order starts)
        self.leadership: Leadership | None = None
        self.ignored = 0  # beats that did not decode (another version, or not a frontend)
        self._clock: Callable[[], float] = lambda: 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self, interval: float, lease: float, planner_acts: bool, clock: Callable[[], float],
                    copies: bool = False) -> None:
        """Beat every ``interval`` seconds; a frontend silent for ``lease`` is gone (``clock``: the fleet's);
        ``copies``: this frontend runs cache migration (one of those that do plans the copies)."""
        self._clock = clock
        self.leadership = Leadership(self.frontend_id, self.started_at, planner_acts, lease, clock(), copies)
        await self.bus.subscribe(self.subjects.frontend_beats(), self._on_beat)
        body = encode(FrontendBeat(self.started_at, planner_acts, copies))
        self._task = asyncio.create_task(self._beat(interval, body), name="frontend-beat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _beat(self, interval: float, body: bytes) -> None:
        subject = self.subjects.frontend_beat(self.frontend_id)
        while True:
            self.bus.publish(subject, body)
            await asyncio.sleep(interval)

    async def _on_beat(self, msg: BusMsg) -> None:
        parts = msg.subject.split(".")
        if len(parts) < 2 or self.leadership is None:
            return
        try:
            beat = decode_frontend_beat(msg.data)
        except msgspec.DecodeError:
            self.ignored += 1
            if self.ignored == 1:
                log.warning("a frontend beat on %s did not decode (a frontend of another version?): ignored; "
                            "that frontend does not count for the planner's leadership", msg.subject)
            return
        self.leadership.heard(parts[-2], beat.started_at, beat.planner_acts, self._clock(), beat.copies)
