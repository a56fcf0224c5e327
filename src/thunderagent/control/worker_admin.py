"""Operator actions on single workers of a running fleet (``/v1/admin/workers*``: ``frontend/admin_api.py``).

- **cordon**: the worker leaves routing (new requests, held ones, programs resumed or pinned go elsewhere) while
  its requests in flight finish; its cache stays indexed, so **uncordon** brings it back warm. With several NATS
  frontends the worker itself keeps the mark and announces it in its heartbeats, so every frontend (one started
  later too) leaves it out; the frontend asked applies it at once, the others with the worker's next heartbeat.
- **add** (``thunderagent serve``): one more server of a node group of real engines (or one more simulated
  engine), built and routable at once, as a configured one; it is not written back to the config file.
- **remove**: cordon, wait until this frontend's requests on it have finished (at most ``timeout_s``), then it
  leaves the fleet (index entries purged, handle stopped). ``force``: its requests are cut at once and go where a
  lost worker's go (continued on another worker mid-stream, or routed again). Over NATS a worker process leaves
  by itself (SIGTERM: it says bye and drains), so add and remove are refused there.

Over NATS, cordon state changes go through :class:`Cordons` (the membership), which asks the worker.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from thunderagent.config import EndpointConfig
from thunderagent.control.marks import apply_cordon
from thunderagent.control.membership import StaticMembership

if TYPE_CHECKING:
    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)

#: how often a removal looks whether the worker's requests have finished
_POLL_S = 0.05


class AdminError(Exception):
    """An action refused: ``status`` (HTTP), ``code`` and the field it is about (``param``)."""

    def __init__(self, message: str, status: int, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


class Cordons(Protocol):
    """A membership whose workers keep their own cordon mark (NATS: every frontend reads it in heartbeats)."""

    async def set_cordon(self, worker_id: str, cordoned: bool) -> None:
        """Tell the worker; raise TimeoutError when it did not confirm."""


@dataclass(slots=True, frozen=True)
class Removal:
    worker_id: str
    removed: bool
    in_flight: int  # its requests still running here (not removed: the drain ran out of time)
    cut: int  # requests cut (force)
    handed_off: int = 0  # prefixes copied to other workers before it left (routing.migration on)


class WorkerAdmin:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    # -- reading ---------------------------------------------------------------------------------
    def in_flight(self, worker_id: str) -> int:
        """This frontend's requests running on the worker (a disaggregated one: decoding or prefilling there)."""
        handle = self.fleet.workers.get(worker_id)
        return 0 if handle is None else len(self.fleet.generations_on(handle, prefill=True))

    def listing(self) -> list[dict[str, object]]:
        """Each worker: the ``/health`` detail plus its group, engine, server (and data-parallel rank), the names its
        server serves besides the fleet's model (LoRA adapters; an ``engine: openai`` server's models) and requests
        in flight here."""
        fleet, static = self.fleet, self._static()
        nodes = fleet.cfg.execution_group.nodes
        out: list[dict[str, object]] = []
        for w in fleet.health_summary()["workers"]:  # type: ignore[attr-defined]
            wid = w["id"]
            handle = fleet.workers.get(wid)
            group = static.groups.get(wid) if static is not None else None
            endpoint = getattr(handle, "endpoint", None)
            out.append({**w, "group": group, "engine": nodes[group].engine if group is not None else
                        getattr(handle, "engine", None), "url": getattr(endpoint, "url", None),
                        "data_parallel_rank": getattr(endpoint, "data_parallel_rank", None),
                        "adapters": self._adapters(wid), "in_flight": self.in_flight(wid)})
        return out

    def _adapters(self, worker_id: str) -> list[str]:
        try:
            return sorted(self.fleet.registry.info(worker_id).adapters)
        except KeyError:  # (left meanwhile)
            return []

    def known(self, worker_id: str) -> None:
        if worker_id not in self.fleet.workers:
            raise AdminError(f"no worker {worker_id!r} in the fleet", 404, "worker_not_found", "worker_id")

    def _static(self) -> StaticMembership | None:
        m = self.fleet.membership
        return m if isinstance(m, StaticMembership) else None

    # -- cordon ----------------------------------------------------------------------------------
    async def cordon(self, worker_id: str, cordoned: bool = True) -> None:
        """Take the worker out of routing (``cordoned``) or put it back; idempotent."""
        self.known(worker_id)
        fleet = self.fleet
        if self._static() is None:  # the worker keeps the mark (NATS): it must confirm before we answer
            membership: Cordons = fleet.membership  # type: ignore[assignment]
            try:
                await membership.set_cordon(worker_id, cordoned)
            except TimeoutError:
                raise AdminError(f"worker {worker_id!r} did not confirm the change (it may be unreachable); "
                                 "nothing changed", 504, "worker_timeout", "worker_id") from None
            self.known(worker_id)  # (it may have left meanwhile)
        apply_cordon(fleet, worker_id, cordoned, f"by an operator, {self.in_flight(worker_id)} requests in flight")
        if (static := self._static()) is not None:
            await self._save(static, f"worker {worker_id} {'cordoned' if cordoned else 'uncordoned'}")

    async def _save(self, static: StaticMembership, what: str) -> None:
        """The state file written after a change (``control_plane.admin_state_file``); the change stands either way,
        and a write that failed says so (the file then holds the state before it)."""
        try:
            await static.save()
        except OSError as e:
            log.error("%s, but control_plane.admin_state_file could not be written: %s", what, e)
            raise AdminError(f"{what}, but the state file could not be written ({e}): a restart would not keep it",
                             500, "state_not_saved", None) from None

    # -- add / remove (thunderagent serve) ---------------------------------------------------------
    async def add(self, group: int | None, endpoint: EndpointConfig | None, worker_id: str | None) -> str:
        static = self._need_static("add")
        nodes = self.fleet.cfg.execution_group.nodes
        if group is None:
            if len(nodes) != 1:
                raise AdminError(f"the fleet has {len(nodes)} node groups: name one (0..{len(nodes) - 1})", 400,
                                 "invalid_value", "group")
            group = 0
        try:
            wid = static.add(group, endpoint, worker_id)
        except ValueError as e:  # ours name the field first; the engine's worker says "field '...'" (its key)
            named = re.match(r"field '([a-z_]+)'", str(e))
            field = named.group(1) if named else str(e).split(":", 1)[0]
            raise AdminError(str(e), 409 if field == "id" else 400, "worker_exists" if field == "id" else
                             "invalid_value", field if named or field in ("group", "url", "id", "data_parallel_rank")
                             else None) from None
        log.warning("worker %s added by an operator to group %d%s", wid, group,
                    "" if endpoint is None else f" ({endpoint.url})")
        self.fleet.wake()
        await self._save(static, f"worker {wid} added")
        return wid

    async def remove(self, worker_id: str, *, force: bool, timeout_s: float) -> Removal:
        static = self._need_static("remove")
        self.known(worker_id)
        fleet = self.fleet
        await self.cordon(worker_id)
        cut = 0
        copies: list[asyncio.Task[bool]] = []
        if force:  # (its cache goes with it: no copies)
            gens = fleet.generations_on(fleet.workers[worker_id], prefill=True)
            for gen in gens:  # ended here as if the worker were lost: they migrate or are routed again
                fleet.cut(gen, f"worker {worker_id} removed by an operator")
            cut = len(gens)
        else:
            # routing.migration on: its most-demanded prefixes that no other worker holds are copied out while
            # it drains (its cache would go with it); waited for within the same timeout
            if fleet.cache_migration is not None and worker_id in fleet.workers:
                copies = fleet.cache_migration.evacuate(worker_id, fleet.routable(), fleet.now())
            deadline = fleet.now() + timeout_s
            while ((n := self.in_flight(worker_id)) or not all(t.done() for t in copies)) and fleet.now() < deadline:
                await asyncio.sleep(_POLL_S)
            if n:
                return Removal(worker_id, False, n, 0)
        handed = sum(1 for t in copies if t.done() and not t.cancelled() and t.result())
        if worker_id in fleet.workers:  # (a concurrent removal may have taken it)
            fleet.leave(worker_id, "removed by an operator", drain=True)  # (nothing of ours runs there now)
            await static.remove(worker_id)
            await self._save(static, f"worker {worker_id} removed")
        return Removal(worker_id, True, 0, cut, handed)

    def _need_static(self, action: str) -> StaticMembership:
        static = self._static()
        if static is None:
            raise AdminError(f"{action} is for `thunderagent serve`: over NATS a worker process joins and leaves by "
                             "itself (start a `thunderagent worker`, or stop one: SIGTERM, it leaves routing and "
                             "drains)", 409, "not_supported", None)
        return static
