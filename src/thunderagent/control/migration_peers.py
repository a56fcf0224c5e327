"""Cache migration's demand shared by the frontends of one bus (``routing.migration`` with NATS frontends).

One frontend plans the copies (``Leadership.copying``), but each frontend sees only the requests it routes.
So every ``routing.migration.interval_s`` each frontend running migration reports its most-demanded prefixes
on ``<p>.frontend.<id>.demand`` (:class:`~thunderagent.bus.wire_migration.MigrationDemand`), and each takes the
others' reports into its migrator (:meth:`~thunderagent.transfer.migration.Migrator.peer_demand`): the planning
one then ranks and thresholds prefixes on the fleet's demand. A report is a few KiB at most (64 keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from thunderagent.bus.nats import Bus, BusMsg
from thunderagent.bus.wire import Subjects, encode
from thunderagent.bus.wire_migration import MigrationDemand, all_demand, decode_migration_demand, demand_subject
from thunderagent.transfer.migration import Migrator

log = logging.getLogger(__name__)


class MigrationPeers:
    def __init__(self, bus: Bus, subjects: Subjects, frontend_id: str, migrator: Migrator) -> None:
        self.bus = bus
        self.subjects = subjects
        self.frontend_id = frontend_id
        self.migrator = migrator
        self.ignored = 0  # reports that did not decode, or named another frontend than their subject
        self._clock: Callable[[], float] = lambda: 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        await self.bus.subscribe(all_demand(self.subjects), self._on_demand)
        self._task = asyncio.create_task(self._report(self.migrator.cfg.interval_s), name="migration-demand")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def share(self) -> None:
        """Report this frontend's own demand now (an empty report says it has none)."""
        body = encode(MigrationDemand(self.frontend_id, self.migrator.shared_demand(self._clock())))
        self.bus.publish(demand_subject(self.subjects, self.frontend_id), body)

    async def _report(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.share()

    async def _on_demand(self, msg: BusMsg) -> None:
        try:
            body = decode_migration_demand(msg.data)
        except msgspec.DecodeError:
            body = None
        if body is None or msg.subject != demand_subject(self.subjects, body.origin):
            self.ignored += 1  # (another version; or a body claiming another frontend than its subject names)
            if self.ignored == 1:
                log.warning("a cache migration demand report on %s was not taken (another version?)", msg.subject)
            return
        if body.origin != self.frontend_id:  # (our own, echoed by the bus)
            self.migrator.peer_demand(body.origin, body.entries, self._clock())
