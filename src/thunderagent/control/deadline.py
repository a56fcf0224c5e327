"""A request's deadline (``control_plane.request_timeout_s``): one not finished this long after it arrived is
ended by the fleet, whatever holds it up (its time held in the scheduler counts).

Why: liveness (``control/liveness.py``) ends requests whose worker went silent, but a server can stay alive (its
polls answered, its keepalives flowing) while a request on it never progresses: a hung accelerator, a wedged
engine loop. Without a deadline such a request, and its client, waits forever.

A request past its deadline is aborted on its worker and ends ``ERROR`` there, marked ``timed_out``: it is
neither routed again nor migrated (its time is up everywhere). The frontend answers 504 (``request_timeout``) when
nothing was sent yet; a stream that already began ends with an error event. One timer per request, armed when it
is launched and cancelled when it ends (no per-token work).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Counter

from thunderagent.control.generation import Generation

#: the fleet's reason for a request it ended at its deadline (``Generation.lost``)
TIMED_OUT = "request_timeout"


class DeadlineExceeded(Exception):
    """A request ended at its deadline before anything reached its client (the frontend's 504)."""

    def __init__(self, timeout_s: float | None) -> None:
        super().__init__(timeout_message(timeout_s))
        self.timeout_s = timeout_s


class Deadlines:
    """Arms each launched request's deadline; ``end(gen)`` ends one past it (the fleet's cut)."""

    def __init__(self, timeout_s: float | None, end: Callable[[Generation, str], None],
                 registry: CollectorRegistry) -> None:
        self.timeout_s = timeout_s
        self._end = end
        self.expired = Counter("thunderagent_request_timeouts", "requests ended at control_plane.request_timeout_s",
                               registry=registry)

    def arm(self, gen: Generation, now: float) -> None:
        """``gen`` launched at ``now`` (fleet time): its timer, due at its arrival + the timeout."""
        if self.timeout_s is not None:
            delay = max(0.0, gen.received + self.timeout_s - now)
            gen.timer = asyncio.get_running_loop().call_later(delay, self._expire, gen)

    def _expire(self, gen: Generation) -> None:
        # (a request whose last output is queued but not read yet may be cut too: its consumer reads that output
        # first, and the frontend judges a request by its last output, not by the flag alone)
        gen.timer = None
        gen.timed_out = True
        self.expired.inc()
        self._end(gen, TIMED_OUT)

    @contextlib.asynccontextmanager
    async def held(self, received: float, now: float) -> AsyncIterator[None]:
        """Around a held request's wait for dispatch: at its deadline the wait is cancelled (the caller's cleanup
        runs: it leaves the queue) and :class:`DeadlineExceeded` is raised."""
        if self.timeout_s is None:
            yield
            return
        try:
            async with asyncio.timeout(max(0.0, received + self.timeout_s - now)):
                yield
        except TimeoutError:
            self.expired.inc()
            raise DeadlineExceeded(self.timeout_s) from None

    @staticmethod
    def disarm(gen: Generation) -> None:
        if gen.timer is not None:
            gen.timer.cancel()
            gen.timer = None


def timeout_message(timeout_s: float | None) -> str:
    return f"the request did not finish within control_plane.request_timeout_s ({timeout_s:g} s); it was aborted"
