"""A tiny fake OpenAI-compatible backend for proxy benchmarks (aiohttp, no model, no delay).

Answers immediately:
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: ``max_tokens`` tokens (default 1) of
  the letter ``x``, as one JSON body or as server-sent events (one event per token, then a usage
  event when ``stream_options.include_usage`` is set, then ``[DONE]``),
- ``GET /health``, ``/health_generate``, ``/v1/models``, ``/get_model_info``, ``/model_info``,
  ``/get_server_info``, ``/server_info``, ``/get_load``: what sglang-router probes at startup and
  while it runs (SGLang worker shape).

Run: ``python bench/fake_backend.py [--port 0] [--log-requests]``. It prints ``PORT <n>`` on stdout
once it listens (port 0 = pick a free one), and serves until killed. 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from aiohttp import web

MODEL = "fake-model"


def _chunk(cid: str, chat: bool, text: str | None, finish: str | None, **extra: object) -> bytes:
    if chat:
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    payload = {
        "id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()), "model": MODEL, "choices": [choice] if text is not None or finish else [],
        **extra,
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    body = json.loads(await request.read() or b"{}")
    n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 1)
    cid = ("chatcmpl-" if chat else "cmpl-") + format(id(body), "x")
    usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
    if not body.get("stream"):
        text = "x" * n
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": "length", "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        out = {"id": cid, "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": MODEL, "choices": [choice], "usage": usage}
        return web.Response(body=json.dumps(out).encode(), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for i in range(n):
        await resp.write(_chunk(cid, chat, "x", "length" if i == n - 1 else None))
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(_chunk(cid, chat, None, None, usage=usage))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="OK")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]})


async def model_info(request: web.Request) -> web.Response:
    return web.json_response({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True})


async def server_info(request: web.Request) -> web.Response:
    return web.json_response({"model_path": MODEL, "tokenizer_path": MODEL, "dp_size": 1,
                              "tp_size": 1, "version": "fake", "max_total_num_tokens": 1 << 20})


async def load(request: web.Request) -> web.Response:
    return web.json_response({"load": 0})


def create_backend(log_requests: bool = False) -> web.Application:
    middlewares = []
    if log_requests:
        @web.middleware
        async def log(request: web.Request, handler):  # type: ignore[no-untyped-def]
            resp = await handler(request)
            print(f"{request.method} {request.path} -> {resp.status}", file=sys.stderr, flush=True)
            return resp
        middlewares.append(log)
    app = web.Application(middlewares=middlewares)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    for path in ("/health", "/health_generate", "/readiness", "/liveness"):
        app.router.add_get(path, ok)
    app.router.add_get("/v1/models", models)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/get_load", load)
    return app


async def _serve(port: int, log_requests: bool) -> None:
    runner = web.AppRunner(create_backend(log_requests), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"PORT {bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log-requests", action="store_true", help="print every request (method, path, status) on stderr")
    args = ap.parse_args()
    try:
        asyncio.run(_serve(args.port, args.log_requests))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
