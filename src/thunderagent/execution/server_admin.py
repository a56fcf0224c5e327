"""An operator's calls on a real server, over HTTP (``WorkerHandle.reset_prefix_cache`` and ``set_adapter`` of a
vLLM, SGLang or OpenAI-compatible server's worker; fanned out to the fleet by ``control/server_admin.py``).

Generation paused and resumed (vLLM with ``VLLM_SERVER_DEV_MODE=1``: ``POST /pause?mode=abort|wait|keep&clear_cache=``,
``POST /resume``; new requests wait in the server meanwhile; SGLang's own pause is not driven here).

Other operator paths (``SERVER_CALLS``), sent with the query and JSON body the caller gave (only the parameters each
takes), the answer's body kept: vLLM's ``/start_profile``, ``/stop_profile``, ``/reset_mm_cache``,
``/reset_encoder_cache``, ``GET /is_paused``; sleep mode (``/sleep?level=&mode=``, ``/wake_up?tags=``, ``GET
/is_sleeping``, ``/release_kv_cache_memory``); ``/collective_rpc``, ``/abort_requests``; the RL weight transfer
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ...);
``GET /server_info?config_format=``; elastic EP scaling (``/scale_elastic_ep``, ``/is_scaling_elastic_ep``) and fault
tolerance (``/fault_tolerance/apply``, ``GET /fault_tolerance/status``), served without dev mode.

Prefix-cache reset:

- vLLM: ``POST /reset_prefix_cache`` (``?reset_running_requests=true`` / ``?reset_external=true`` when asked),
  served when the server runs with ``VLLM_SERVER_DEV_MODE=1``; it answers ``{"success": false}`` while blocks are
  still in use (running requests, unless reset with them) and announces a reset with an ``AllBlocksCleared`` KV
  event. Older servers answer 200 with no body: a success.
- SGLang: ``POST /flush_cache``: 200 flushed, 400 not flushed (requests still queued or running); it has no way
  to reset running requests or an external cache, so asking for either is refused here.

LoRA adapters (the server must allow it: vLLM with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``):

- vLLM: ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}``, ``POST /v1/unload_lora_adapter
  {"lora_name"}``: 200, or an error (already loaded, not found, not allowed) with its message;
- SGLang: the same bodies on ``/load_lora_adapter`` and ``/unload_lora_adapter`` (no in-place replacement).

``engine: openai``: vLLM's paths, tried as they are (a server that has none answers 404: said so).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from urllib.parse import parse_qs

import msgspec

from thunderagent.execution.handle import AdminResult
from thunderagent.execution.http_transport import HttpTransport, TransportError

#: a server that does not answer an operator's call in this long is reported as failed (it may still act)
ADMIN_TIMEOUT_S = 10.0


class _Answer(msgspec.Struct):
    success: bool = True


_answer = msgspec.json.Decoder(_Answer)


#: what a missing vLLM operator path needs on the server
_DEV_HINT = " (vLLM serves it with VLLM_SERVER_DEV_MODE=1)"


async def _post(transport: HttpTransport, url: str, path: str, body: bytes, timeout: float,
                get: bool = False) -> tuple[int, str] | AdminResult:
    """The server's status and text (``get``: a GET, no body), or the failure to reach it."""
    try:
        async with asyncio.timeout(timeout), (transport.stream_get(url + path) if get
                                              else transport.stream_post(url + path, body)) as resp:
            return resp.status, await resp.text()
    except TimeoutError:
        return AdminResult(False, f"{path} did not answer within {timeout:g}s")
    except (TransportError, OSError) as e:
        return AdminResult(False, f"{path}: {e}")


def _refusal(path: str, status: int, text: str, hint: str = "") -> AdminResult:
    """The server's refusal in OpenAI's error shape (vLLM's: its message), else a 404 is the path itself missing
    (FastAPI's ``{"detail": "Not Found"}``), else the text as it came."""
    try:
        got = json.loads(text)
    except ValueError:
        got = None
    err = got.get("error") if isinstance(got, dict) else None
    if isinstance(err, dict) and "message" in err:  # OpenAI's shape
        msg = str(err["message"])
    elif isinstance(err, str):  # vLLM's RL paths: {"error": "..."}
        msg = err
    elif isinstance(got, dict) and isinstance(got.get("detail"), str) and got["detail"] != "Not Found":
        msg = got["detail"]  # FastAPI's HTTPException
    elif status == 404:
        return AdminResult(False, f"the server has no {path.split('?')[0]}{hint}")
    else:
        msg = text.strip()
    return AdminResult(False, f"HTTP {status}: {msg[:300]}")


async def reset_server(transport: HttpTransport, url: str, flavor: str, running: bool, external: bool,
                       timeout: float = ADMIN_TIMEOUT_S) -> AdminResult:
    """Ask the server at ``url`` (of engine ``flavor``: ``vllm``, ``sglang``, ``openai``) to empty its prefix
    cache."""
    if flavor == "sglang":
        if running or external:
            return AdminResult(False, "SGLang's /flush_cache resets neither running requests nor an external cache "
                                      "(it flushes only an idle server)")
        path = "/flush_cache"
    else:
        query = "&".join(q for q, on in (("reset_running_requests=true", running), ("reset_external=true", external))
                         if on)
        path = "/reset_prefix_cache" + (f"?{query}" if query else "")
    got = await _post(transport, url, path, b"", timeout)
    if isinstance(got, AdminResult):
        return got
    status, text = got
    if status != 200:  # (SGLang: 400, not flushed: the server is busy)
        return _refusal(path, status, text, "" if flavor == "sglang" else _DEV_HINT)
    if flavor == "sglang" or not text.strip():  # (vLLM before {"success": ...}: an empty 200)
        return AdminResult(True)
    try:
        ok = _answer.decode(text).success
    except (msgspec.DecodeError, msgspec.ValidationError):
        return AdminResult(False, f"an answer that is not vLLM's: {text.strip()[:200]}")
    return AdminResult(True) if ok else AdminResult(False, "the server refused: blocks are still in use (requests "
                                                           "running or queued; reset_running_requests resets them "
                                                           "too)")


PAUSE_MODES = ("abort", "wait", "keep")


async def pause_server(transport: HttpTransport, url: str, flavor: str, paused: bool, mode: str, clear_cache: bool,
                       timeout: float = ADMIN_TIMEOUT_S) -> AdminResult:
    """Pause the server's generation (vLLM's ``/pause?mode=...&clear_cache=...``) or resume it (``/resume``)."""
    if flavor == "sglang":
        return AdminResult(False, "SGLang's pause is not driven by ThunderAgent (vLLM's /pause and /resume are)")
    path = f"/pause?mode={mode}&clear_cache={'true' if clear_cache else 'false'}" if paused else "/resume"
    got = await _post(transport, url, path, b"", timeout)
    if isinstance(got, AdminResult):
        return got
    status, text = got
    if status == 200:
        return AdminResult(True)
    return _refusal(path, status, text, _DEV_HINT)


@dataclass(frozen=True, slots=True)
class ServerPath:
    """One of vLLM's operator paths sent to servers as the caller gave it (``server_call``)."""

    method: str  # GET or POST
    query: tuple[str, ...] = ()  # the query parameters it takes (checked by the frontend; sent url-encoded)
    body: bool = False  # a JSON object body, sent as it came
    timeout_s: float = ADMIN_TIMEOUT_S  # (a sleep, a wake-up or a weight update of a large model takes longer)
    max_answer: int = 64 * 1024  # the answer's bytes kept (a longer one is refused: a cut JSON would mislead)


_LONG_S = 600.0  # a server that moves weights or GPU memory: a large model's sleep or update takes minutes
#: vLLM's operator paths (VLLM_SERVER_DEV_MODE=1; profiling needs the server's --profiler-config; sleep levels >= 1
#: need --enable-sleep-mode on a GPU): path -> how it is called
SERVER_CALLS: dict[str, ServerPath] = {
    "/start_profile": ServerPath("POST"), "/stop_profile": ServerPath("POST"),
    "/reset_mm_cache": ServerPath("POST"), "/reset_encoder_cache": ServerPath("POST"),
    "/is_paused": ServerPath("GET"),
    "/sleep": ServerPath("POST", ("level", "mode"), timeout_s=_LONG_S),
    "/wake_up": ServerPath("POST", ("tags",), timeout_s=_LONG_S),
    "/is_sleeping": ServerPath("GET"),
    "/release_kv_cache_memory": ServerPath("POST", timeout_s=_LONG_S),
    "/collective_rpc": ServerPath("POST", body=True, timeout_s=_LONG_S),
    "/abort_requests": ServerPath("POST", body=True),
    # the RL weight transfer (vLLM's rl/online API)
    "/init_weight_transfer_engine": ServerPath("POST", body=True, timeout_s=_LONG_S),
    "/shutdown_weight_transfer_engine": ServerPath("POST", timeout_s=_LONG_S),
    "/start_weight_update": ServerPath("POST", timeout_s=_LONG_S),
    "/start_draft_weight_update": ServerPath("POST", timeout_s=_LONG_S),
    "/update_weights": ServerPath("POST", body=True, timeout_s=_LONG_S),
    "/finish_weight_update": ServerPath("POST", body=True, timeout_s=_LONG_S),
    "/update_weight_version": ServerPath("POST", body=True),
    "/weight_info": ServerPath("GET"),
    "/weight_checker": ServerPath("POST", body=True, timeout_s=_LONG_S),
    "/get_world_size": ServerPath("GET", ("include_dp",)),
    # the server's configuration and environment (its whole VllmConfig: tens of KB)
    "/server_info": ServerPath("GET", ("config_format",), max_answer=512 * 1024),  # (within a NATS message)
    # elastic expert parallelism (served without dev mode by a server that generates): one server's data-parallel size
    "/scale_elastic_ep": ServerPath("POST", body=True, timeout_s=_LONG_S),
    "/is_scaling_elastic_ep": ServerPath("POST"),
    # fault tolerance (a server started with it): a recovery instruction (202: accepted), its status
    "/fault_tolerance/apply": ServerPath("POST", body=True),
    "/fault_tolerance/status": ServerPath("GET"),
}
#: what a query may hold once url-encoded (the worker process refuses anything else: nothing but the path's own
#: parameters reaches the server)
_QUERY = re.compile(r"^[A-Za-z0-9_.~%+=&-]{0,2048}$")


async def call_server(transport: HttpTransport, url: str, flavor: str, path: str, query: str = "", body: bytes = b"",
                      timeout: float | None = None) -> AdminResult:
    """One of :data:`SERVER_CALLS` on the server at ``url`` (``query``: url-encoded, without the ``?``; ``body``: the
    JSON body of a path that takes one); the server's body in ``answer``."""
    call = SERVER_CALLS.get(path)
    if call is None:
        return AdminResult(False, f"{path[:80]!r} is not one of the calls sent to servers")
    if flavor == "sglang":
        return AdminResult(False, f"SGLang has no {path} (vLLM's)")
    if not _QUERY.match(query) or (query and not call.query):
        return AdminResult(False, f"{path} takes {', '.join(call.query) or 'no query'}: not {query[:80]!r}")
    if body and not call.body:
        return AdminResult(False, f"{path} takes no body")
    full = path + (f"?{query}" if query else "")
    got = await _post(transport, url, full, body or (b"{}" if call.body else b""), timeout or call.timeout_s,
                      get=call.method == "GET")
    if isinstance(got, AdminResult):
        return got
    status, text = got
    if status in (200, 202):  # (202: vLLM's fault-tolerance instruction accepted, carried out in the background)
        if len(text) > call.max_answer:
            return AdminResult(False, f"{path}: an answer of {len(text)} characters, more than the "
                                      f"{call.max_answer} kept")
        return AdminResult(True, answer=text)
    return _refusal(path, status, text, "" if path.startswith(("/scale_elastic", "/is_scaling", "/fault"))
                    else _DEV_HINT)


def sleep_effect(path: str, query: str, answer: str | None) -> tuple[bool | None, bool]:
    """What a call that the server did means for routing: (asleep now: True / False, None unchanged; its prefix cache
    emptied). vLLM's ``/sleep`` (any level) pauses its scheduling, and from level 1 discards the KV cache; ``/wake_up``
    answers ``{"status": "awake"}`` once all of it is resident again (``"sleeping"`` after a partial wake-up: only
    some ``tags``); ``/release_kv_cache_memory`` discards the KV cache of a paused server."""
    if path == "/sleep":
        level = parse_qs(query).get("level", ["1"])[-1]
        return True, level != "0"
    if path == "/wake_up":
        try:
            status = json.loads(answer or "").get("status")
        except (ValueError, AttributeError):
            status = None
        return status == "sleeping", False  # (an answer without a status: an older server, woken whole)
    return None, path == "/release_kv_cache_memory"


async def adapter_server(transport: HttpTransport, url: str, flavor: str, name: str, path: str | None,
                         inplace: bool, timeout: float = ADMIN_TIMEOUT_S) -> AdminResult:
    """Load the LoRA adapter ``name`` from ``path`` on the server at ``url``, or unload it (``path`` None)."""
    prefix = "" if flavor == "sglang" else "/v1"
    if path is None:
        call, body = f"{prefix}/unload_lora_adapter", {"lora_name": name}
    else:
        if inplace and flavor == "sglang":
            return AdminResult(False, "SGLang replaces no adapter in place: unload it, then load it")
        call = f"{prefix}/load_lora_adapter"
        body = {"lora_name": name, "lora_path": path, **({"load_inplace": True} if inplace else {})}
    got = await _post(transport, url, call, json.dumps(body).encode(), timeout)
    if isinstance(got, AdminResult):
        return got
    status, text = got
    if status == 200:
        return AdminResult(True)
    return _refusal(call, status, text, "" if flavor == "sglang" else
                    " (vLLM serves it with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
