"""The agent-program endpoints: list, read and release programs (``/v1/programs*``, and the ThunderAgent
paper proxy's ``POST /programs/release``).

With API keys on, a program belongs to the tenant whose key sent its requests (the table's key is
``tenant/id``: :func:`~thunderagent.scheduler.programs.program_key`):

- a tenant key lists, reads and releases its own programs, by the ids its clients chose; another
  tenant's program with the same id is not its own (404);
- an admin key sees every tenant's programs; it names the tenant of one program with ``?tenant=``,
  and may filter the listing by it. Entries carry their ``tenant``.

With keys off there are no tenants (``?tenant=`` is refused) and every caller sees every program.

Frontends over NATS each keep their own table: a release is told to the other frontends too
(``peers``: :class:`~thunderagent.control.program_peers.ProgramPeers`), and is a 404 only when no
frontend held the program. Listings and reads show this frontend's table.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from thunderagent.config.auth import check_tenant
from thunderagent.control.fleet import Fleet
from thunderagent.frontend.auth import AUTH_KEY, DETAIL, TENANT
from thunderagent.frontend.protocol import (ReleaseRequest, RequestError, check_program_id, decode_request,
                                            program_filters)
from thunderagent.scheduler.programs import EVERYONE, Program, program_key


class Peers(Protocol):
    """The other frontends of a NATS deployment, as far as releases go."""

    def tell(self, key: str) -> None: ...
    async def release_elsewhere(self, key: str) -> bool: ...


class ProgramsApi:
    def __init__(self, fleet: Fleet, peers: Peers | None = None) -> None:
        self.fleet = fleet
        self.peers = peers

    async def listing(self, request: web.Request) -> web.Response:
        """``?state=`` (reasoning, acting, paused) and ``?limit=`` (the oldest N, default 1,000): a table
        of up to ``scheduler.max_programs`` is not listed whole on every call by default."""
        state, limit = program_filters(request.query)
        owner = _owner(request)
        programs = self.fleet.programs
        data, total = programs.listing(self.fleet.now(), state, limit, owner)
        if not request[DETAIL]:
            for entry in data:
                _hide_workers(entry)
        body: dict[str, object] = {"object": "list", "data": data, "total": total, "truncated": len(data) < total,
                                   "by_state": programs.by_state(owner)}
        pacer = self.fleet.dispatcher.pacer
        if pacer is not None and request[DETAIL]:  # the fleet's pacing (other tenants' ids): admins only
            body["pacing"] = {"pauses": pacer.pauses, "resumes": pacer.resumes, "forced_resumes": pacer.forced_resumes,
                              "held_requests": pacer.held_count(), "recent": [e.as_dict() for e in pacer.recent]}
        return web.json_response(body)

    async def one(self, request: web.Request) -> web.Response:
        prog = self._find(request, request.match_info["program_id"])
        entry = prog.as_dict(self.fleet.now())
        return web.json_response(entry if request[DETAIL] else _hide_workers(entry))

    async def release(self, request: web.Request) -> web.Response:
        return await self._release(request, request.match_info["program_id"])

    async def release_body(self, request: web.Request) -> web.Response:
        """``POST /programs/release {"program_id": ...}``: the ThunderAgent paper proxy's form."""
        body = decode_request(await request.read(), ReleaseRequest)
        assert isinstance(body, ReleaseRequest)
        return await self._release(request, body.program_id)

    def _find(self, request: web.Request, program_id: object) -> Program:
        """The program a call names (an admin's without ``?tenant=``: keys off's form), or a 404."""
        tenant, checked = _named(request, program_id)
        prog = self.fleet.programs.get(program_key(tenant, checked))
        if prog is None:
            raise _not_found(request, tenant, checked)
        return prog

    async def _release(self, request: web.Request, program_id: object) -> web.Response:
        tenant, checked = _named(request, program_id)
        key = program_key(tenant, checked)
        if self.fleet.release_program(key):  # (it held requests of it: they go now)
            if self.peers is not None:
                self.peers.tell(key)  # copies on other frontends go too
        elif self.peers is None or not await self.peers.release_elsewhere(key):
            raise _not_found(request, tenant, checked)
        return web.json_response({"id": checked, "tenant": tenant, "released": True})


def _named(request: web.Request, program_id: object) -> tuple[str | None, str]:
    """(tenant, id) of the program a call names."""
    owner = _owner(request)
    return (None if owner == EVERYONE else owner), check_program_id(program_id)


def _not_found(request: web.Request, tenant: str | None, checked: str) -> RequestError:
    hint = (" (an admin key names the program's tenant with ?tenant=)"
            if tenant is None and request.app.get(AUTH_KEY) is not None else "")
    return RequestError(f"no program {checked!r} is known (released, expired or never seen){hint}",
                        param="program_id", status=404, code="program_not_found")


def _hide_workers(entry: dict[str, object]) -> dict[str, object]:
    """A program as a tenant key sees it: worker ids are the fleet's detail (null here, as for a
    program not placed yet)."""
    entry["worker"] = entry["pinned"] = None
    return entry


def _owner(request: web.Request) -> str | None:
    """Whose programs the call addresses: a tenant key's own; for an admin key (or with keys off),
    the tenant ``?tenant=`` names, else everyone's."""
    named = request.query.get("tenant")
    if not request[DETAIL]:  # a tenant key (an admin key, or keys off, sets DETAIL)
        tenant = request[TENANT]
        if named is not None and named != tenant:
            raise RequestError("tenant: a tenant key sees only its own programs (name another tenant with an "
                               "admin key)", param="tenant", status=403, code="admin_key_required",
                               type_="permission_error")
        return tenant
    if named is None:
        return EVERYONE
    if request.app.get(AUTH_KEY) is None:
        raise RequestError("tenant: API keys are off, so programs have no tenant", param="tenant")
    try:
        return check_tenant(named)
    except ValueError as e:
        raise RequestError(str(e), param="tenant") from None
