"""Per-tenant limits shared by the frontends of one bus (``thunderagent frontend``, several replicas).

Each frontend admits its own clients' requests against its own buckets (``scheduler/tenant_limits.py``).
For a tenant's ``control_plane.tenant_limits`` to hold across the frontends rather than per frontend,
each one reports, every ``REPORT_INTERVAL_S``, what its tenants took since its last report, how
many of their requests it has in flight and how many of their agent programs have one
(``<p>.tenants.usage``), and takes every other frontend's report from its own buckets, in-flight
bound and program cap. Between two reports the frontends do not see each
other's admissions: a tenant may overshoot its limits by what the other frontends admit within one
interval. A frontend that stops (or loses the bus) stops reporting; its in-flight count stops counting
elsewhere after ``tenant_limits.PEER_TTL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

import msgspec

from thunderagent.bus.nats import Bus, BusMsg
from thunderagent.bus.wire import Subjects, TenantUsage, TenantUse, decode_tenant_usage, encode
from thunderagent.scheduler.tenant_limits import Usage

log = logging.getLogger(__name__)

#: how often a frontend reports its tenants' use (seconds): the most the others lag behind it
REPORT_INTERVAL_S = 0.1


class _Limiter(Protocol):
    def report(self) -> list[Usage]: ...
    def absorb(self, origin: str, use: Usage, now: float) -> None: ...


class TenantPeers:
    def __init__(self, bus: Bus, subjects: Subjects, frontend_id: str, interval: float = REPORT_INTERVAL_S) -> None:
        self.bus = bus
        self.subjects = subjects
        self.frontend_id = frontend_id
        self.interval = interval
        self.reports_sent = 0
        self.reports_taken = 0  # other frontends' reports applied here
        self._limiter: _Limiter | None = None
        self._clock: Callable[[], float] = lambda: 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self, limiter: _Limiter, clock: Callable[[], float]) -> None:
        """Share ``limiter``'s tenants with the other frontends (``clock``: the limiter's ``now``)."""
        self._limiter, self._clock = limiter, clock
        await self.bus.subscribe(self.subjects.tenant_usage(), self._on_usage)
        self._task = asyncio.create_task(self._reports(), name="tenant-usage")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.report()  # what was taken since the last report still counts elsewhere

    def report(self) -> None:
        """Publish what changed since the last report (nothing when nothing did)."""
        if self._limiter is None:
            return
        uses = self._limiter.report()
        if uses:
            wire = [TenantUse(u.tenant, u.requests, u.tokens, u.in_flight, u.programs) for u in uses]
            self.bus.publish(self.subjects.tenant_usage(), encode(TenantUsage(self.frontend_id, wire)))
            self.reports_sent += 1

    async def _reports(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.report()

    async def _on_usage(self, msg: BusMsg) -> None:
        try:
            usage = decode_tenant_usage(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("tenant usage on %s: undecodable message ignored", msg.subject)
            return
        limiter = self._limiter
        if usage.origin == self.frontend_id or limiter is None:
            return  # our own report comes back to us
        now = self._clock()
        for u in usage.uses:
            limiter.absorb(usage.origin, Usage(u.tenant, u.requests, u.tokens, u.in_flight, u.programs), now)
        self.reports_taken += 1
