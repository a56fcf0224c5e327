"""A server's prefix cache emptied over HTTP (``WorkerHandle.reset_prefix_cache`` of a vLLM, SGLang or
OpenAI-compatible server's worker; the operator's call: ``control/cache_reset.py``).

- vLLM: ``POST /reset_prefix_cache`` (``?reset_running_requests=true`` / ``?reset_external=true`` when asked),
  served when the server runs with ``VLLM_SERVER_DEV_MODE=1``; it answers ``{"success": false}`` while blocks are
  still in use (running requests, unless reset with them) and announces a reset with an ``AllBlocksCleared`` KV
  event. Older servers answer 200 with no body: a success.
- SGLang: ``POST /flush_cache``: 200 flushed, 400 not flushed (requests still queued or running); it has no way
  to reset running requests or an external cache, so asking for either is refused here.
- ``engine: openai``: vLLM's path, tried as it is (a server that has none answers 404: said so).
"""

from __future__ import annotations

import asyncio

import msgspec

from thunderagent.execution.handle import CacheReset
from thunderagent.execution.http_transport import HttpTransport, TransportError

#: a server that does not answer its reset in this long is reported as failed (the reset may still happen)
RESET_TIMEOUT_S = 10.0


class _Answer(msgspec.Struct):
    success: bool = True


_answer = msgspec.json.Decoder(_Answer)


def _call(flavor: str, running: bool, external: bool) -> tuple[str | None, str | None]:
    """(the server's path, or None with why it cannot)."""
    if flavor == "sglang":
        if running or external:
            return None, ("SGLang's /flush_cache resets neither running requests nor an external cache "
                          "(it flushes only an idle server)")
        return "/flush_cache", None
    query = "&".join(q for q, on in (("reset_running_requests=true", running), ("reset_external=true", external))
                     if on)
    return "/reset_prefix_cache" + (f"?{query}" if query else ""), None


async def reset_server(transport: HttpTransport, url: str, flavor: str, running: bool, external: bool,
                       timeout: float = RESET_TIMEOUT_S) -> CacheReset:
    """Ask the server at ``url`` (of engine ``flavor``: ``vllm``, ``sglang``, ``openai``) to empty its prefix
    cache."""
    path, why = _call(flavor, running, external)
    if path is None:
        return CacheReset(False, why)
    try:
        async with asyncio.timeout(timeout), transport.stream_post(url + path, b"") as resp:
            status, text = resp.status, await resp.text()
    except TimeoutError:
        return CacheReset(False, error=f"{path} did not answer within {timeout:g}s")
    except (TransportError, OSError) as e:
        return CacheReset(False, error=f"{path}: {e}")
    if status == 404:
        hint = " (vLLM serves it with VLLM_SERVER_DEV_MODE=1)" if flavor != "sglang" else ""
        return CacheReset(False, error=f"the server has no {path.split('?')[0]}{hint}")
    if flavor == "sglang":  # 400: not flushed, the server is busy
        return CacheReset(True) if status == 200 else CacheReset(False, error=f"HTTP {status}: {text.strip()[:200]}")
    if status != 200:
        return CacheReset(False, error=f"HTTP {status}: {text.strip()[:200]}")
    if not text.strip():  # (vLLM before {"success": ...})
        return CacheReset(True)
    try:
        ok = _answer.decode(text).success
    except (msgspec.DecodeError, msgspec.ValidationError):
        return CacheReset(False, error=f"an answer that is not vLLM's: {text.strip()[:200]}")
    return CacheReset(True) if ok else CacheReset(False, error="the server refused: blocks are still in use "
                                                        "(requests running or queued; reset_running_requests "
                                                        "resets them too)")
