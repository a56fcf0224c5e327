"""The operator's worker endpoints (``control_plane.admin_api``, off by default; an admin key with API keys on):

- ``GET  /v1/admin/workers``: every worker with its health, load, cordon mark, server and requests in flight here;
- ``POST /v1/admin/workers/{worker_id}/cordon`` and ``.../uncordon``: out of routing (its requests finish) and back;
- ``POST /v1/admin/workers {"url": ..., "group": N, ...}``: one more server (``thunderagent serve``);
- ``POST /v1/admin/workers/{worker_id}/remove {"force": false, "timeout_s": 30}``: cordon, drain, leave.
- ``POST /v1/admin/reset_prefix_cache {"workers": [...], "reset_running_requests": false, "reset_external": false}``
  (every worker by default), ``POST /v1/admin/workers/{worker_id}/reset_prefix_cache`` (one), and vLLM's own
  ``POST /reset_prefix_cache?reset_running_requests=...&reset_external=...`` (every worker: for tools written
  against one vLLM server): empty the servers' prefix caches, the index following (``control/server_admin.py``);
  200 with ``success`` (all of them) and each worker's answer;
- vLLM's ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace", "workers"}`` and
  ``POST /v1/unload_lora_adapter {"lora_name", "workers"}``: the adapter loaded or unloaded on every server (or those
  named); 200 when all did, else 502 ``servers_refused``, each with every worker's answer;
- vLLM's ``POST /pause?mode=abort|wait|keep&clear_cache=true`` and ``POST /resume``: every server's generation paused
  or resumed, or those ``?workers=`` names (a paused server is routed to only while no other can take a request;
  answers as the adapters'); vLLM's other operator paths (``execution/server_admin.SERVER_CALLS``) on
  every server or those the query's ``workers`` names, with the caller's query and JSON body: ``GET /is_paused``
  (all of them paused?), profiling, the multimodal caches' resets, sleep mode (``POST /sleep?level=&mode=``,
  ``/wake_up?tags=``, ``GET /is_sleeping``, ``POST /release_kv_cache_memory``: a sleeping server is routed to only
  while no awake one can take a request), ``POST /collective_rpc`` (``results``: every server's), ``/abort_requests``
  (with no ``workers``, the requests held in ThunderAgent's queue too: ``held_aborted``) and the RL weight transfer
  (``/init_weight_transfer_engine``, ``/update_weights``, ...).

What each does: ``control/worker_admin.py``. Errors are OpenAI-shaped, naming the field.
"""

from __future__ import annotations

import re
from urllib.parse import urlencode
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import msgspec
from aiohttp import web
from msgspec import Meta
from pydantic import ValidationError

from thunderagent.config import EndpointConfig
from thunderagent.control.server_admin import WorkerAnswer, call_servers, reset_caches, set_adapters, set_paused
from thunderagent.execution.server_admin import PAUSE_MODES, SERVER_CALLS
from thunderagent.control.worker_admin import AdminError, WorkerAdmin
from thunderagent.frontend.protocol import RequestError, decode_request

WORKERS_PATH = "/v1/admin/workers"
RESET_PATH = "/v1/admin/reset_prefix_cache"
VLLM_RESET_PATH = "/reset_prefix_cache"  # vLLM's (a server with VLLM_SERVER_DEV_MODE=1), for the fleet
#: vLLM's (a server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), for the fleet's servers
LOAD_ADAPTER_PATH, UNLOAD_ADAPTER_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
#: vLLM's (VLLM_SERVER_DEV_MODE=1: an RL trainer's pause around a weight update), for the fleet's servers
PAUSE_PATH, RESUME_PATH = "/pause", "/resume"
ABORT_PATH = "/abort_requests"  # vLLM's (dev mode): also ends the requests held in ThunderAgent's queue
#: an added worker's id (it names metric series and log lines)
WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_WORKER_ID = re.compile(WORKER_ID_PATTERN)
MAX_DRAIN_S = 3600.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)


class AddWorker(msgspec.Struct, forbid_unknown_fields=True):
    """One more worker: a server of a real engine group (``url`` and, for vLLM / SGLang, its KV-event sockets), or a
    simulated engine (no ``url``)."""

    url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    data_parallel_rank: int | None = None
    group: int | None = None
    id: str | None = None


class RemoveWorker(msgspec.Struct, forbid_unknown_fields=True):
    force: bool = False
    timeout_s: float = 30.0


class LoadAdapter(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's load request (its ``is_3d_lora_weight`` is not taken), and the workers to load it on (all: None)."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=256)]
    lora_path: Annotated[str, Meta(min_length=1, max_length=4096)]
    load_inplace: bool = False
    workers: list[str] | None = None


class UnloadAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: Annotated[str, Meta(min_length=1, max_length=256)]
    workers: list[str] | None = None


class ResetCaches(msgspec.Struct, forbid_unknown_fields=True):
    workers: list[str] | None = None  # (the per-worker path: its own; refused in its body)
    reset_running_requests: bool = False
    reset_external: bool = False


_FLAGS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


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
                                          api_key_env=body.api_key_env, api_key_file=body.api_key_file,
                                          data_parallel_rank=body.data_parallel_rank)
            except ValidationError as e:
                err = e.errors()[0]
                raise RequestError(err["msg"].removeprefix("Value error, "),
                                   param=".".join(str(p) for p in err["loc"]) or "url") from None
        elif any(v is not None for v in (body.kv_events, body.kv_replay, body.api_key_env, body.api_key_file,
                                         body.data_parallel_rank)):
            raise RequestError("url: the server's fields come with its url", param="url")
        try:
            wid = await self.admin.add(body.group, endpoint, body.id)
        except AdminError as e:
            raise _error(e) from None
        except OSError as e:  # the engine's worker could not set up its server's sockets
            raise RequestError(f"the server's endpoint: {e}", param="url") from None
        return web.json_response({"id": wid, "added": True}, status=201)

    async def remove(self, request: web.Request) -> web.Response:
        self._check()
        wid = request.match_info["worker_id"]
        body = await _optional_body(request, RemoveWorker)
        if not 0 <= body.timeout_s <= MAX_DRAIN_S:
            raise RequestError(f"timeout_s: 0 to {MAX_DRAIN_S:.0f} seconds, got {body.timeout_s}", param="timeout_s")
        r = await _acting(self.admin.remove(wid, force=body.force, timeout_s=body.timeout_s))
        if not r.removed:
            raise RequestError(f"worker {wid!r} still runs {r.in_flight} requests after {body.timeout_s:g}s: it stays "
                               "cordoned; call again to wait longer, or with force: true to move them", status=409,
                               code="worker_busy", param="timeout_s")
        return web.json_response({"id": wid, "removed": True, "requests_moved": r.cut, "prefixes_handed_off": r.handed_off})

    async def reset_all(self, request: web.Request) -> web.Response:
        self._check()
        body = await _optional_body(request, ResetCaches)
        return await self._reset(self._named(body.workers), body.reset_running_requests, body.reset_external)

    async def reset_one(self, request: web.Request) -> web.Response:
        self._check()
        wid = request.match_info["worker_id"]
        body = await _optional_body(request, ResetCaches)
        if body.workers is not None:
            raise RequestError(f"workers: this path resets {wid!r} (the fleet's: {RESET_PATH})", param="workers")
        try:
            self.admin.known(wid)
        except AdminError as e:
            raise _error(e) from None
        return await self._reset([wid], body.reset_running_requests, body.reset_external)

    async def reset_vllm(self, request: web.Request) -> web.Response:
        """vLLM's path and query parameters; every worker of the fleet."""
        self._check()
        flags = _query_flags(request, VLLM_RESET_PATH, {"reset_running_requests": False, "reset_external": False})
        return await self._reset(self._named(None), bool(flags["reset_running_requests"]),
                                 bool(flags["reset_external"]))

    async def _reset(self, ids: list[str], running: bool, external: bool) -> web.Response:
        done = await reset_caches(self.admin.fleet, ids, running=running, external=external)
        return web.json_response({"success": bool(done) and all(r.success for r in done), "workers": _answers(done)})

    async def load_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/load_lora_adapter`` for the fleet's servers (or ``workers``)."""
        self._check()
        body = decode_request(await request.read(), LoadAdapter)
        assert isinstance(body, LoadAdapter)
        done = await set_adapters(self.admin.fleet, self._named(body.workers), body.lora_name, body.lora_path,
                                  body.load_inplace)
        return _fleet_answer(done, f"LoRA adapter {body.lora_name!r} loaded")

    async def unload_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/unload_lora_adapter`` for the fleet's servers (or ``workers``)."""
        self._check()
        body = decode_request(await request.read(), UnloadAdapter)
        assert isinstance(body, UnloadAdapter)
        done = await set_adapters(self.admin.fleet, self._named(body.workers), body.lora_name, None, False)
        return _fleet_answer(done, f"LoRA adapter {body.lora_name!r} unloaded")

    async def pause(self, request: web.Request) -> web.Response:
        """vLLM's ``/pause?mode=abort|wait|keep&clear_cache=true|false`` for every server of the fleet, or those
        ``workers`` names (a rolling update: the others serve meanwhile)."""
        self._check()
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode: one of {', '.join(PAUSE_MODES)}, got {mode[:40]!r}", param="mode")
        flags = _query_flags(request, PAUSE_PATH, {"mode": mode, "clear_cache": True, "workers": None})
        done = await set_paused(self.admin.fleet, self._named(flags["workers"]), True, mode,  # type: ignore[arg-type]
                                bool(flags["clear_cache"]))
        return _fleet_answer(done, f"generation paused ({mode})")

    async def resume(self, request: web.Request) -> web.Response:
        """vLLM's ``/resume`` for every server of the fleet, or those ``workers`` names."""
        self._check()
        workers = _query_flags(request, RESUME_PATH, {"workers": None})["workers"]
        done = await set_paused(self.admin.fleet, self._named(workers), False, "abort", False)  # type: ignore[arg-type]
        return _fleet_answer(done, "generation resumed")

    async def server_call(self, request: web.Request) -> web.Response:
        """One of vLLM's other operator paths (``SERVER_CALLS``) on every server of the fleet, or those the query's
        ``workers`` names; ``GET /is_paused`` and ``/is_sleeping`` answer whether all of them are."""
        self._check()
        path = request.path
        call = SERVER_CALLS[path]
        query, workers = server_query(request, path, call.query)
        body, doc = b"", {}
        if call.body:  # (none: the servers get {}, e.g. /abort_requests of everything)
            body = (await request.read()).strip()
            try:
                doc = msgspec.json.decode(body) if body else {}
                if not isinstance(doc, dict):
                    raise msgspec.DecodeError("not an object")
            except msgspec.DecodeError as e:
                raise RequestError(f"{path} takes a JSON object: {e}") from None
        named = self._named(workers)
        held = None
        if path == ABORT_PATH and workers is None:  # the fleet's own held requests first: none reaches a server after
            ids, fleet = _abort_ids(doc), self.admin.fleet
            held = fleet.abort_held(ids) + (await fleet.held_peers(ids) if fleet.held_peers is not None else 0)
        done = await call_servers(self.admin.fleet, named, path, query, body)
        if any(not r.success for r in done):
            return _fleet_answer(done, f"{path} done", held)
        if path in ("/is_paused", "/is_sleeping"):
            name = path[1:]
            states = [_state(r.answer, name) for r in done]
            return web.json_response({name: bool(done) and all(s is True for s in states), "workers": [
                {"id": r.worker_id, name: s} for r, s in zip(done, states)]})
        if path == "/collective_rpc":  # (vLLM's answer: {"results": [one per rank]}; the fleet's: every server's)
            answers = _answers(done)  # (each server's body decoded once)
            results = [x for w in answers for x in _results(w.get("answer"))]
            return web.json_response({"success": True, "results": results, "workers": answers})
        return _fleet_answer(done, f"{path} done", held)

    def _named(self, ids: list[str] | None) -> list[str]:
        """The workers a call names (every worker when None), each known: a 404 naming ``workers`` otherwise; a
        fleet without workers has nobody to ask (503 ``no_healthy_worker``, as a request gets)."""
        workers = self.admin.fleet.workers
        if not workers:
            raise RequestError("the fleet has no worker to ask", status=503, code="no_healthy_worker",
                               type_="server_error")
        if ids is None:
            return sorted(workers)
        if not ids:
            raise RequestError("workers: name at least one worker, or leave the field out (every worker)",
                               param="workers")
        for k, wid in enumerate(ids):
            if wid not in workers:
                raise RequestError(f"workers[{k}]: no worker {wid!r} in the fleet", status=404,
                                   code="worker_not_found", param="workers")
        return sorted(set(ids))


def _query_flags(request: web.Request, path: str, known: dict[str, object]) -> dict[str, object]:
    """The query's parameters: each one of ``known`` (booleans read as vLLM reads them; others taken as given by
    the caller), anything else a 400 naming it."""
    out = dict(known)
    for name, value in request.query.items():
        if name == "workers" and "workers" in known:
            out["workers"] = _workers(out["workers"], value)  # type: ignore[arg-type]
            continue
        if name not in known:
            takes = ", ".join(known) or "no query parameters"
            raise RequestError(f"{path} takes {takes}, not {name!r}", param=name)
        if isinstance(known[name], bool):
            if value.strip().lower() not in _FLAGS:
                raise RequestError(f"{name}: a boolean (true or false), got {value[:40]!r}", param=name)
            out[name] = _FLAGS[value.strip().lower()]
    return out


def server_query(request: web.Request, path: str, takes: tuple[str, ...]) -> tuple[str, list[str] | None]:
    """The query of one of vLLM's operator paths checked as vLLM checks it (``/sleep``: ``level`` 0-2 and ``mode``;
    ``/wake_up``: ``tags``, repeated; ``/get_world_size``: ``include_dp``), url-encoded to send on, and the workers
    our own ``workers`` parameter names (repeated; None: all of them)."""
    sent: list[tuple[str, str]] = []
    workers: list[str] | None = None
    for name, value in request.query.items():
        if name == "workers":
            workers = _workers(workers, value)
            continue
        if name not in takes:
            raise RequestError(f"{path} takes {', '.join((*takes, 'workers'))}, not {name[:40]!r}", param=name)
        ok = {"level": ("0", "1", "2"), "mode": PAUSE_MODES, "tags": ("weights", "kv_cache", "scheduling"),
              "config_format": ("text", "json")}.get(name)
        if name == "include_dp":
            if value.strip().lower() not in _FLAGS:
                raise RequestError(f"{name}: a boolean (true or false), got {value[:40]!r}", param=name)
            value = "true" if _FLAGS[value.strip().lower()] else "false"
        elif ok is not None and value not in ok:
            raise RequestError(f"{name}: one of {', '.join(ok)}, got {value[:40]!r}", param=name)
        sent.append((name, value))
    return urlencode(sent), workers


def _workers(named: list[str] | None, value: str) -> list[str]:
    """Our own ``workers`` query parameter (repeated or comma-separated) added to those ``named`` before it."""
    workers = [*(named or []), *(w for w in value.split(",") if w)]
    if not workers:
        raise RequestError("workers: name at least one worker, or leave the parameter out", param="workers")
    return workers


def _state(answer: str | None, name: str) -> bool | None:
    """vLLM's ``{"is_paused": bool}`` (``{"is_sleeping": bool}``); None for anything else."""
    got = _json(answer)
    state = got.get(name) if isinstance(got, dict) else None
    return state if isinstance(state, bool) else None


def _json(answer: str | None) -> object:
    """A server's answer as JSON when it is JSON, else its text (None: no body)."""
    if not answer:
        return None
    try:
        return msgspec.json.decode(answer)
    except msgspec.DecodeError:
        return answer


def _results(answer: object) -> list[object]:
    got = answer.get("results") if isinstance(answer, dict) else None
    return got if isinstance(got, list) else []


def _answers(done: list[WorkerAnswer]) -> list[dict[str, object]]:
    return [{"id": r.worker_id, "success": r.success, **({"error": r.error} if r.error else {}),
             **({"answer": _json(r.answer)} if r.answer else {})} for r in done]


def _abort_ids(doc: dict[str, object]) -> list[str] | None:
    """``/abort_requests``'s ``request_ids`` (vLLM's: a list of ids; none or empty: every request)."""
    ids = doc.get("request_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise RequestError("request_ids: a list of request ids (strings)", param="request_ids")
    return ids or None


def _fleet_answer(done: list[WorkerAnswer], what: str, held: int | None = None) -> web.Response:
    """200 when every server did it; else 502 (OpenAI's error shape: the servers refused), both with each answer;
    ``held``: the requests ``/abort_requests`` ended in ThunderAgent's queue (``held_aborted``)."""
    failed = [r for r in done if not r.success]
    extra = {} if held is None else {"held_aborted": held}
    if done and not failed:
        return web.json_response({"success": True, **extra, "workers": _answers(done)})
    why = "; ".join(f"{r.worker_id}: {r.error}" for r in failed[:3]) or "the fleet has no worker"
    err = {"message": f"{what} on {len(done) - len(failed)} of {len(done)} servers ({why})",
           "type": "server_error", "param": None, "code": "servers_refused"}
    return web.json_response({"success": False, "error": err, **extra, "workers": _answers(done)}, status=502)


async def _optional_body(request: web.Request, kind: type[S]) -> S:
    """The request's JSON body as ``kind``; none (or blank): ``kind``'s defaults."""
    raw = await request.read()
    body = decode_request(raw, kind) if raw.strip() else kind()
    assert isinstance(body, kind)
    return body


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
    route("POST", f"{WORKERS_PATH}/{{worker_id}}/reset_prefix_cache", api.reset_one)
    route("POST", RESET_PATH, api.reset_all)
    route("POST", VLLM_RESET_PATH, api.reset_vllm)
    route("POST", LOAD_ADAPTER_PATH, api.load_adapter)
    route("POST", UNLOAD_ADAPTER_PATH, api.unload_adapter)
    route("POST", PAUSE_PATH, api.pause)
    route("POST", RESUME_PATH, api.resume)
    for path, call in SERVER_CALLS.items():
        route(call.method, path, api.server_call)
