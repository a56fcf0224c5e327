"""The operator's worker endpoints (``control_plane.admin_api``, off by default; an admin key with API keys on):

- ``GET  /v1/admin/workers``: every worker with its health, load, cordon mark, server and requests in flight here;
- ``POST /v1/admin/workers/{worker_id}/cordon`` and ``.../uncordon``: out of routing (its requests finish) and back;
- ``POST /v1/admin/workers {"url": ..., "group": N, ...}``: one more server (``thunderagent serve``);
- ``POST /v1/admin/workers/{worker_id}/remove {"force": false, "timeout_s": 30}``: cordon, drain, leave.

What each does: ``control/worker_admin.py``. Errors are OpenAI-shaped, naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from aiohttp import web
from pydantic import ValidationError

from thunderagent.config import EndpointConfig
from thunderagent.control.worker_admin import AdminError, WorkerAdmin
from thunderagent.frontend.protocol import RequestError, decode_request

WORKERS_PATH = "/v1/admin/workers"
#: an added worker's id (it names metric series and log lines)
WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_WORKER_ID = re.compile(WORKER_ID_PATTERN)
MAX_DRAIN_S = 3600.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


class AddWorker(msgspec.Struct, forbid_unknown_fields=True):
    """One more worker: a server of a real engine group (``url`` and, for vLLM / SGLang, its KV-event sockets), or a
    simulated engine (no ``url``)."""

    url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    group: int | None = None
    id: str | None = None


class RemoveWorker(msgspec.Struct, forbid_unknown_fields=True):
    force: bool = False
    timeout_s: float = 30.0


class AdminApi:
    def __init__(self, admin: WorkerAdmin, enabled: bool) -> None:
        self.admin = admin
        self.enabled = enabled

    def _check(self) -> None:
        if not self.enabled:
            raise RequestError("the admin API is off: set control_plane.admin_api: true (with API keys on it then "
                               "needs an admin key)", status=403, code="admin_api_disabled",
                               type_="permission_error")

    async def listing(self, request: web.Request) -> web.Response:
        self._check()
        return web.json_response({"object": "list", "data": self.admin.listing()})

    async def cordon(self, request: web.Request) -> web.Response:
        return await self._cordon(request, True)

    async def uncordon(self, request: web.Request) -> web.Response:
        return await self._cordon(request, False)

    async def _cordon(self, request: web.Request, cordoned: bool) -> web.Response:
        self._check()
        wid = request.match_info["worker_id"]
        await _acting(self.admin.cordon(wid, cordoned))
        return web.json_response({"id": wid, "cordoned": cordoned, "in_flight": self.admin.in_flight(wid)})

    async def add(self, request: web.Request) -> web.Response:
        self._check()
        body = decode_request(await request.read(), AddWorker)
        assert isinstance(body, AddWorker)
        _check_id(body.id)
        endpoint = None
        if body.url is not None:
            try:
                endpoint = EndpointConfig(url=body.url, kv_events=body.kv_events, kv_replay=body.kv_replay,
                                          api_key_env=body.api_key_env, api_key_file=body.api_key_file)
            except ValidationError as e:
                err = e.errors()[0]
                raise RequestError(err["msg"].removeprefix("Value error, "),
                                   param=".".join(str(p) for p in err["loc"]) or "url") from None
        elif any(v is not None for v in (body.kv_events, body.kv_replay, body.api_key_env, body.api_key_file)):
            raise RequestError("url: the server's fields come with its url", param="url")
        try:
            wid = self.admin.add(body.group, endpoint, body.id)
        except AdminError as e:
            raise _error(e) from None
        except OSError as e:  # the engine's worker could not set up its server's sockets
            raise RequestError(f"the server's endpoint: {e}", param="url") from None
        return web.json_response({"id": wid, "added": True}, status=201)

    async def remove(self, request: web.Request) -> web.Response:
        self._check()
        wid = request.match_info["worker_id"]
        raw = await request.read()
        body = decode_request(raw, RemoveWorker) if raw.strip() else RemoveWorker()
        assert isinstance(body, RemoveWorker)
        if not 0 <= body.timeout_s <= MAX_DRAIN_S:
            raise RequestError(f"timeout_s: 0 to {MAX_DRAIN_S:.0f} seconds, got {body.timeout_s}", param="timeout_s")
        r = await _acting(self.admin.remove(wid, force=body.force, timeout_s=body.timeout_s))
        if not r.removed:
            raise RequestError(f"worker {wid!r} still runs {r.in_flight} requests after {body.timeout_s:g}s: it stays "
                               "cordoned; call again to wait longer, or with force: true to move them", status=409,
                               code="worker_busy", param="timeout_s")
        return web.json_response({"id": wid, "removed": True, "requests_moved": r.cut})


async def _acting(coro: Awaitable[T]) -> T:
    try:
        return await coro
    except AdminError as e:
        raise _error(e) from None


def _error(e: AdminError) -> RequestError:
    return RequestError(str(e), param=e.param, status=e.status, code=e.code)


def _check_id(wid: str | None) -> None:
    if wid is not None and not _WORKER_ID.match(wid):
        raise RequestError(f"id: 1-64 letters, digits or ._- (starting with a letter or digit), got {wid!r}",
                           param="id")


def add_admin_routes(route: Callable[[str, str, Handler], None], api: AdminApi) -> None:
    route("GET", WORKERS_PATH, api.listing)
    route("POST", WORKERS_PATH, api.add)
    route("POST", f"{WORKERS_PATH}/{{worker_id}}/cordon", api.cordon)
    route("POST", f"{WORKERS_PATH}/{{worker_id}}/uncordon", api.uncordon)
    route("POST", f"{WORKERS_PATH}/{{worker_id}}/remove", api.remove)
