"""An operator's calls on a real server, over HTTP (``WorkerHandle.reset_prefix_cache`` and ``set_adapter`` of a
vLLM, SGLang or OpenAI-compatible server's worker; fanned out to the fleet by ``control/server_admin.py``).

Generation paused and resumed (vLLM with ``VLLM_SERVER_DEV_MODE=1``: ``POST /pause?mode=abort|wait|keep&clear_cache=``,
``POST /resume``; new requests wait in the server meanwhile; SGLang's own pause is not driven here).

Calls without parameters (``SERVER_CALLS``): vLLM's ``/start_profile``, ``/stop_profile``, ``/reset_mm_cache``,
``/reset_encoder_cache`` and ``GET /is_paused``, sent as they are, the answer's body kept.

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
        msg = str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        if status == 404:
            return AdminResult(False, f"the server has no {path.split('?')[0]}{hint}")
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


#: vLLM's operator paths that take nothing and are sent to every server as they are (VLLM_SERVER_DEV_MODE=1;
#: profiling needs the server's --profiler-config): path -> HTTP method
SERVER_CALLS = {"/start_profile": "POST", "/stop_profile": "POST", "/reset_mm_cache": "POST",
                "/reset_encoder_cache": "POST", "/is_paused": "GET"}
_MAX_ANSWER = 64 * 1024  # (an answer longer than this is cut: these answer a few bytes)


async def call_server(transport: HttpTransport, url: str, flavor: str, path: str,
                      timeout: float = ADMIN_TIMEOUT_S) -> AdminResult:
    """One of :data:`SERVER_CALLS` on the server at ``url``; its body in ``answer``."""
    method = SERVER_CALLS.get(path)
    if method is None:
        return AdminResult(False, f"{path[:80]!r} is not one of the calls sent to servers")
    if flavor == "sglang":
        return AdminResult(False, f"SGLang has no {path} (vLLM's)")
    got = await _post(transport, url, path, b"", timeout, get=method == "GET")
    if isinstance(got, AdminResult):
        return got
    status, text = got
    if status == 200:
        return AdminResult(True, answer=text[:_MAX_ANSWER])
    return _refusal(path, status, text, _DEV_HINT)


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
