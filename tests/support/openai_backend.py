"""A scriptable OpenAI-compatible server for the ``engine: openai`` tests (in the test's event loop).

Like ``bench/fake_backend.py`` (``max_tokens`` letters ``x``, SSE or JSON, chat and completions),
plus what the tests steer: every body received is kept (``bodies``), ``status`` makes it refuse
requests with that HTTP status and an OpenAI error body, ``die_after`` cuts a stream's connection
after that many tokens, ``metrics`` serves a vLLM-shaped ``/metrics`` page (else 404), ``step_s``
paces the tokens, ``models`` are what it lists in ``/v1/models`` and serves (another name is a 404, as
vLLM answers it), ``api_key`` the key it demands on every path (a 401 without it; ``seen_keys`` counts the
Authorization headers it got, by path); ``POST /v1/audio/transcriptions`` keeps each form (``forms``) and
answers a text naming the server and the file's size. 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

MODEL = "fake-model"


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@dataclass
class OpenAIBackend:
    name: str = "b"
    status: int = 200  # != 200: refuse every generation with this status
    die_after: int | None = None  # cut a stream's connection after this many tokens
    metrics: bool = False
    step_s: float = 0.0
    running: int = 0
    peak: int = 0  # most requests in progress at once
    delay_s: float = 0.0  # a non-streamed answer takes this long
    bodies: list[dict] = field(default_factory=list)
    url: str = ""
    models: list[str] = field(default_factory=lambda: [MODEL])
    api_key: str | None = None
    seen_keys: dict[str, int] = field(default_factory=dict)  # path -> requests that carried the right key
    headers: list[dict[str, str]] = field(default_factory=list)  # each generation request's headers
    forms: list[dict[str, str | bytes]] = field(default_factory=list)  # speech-to-text forms received (file: bytes)

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/audio/transcriptions", self._audio)
        if self.metrics:
            app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _audio(self, request: web.Request) -> web.Response:
        form = await request.post()
        got: dict[str, str | bytes] = {k: v for k, v in form.items() if isinstance(v, str)}
        upload = form.get("file")
        if isinstance(upload, web.FileField):
            got["file"] = upload.file.read()
        self.forms.append(got)
        return web.json_response({"text": f"{self.name} heard {len(got.get('file', b''))} bytes"})

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
        if self.api_key is not None:
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            self.seen_keys[request.path] = self.seen_keys.get(request.path, 0) + 1
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_running {self.running}\nvllm:num_requests_waiting 3\n"
                                 "vllm:kv_cache_usage_perc 0.25\n")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if body.get("model") not in self.models:
            err = {"error": {"message": f"The model `{body.get('model')}` does not exist.", "type": "NotFoundError",
                             "param": None, "code": 404}}
            return web.json_response(err, status=404)
        if self.status != 200:
            err = {"error": {"message": f"{self.name} refuses", "type": "BadRequestError", "param": None,
                             "code": self.status}}
            return web.json_response(err, status=self.status)
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        cid, obj = f"{self.name}-{len(self.bodies)}", "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
        if not body.get("stream"):
            self.running += 1
            self.peak = max(self.peak, self.running)
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.running -= 1
            choice: dict = ({"index": 0, "message": {"role": "assistant", "content": "x" * n}} if chat
                            else {"index": 0, "text": "x" * n})
            choice["finish_reason"] = "length"
            return web.json_response({"id": cid, "object": obj, "model": body["model"], "choices": [choice],
                                      "usage": usage,
                                      "served_by": self.name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.running += 1
        try:
            if chat:
                await resp.write(_event({"id": cid, "object": obj + ".chunk", "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
            for i in range(n):
                if self.die_after is not None and i == self.die_after:
                    request.transport.close()  # type: ignore[union-attr]  # the server dies mid-stream
                    return resp
                if self.step_s:
                    await asyncio.sleep(self.step_s)
                finish = "length" if i == n - 1 else None
                choice = ({"index": 0, "delta": {"content": "x"}, "finish_reason": finish} if chat
                          else {"index": 0, "text": "x", "finish_reason": finish})
                await resp.write(_event({"id": cid, "object": obj + (".chunk" if chat else ""),
                                         "choices": [choice], "served_by": self.name}))
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(_event({"id": cid, "object": obj, "choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            self.running -= 1
        return resp
