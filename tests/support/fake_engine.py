"""A fake engine *server* speaking vLLM's (or SGLang's) wire: HTTP completions, Prometheus metrics and
ZMQ KV events with replay, so the real-engine adapter can be tested without a model.

- ``POST /v1/completions`` with a token-id prompt streams ``max_tokens`` letters (one SSE chunk per
  token, with ``token_ids`` in vLLM's flavour only, as the engines do), then a usage chunk whose
  ``prompt_tokens_details.cached_tokens`` counts the prompt's leading full blocks already cached;
- the prompt's full blocks are cached (LRU over ``num_blocks``) and announced as ``BlockStored``
  events with opaque engine hashes, evictions as ``BlockRemoved``; batches are numbered from 0 and
  kept for the replay ROUTER socket; the publisher is an XPUB, so :meth:`FakeEngine.wait_subscribed`
  can wait until a subscriber's subscription has arrived (a PUB drops what it sends before that:
  ZMQ's slow joiner, which a test's first request would otherwise race on a loaded machine);
- ``POST /v1/chat/completions`` (a relayed request: the client's body): the prompt is what ``render``
  makes of the body (the test passes the model's template; none: empty), cached as above; the answer
  calls the first of the request's ``tools`` (``tool_choice`` not ``"none"``) or says ``"ok"``, whole or
  as SSE events, with the same usage;
- ``POST /v1/messages`` (Anthropic's Messages API, relayed): the prompt is what ``render_messages`` makes
  of the body, cached as above; the answer uses the first tool (``tool_choice`` not ``none``) or says
  ``"ok"``, as a message or as Anthropic's event stream, its usage with ``cache_read_input_tokens``; a
  ``temperature`` above 1 is refused with Anthropic's error (400), as Anthropic's API does;
- ``POST /v1/responses`` (OpenAI's Responses API, relayed): the prompt is what ``render_responses`` makes of
  the body, cached as above; the answer calls the first function tool or says ``"ok"``, as a response or
  as its event stream, with ``usage.input_tokens_details.cached_tokens``; each response id is kept, and a
  ``previous_response_id`` this server did not answer is a 404 (vLLM keeps stored responses in memory);
  ``GET /v1/responses/{id}`` answers a stored one (404 for any other), ``POST .../cancel`` a 400 as vLLM does
  for a response that is not a background one;
- ``POST /v1/embeddings``, ``/score``, ``/rerank``, ``/tokenize``, ``/detokenize`` (and vLLM's other pooling
  paths): a JSON answer naming this server (``served_by``) and echoing the body's ``model``; the bodies land
  in ``pooled``; a body with ``"fail": true`` is a 400 in OpenAI's shape;
- ``dev_mode``: ``POST /reset_prefix_cache`` (SGLang: ``/flush_cache``) empties the cache, publishes
  ``AllBlocksCleared`` and answers as vLLM does (``{"success": false}`` while a request runs, unless
  ``reset_running_requests=true``; SGLang: 400);
- ``dev_mode`` also: vLLM's ``POST /pause?mode=&clear_cache=`` (completions sent meanwhile wait; the cache
  cleared and announced unless ``clear_cache=false`` or ``mode=keep``; ``mode=abort``: streamed completions in
  flight end with ``finish_reason: abort``, waiting ones as vLLM ends a request aborted before its first token, as
  ``/abort_requests`` without ids ends them) and ``POST /resume``, kept in ``pauses``;
  ``GET /is_paused``, ``POST /start_profile``, ``/stop_profile``, ``/reset_mm_cache``, ``/reset_encoder_cache``
  (200, kept in ``dev_calls``); sleep mode as vLLM 0.32 runs it: ``POST /sleep?level=&mode=`` pauses (level >= 1
  also clears the cache and puts ``weights`` and ``kv_cache`` to sleep), ``POST /wake_up?tags=`` wakes those tags
  (all without any) and resumes once all are awake, ``GET /is_sleeping``; ``/release_kv_cache_memory`` clears the
  cache of a paused server; ``/collective_rpc`` answers ``{"results": ["<url> <method>"]}`` (400 without
  ``method``), ``/abort_requests`` and the weight-transfer paths ``{"message": ...}``; the queries in ``dev_calls``
  (``/sleep?level=1``), the bodies in ``rpc_calls``;
- ``lora_updating``: vLLM's ``POST /v1/load_lora_adapter`` / ``unload_lora_adapter`` (SGLang: without ``/v1``) add
  the name to ``adapters`` or take it out (400 already loaded, unless ``load_inplace``; 404 not loaded), the
  calls kept in ``lora_calls``;
- ``GET /tokenizer_info``: a JSON answer naming this server (lands in ``pooled``); ``POST /v1/audio/transcriptions``
  and ``/translations``: the form read by aiohttp's parser (its fields and the file's bytes land in ``audio``),
  answered with a text naming the file's size, this server and the form's ``model``: JSON, text
  (``response_format`` text / srt / vtt) or, with ``stream`` true, transcription chunks and ``[DONE]``; a form
  without a file or with ``fail`` is a 400;
- ``GET /metrics``: running / waiting / KV usage (and vLLM's ``cache_config_info``);
- ``api_key``: the paths under ``/v1`` demand it as ``Authorization: Bearer`` (a 401 without it), as vLLM's
  ``--api-key`` does (``/metrics`` stays open);
- a client that hangs up aborts its request.
Runs inside the test's event loop; every socket is on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from support.kv_frames import encode_batch


@dataclass
class FakeEngine:
    flavor: str = "vllm"  # or "sglang"
    block_size: int = 32
    num_blocks: int = 512
    step_s: float = 0.002
    url: str = ""
    events: str = ""  # PUB endpoint
    replay: str = ""  # ROUTER endpoint
    running: int = 0
    max_model_len: int | None = None  # in its model card, as vLLM's and SGLang's
    requests: list[dict] = field(default_factory=list)  # bodies received
    chats: list[dict] = field(default_factory=list)  # chat bodies received (relayed requests)
    render: Callable[[dict], list[int]] | None = None  # a chat body -> the prompt's token ids
    render_messages: Callable[[dict], list[int]] | None = None  # a Messages API body -> the prompt's token ids
    messages: list[dict] = field(default_factory=list)  # Messages API bodies received
    render_responses: Callable[[dict], list[int]] | None = None  # a Responses API body -> the prompt's token ids
    responses: list[dict] = field(default_factory=list)  # Responses API bodies received
    pooled: list[tuple[str, dict]] = field(default_factory=list)  # (path, body) of pooling / tokenizer requests
    audio: list[tuple[str, dict]] = field(default_factory=list)  # (path, form's text fields + the file's bytes)
    dev_mode: bool = False  # serves /reset_prefix_cache (vLLM with VLLM_SERVER_DEV_MODE=1) or SGLang's /flush_cache
    resets: list[dict[str, str]] = field(default_factory=list)  # the query of each reset asked
    pauses: list[dict[str, str]] = field(default_factory=list)  # each /pause's query ({"resume": ""}: a /resume)
    _resumed: asyncio.Event = field(default_factory=asyncio.Event)
    _aborting: bool = False  # a pause in abort mode is ending the streams in flight
    _aborts: int = 0  # aborts of everything (a pause in abort mode, /abort_requests without ids) so far
    dev_calls: list[str] = field(default_factory=list)  # profiling, the multimodal caches' resets, sleep mode
    paused_reads: int = 0  # GET /is_paused answered (a load poll's, or an operator's)
    server_info_padding: int = 0  # /server_info's answer is this many bytes longer
    asleep_tags: set[str] = field(default_factory=set)  # what sleeps (vLLM's executor: weights, kv_cache)
    sleeping: bool = False  # what its metrics say (vLLM's vllm:engine_sleep_state: set by a sleep, a KV release)
    rpc_calls: list[tuple[str, dict]] = field(default_factory=list)  # (path, body) of the body-taking operator calls
    lora_updating: bool = False  # serves vLLM's runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
    lora_calls: list[tuple[str, dict]] = field(default_factory=list)  # (path, body) of each load / unload asked
    reads: list[str] = field(default_factory=list)  # the stored-response paths asked for (GET and cancel)
    _events: dict[str, list[tuple[str, dict]]] = field(default_factory=dict)  # each response's, to replay
    adapters: list[str] = field(default_factory=list)  # LoRA adapters it lists in /v1/models (parent: the base)
    api_key: str | None = None  # what its /v1 paths demand (vLLM's --api-key)
    traced: list[tuple[str, str | None, str | None]] = field(default_factory=list)  # (path, traceparent, request id)
    _cache: OrderedDict[int, None] = field(default_factory=OrderedDict)  # engine hash -> (LRU order)
    _batches: list[list[bytes]] = field(default_factory=list)
    _answered: dict[str, dict] = field(default_factory=dict)  # the responses it answered, by id (its "store")
    _start: float = field(default_factory=time.time)

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._resumed.set()
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/responses/{rid}", self._stored)
        app.router.add_post("/v1/responses/{rid}/cancel", self._stored)
        for path in ("/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                     "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize"):
            app.router.add_post(path, self._pooling)
        app.router.add_get("/tokenizer_info", self._tokenizer_info)
        if self.dev_mode:
            app.router.add_post("/reset_prefix_cache" if self.flavor == "vllm" else "/flush_cache", self._reset)
            app.router.add_post("/pause", self._pause)
            app.router.add_post("/resume", self._pause)
            app.router.add_get("/is_paused", self._dev_call)
            for path in ("/start_profile", "/stop_profile", "/reset_mm_cache", "/reset_encoder_cache"):
                app.router.add_post(path, self._dev_call)
            for path in ("/sleep", "/wake_up", "/release_kv_cache_memory"):
                app.router.add_post(path, self._sleep)
            app.router.add_get("/is_sleeping", self._sleep)
            for path in ("/collective_rpc", "/abort_requests", "/init_weight_transfer_engine", "/update_weights",
                         "/finish_weight_update"):
                app.router.add_post(path, self._rpc)
            app.router.add_get("/server_info", self._server_info)
        if self.flavor == "vllm":  # (vLLM serves these without dev mode: elastic EP, fault tolerance)
            app.router.add_post("/scale_elastic_ep", self._rpc)
            app.router.add_post("/is_scaling_elastic_ep", self._rpc)
            app.router.add_post("/fault_tolerance/apply", self._rpc)
            app.router.add_get("/fault_tolerance/status", self._server_info)
        if self.lora_updating:
            prefix = "/v1" if self.flavor == "vllm" else ""
            app.router.add_post(f"{prefix}/load_lora_adapter", self._load_adapter)
            app.router.add_post(f"{prefix}/unload_lora_adapter", self._unload_adapter)
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            app.router.add_post(path, self._audio)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind("tcp://127.0.0.1:*")
        self.events = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:*")
        self.replay = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._replayer = asyncio.create_task(self._serve_replay())
        self._subscribed = asyncio.Event()
        self._watcher = asyncio.create_task(self._watch_subscriptions())

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
        if request.method == "POST":
            self.traced.append((request.path, request.headers.get("traceparent"), request.headers.get("x-request-id")))
        if self.api_key is not None and request.path.startswith("/v1") and \
                request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def wait_subscribed(self, timeout: float = 30.0) -> None:
        """Until a subscriber's subscription reached the publisher: what is published then arrives."""
        await asyncio.wait_for(self._subscribed.wait(), timeout)

    async def _watch_subscriptions(self) -> None:
        while True:
            msg = await self._pub.recv()
            if msg[:1] == b"\x01":  # XPUB: 1 + topic subscribes, 0 + topic unsubscribes
                self._subscribed.set()

    async def stop(self) -> None:
        self._replayer.cancel()
        self._watcher.cancel()
        await asyncio.gather(self._replayer, self._watcher, return_exceptions=True)
        await self._runner.cleanup()
        self._ctx.destroy(linger=0)

    # -- HTTP ----------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        card: dict[str, object] = {"id": "fake-model", "object": "model"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        loras = [{"id": a, "object": "model", "root": f"/loras/{a}", "parent": "fake-model"} for a in self.adapters]
        return web.json_response({"object": "list", "data": [card, *loras]})

    async def _metrics(self, request: web.Request) -> web.Response:
        usage = len(self._cache) / self.num_blocks
        if self.flavor == "vllm":
            lines = [f'vllm:num_requests_running{{engine="0"}} {self.running}',
                     'vllm:num_requests_waiting{engine="0"} 0',
                     f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}',
                     f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True",'
                     f'num_gpu_blocks="{self.num_blocks}"}} 1.0']
            if self.dev_mode:  # (vLLM's sleep gauge: awake 0 from a sleep or a KV release until woken whole)
                lines += [f'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="{state}"}} {value}'
                          for state, value in (("awake", int(not self.sleeping)), ("weights_offloaded", 0),
                                               ("discard_all", 0))]
        else:
            lines = [f"sglang:num_running_reqs {self.running}", "sglang:num_queue_reqs 0",
                     f"sglang:token_usage {usage}"]
        lines.append(f"process_start_time_seconds {self._start}")
        return web.Response(text="\n".join(lines) + "\n")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        aborted = not await self._wait_resumed()  # (paused: the request waits, as vLLM's do)
        prompt: list[int] = body["prompt"]
        if isinstance(prompt, str):  # a relayed completion: the client's text (bytes stand in for tokens)
            prompt = list(prompt.encode())
        if aborted:  # as vLLM ends a request aborted before its first token
            return await self._aborted(request, body, len(prompt))
        max_tokens = int(body.get("max_tokens", 16))
        cached = self._prefill(prompt)
        if not body.get("stream"):  # a relayed completion the client did not stream (the token path streams)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens, "total_tokens": len(prompt) +
                     max_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
            text = "".join(chr(97 + k % 26) for k in range(max_tokens))
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                                      "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.running += 1
        try:
            for k in range(max_tokens):
                await asyncio.sleep(self.step_s)
                tok = 97 + k % 26
                aborted = self._aborting
                last = k == max_tokens - 1 or aborted
                choice: dict[str, object] = {"index": 0, "text": chr(tok),
                                             "finish_reason": ("abort" if aborted else "length") if last else None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [tok]
                await resp.write(_sse({"choices": [choice]}))
                if aborted:  # (vLLM's pause in abort mode: the request ends here, what it made so far)
                    max_tokens = k + 1
                    break
            usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            await resp.write(_sse({"choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # the client hung up: the request is aborted
        finally:
            self.running -= 1
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.chats.append(body)
        prompt = self.render(body) if self.render is not None else []
        cached = self._prefill(prompt)
        tools = body.get("tools") or []
        if tools and body.get("tool_choice") != "none":
            name = tools[0]["function"]["name"]
            message: dict[str, object] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call-{len(self.chats)}", "type": "function", "function": {"name": name, "arguments": "{}"}}]}
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": "ok"}, "stop"
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        head = {"id": f"chatcmpl-{len(self.chats)}", "model": body["model"], "created": 0}
        if not body.get("stream"):
            return web.json_response({**head, "object": "chat.completion", "usage": usage,
                                      "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {**head, "object": "chat.completion.chunk"}
        await resp.write(_sse({**chunk, "choices": [{"index": 0, "delta": message, "finish_reason": None}]}))
        await resp.write(_sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}))
        await resp.write(_sse({**chunk, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.messages.append(body)
        if body.get("temperature", 0) > 1:
            return web.json_response({"type": "error", "error": {
                "type": "invalid_request_error", "message": "temperature: must be at most 1"}}, status=400)
        prompt = self.render_messages(body) if self.render_messages is not None else []
        cached = self._prefill(prompt)
        tools = body.get("tools") or []
        if tools and (body.get("tool_choice") or {}).get("type") != "none":
            block: dict[str, object] = {"type": "tool_use", "id": f"toolu_{len(self.messages)}",
                                        "name": tools[0]["name"], "input": {}}
            stop, delta = "tool_use", {"type": "input_json_delta", "partial_json": "{}"}
        else:
            block, stop, delta = {"type": "text", "text": "ok"}, "end_turn", {"type": "text_delta", "text": "ok"}
        usage = {"input_tokens": len(prompt) - cached, "output_tokens": 1, "cache_read_input_tokens": cached}
        head = {"id": f"msg_{len(self.messages)}", "type": "message", "role": "assistant", "model": body["model"]}
        if not body.get("stream"):
            return web.json_response({**head, "content": [block], "stop_reason": stop, "stop_sequence": None,
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = {**block, "input": {}} if block["type"] == "tool_use" else {"type": "text", "text": ""}
        for kind, data in (
                ("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": {**usage, "output_tokens": 0}}}),
                ("content_block_start", {"index": 0, "content_block": start}),
                ("content_block_delta", {"index": 0, "delta": delta}),
                ("content_block_stop", {"index": 0}),
                ("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": usage}),
                ("message_stop", {})):
            payload = json.dumps({"type": kind, **data}, separators=(",", ":")).encode()
            await resp.write(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")
        return resp

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.responses.append(body)
        prev = body.get("previous_response_id")
        if prev is not None and prev not in self._answered:
            return web.json_response({"error": {"message": f"Response with id '{prev}' not found.",
                                                "type": "invalid_request_error", "param": "previous_response_id",
                                                "code": None}}, status=404)
        prompt = self.render_responses(body) if self.render_responses is not None else []
        cached = self._prefill(prompt)
        rid = f"resp_{self.url.rsplit(':', 1)[-1]}_{len(self.responses)}"
        tools = [t for t in body.get("tools") or [] if t.get("type") == "function"]
        if tools:
            item: dict[str, object] = {"type": "function_call", "id": f"fc_{rid}", "call_id": f"call_{rid}",
                                       "name": tools[0]["name"], "arguments": "{}", "status": "completed"}
            delta = ("response.function_call_arguments.delta", "{}")
        else:
            item = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "ok", "annotations": []}]}
            delta = ("response.output_text.delta", "ok")
        usage = {"input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": len(prompt) + 1}
        done = {"id": rid, "object": "response", "created_at": 0, "model": body["model"], "status": "completed",
                "output": [item], "usage": usage, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        self._answered[rid] = done
        started = {**done, "status": "in_progress", "output": [], "usage": None}
        self._events[rid] = [
            ("response.created", {"response": started}),
            (delta[0], {"item_id": item["id"], "output_index": 0, "content_index": 0, "delta": delta[1]}),
            ("response.completed", {"response": done})]
        if not body.get("stream"):
            return web.json_response(done)
        return await self._replay(request, rid, -1)

    async def _replay(self, request: web.Request, rid: str, after: int) -> web.StreamResponse:
        """A response's events, those after sequence number ``after`` (vLLM replays a background one's so)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n, (kind, data) in enumerate(self._events[rid]):
            if n <= after:
                continue
            payload = json.dumps({"type": kind, "sequence_number": n, **data}, separators=(",", ":")).encode()
            await resp.write(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")
        return resp

    async def _stored(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        self.reads.append(request.path)
        if rid not in self._answered:
            return web.json_response({"error": {"message": f"Response with id '{rid}' not found.",
                                                "type": "invalid_request_error", "param": None, "code": None}},
                                     status=404)
        if request.method == "POST":
            return web.json_response({"error": {"message": "Cannot cancel a synchronous response.",
                                                "type": "invalid_request_error", "param": None, "code": None}},
                                     status=400)
        if request.query.get("stream") == "true":
            return await self._replay(request, rid, int(request.query.get("starting_after", -1)))
        return web.json_response(self._answered[rid])

    async def _pooling(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.pooled.append((request.path, body))
        if body.get("fail"):
            return web.json_response({"error": {"message": "bad input", "type": "BadRequestError", "param": "input",
                                                "code": 400}}, status=400)
        return web.json_response({"object": "list", "served_by": self.url, "model": body.get("model"),
                                  "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
                                  "usage": {"prompt_tokens": 3, "total_tokens": 3}})

    async def _reset(self, request: web.Request) -> web.Response:
        """vLLM's answer: ``{"success": false}`` while requests run (unless ``reset_running_requests``); else the
        cache is emptied and ``AllBlocksCleared`` published. SGLang's: 200, or 400 while busy."""
        self.resets.append(dict(request.query))
        if self.running and request.query.get("reset_running_requests") != "true":
            if self.flavor == "sglang":
                return web.Response(status=400, text="Cache not flushed because there are pending requests.")
            return web.json_response({"success": False})
        self._clear_cache()
        return web.Response(text="Cache flushed.") if self.flavor == "sglang" else web.json_response({"success": True})

    def _clear_cache(self) -> None:
        """The cache emptied and ``AllBlocksCleared`` published (a reset, a clearing pause)."""
        self._cache.clear()
        frames = encode_batch(len(self._batches), [{"type": "AllBlocksCleared"}], time.time())
        self._batches.append(frames)
        self._pub.send_multipart(frames)

    async def _dev_call(self, request: web.Request) -> web.Response:
        if request.path == "/is_paused":  # (read with every load poll too: counted apart)
            self.paused_reads += 1
            return web.json_response({"is_paused": not self._resumed.is_set()})
        self.dev_calls.append(request.path)
        return web.Response()

    async def _wait_resumed(self) -> bool:
        """Until the server is resumed (True), or an abort of everything came first (False)."""
        aborts = self._aborts
        while not self._resumed.is_set():
            if self._aborts != aborts:
                return False
            await asyncio.sleep(0.01)
        return self._aborts == aborts

    async def _aborted(self, request: web.Request, body: dict, n_prompt: int) -> web.StreamResponse:
        """vLLM 0.32's answer to a completion aborted before its first token: unstreamed, no text and
        ``finish_reason: abort``; streamed, no choice at all (it skips an empty delta before it sets the finish
        reason), the usage and ``[DONE]``."""
        usage = {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                                      "choices": [{"index": 0, "text": "", "finish_reason": "abort"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        return resp

    async def _pause(self, request: web.Request) -> web.Response:
        """vLLM's ``/pause?mode=&clear_cache=`` (completions sent meanwhile wait) and ``/resume``."""
        if request.path == "/resume":
            self.pauses.append({"resume": ""})
            self._resumed.set()
            return web.json_response({"status": "resumed"})
        self.pauses.append(dict(request.query))
        if request.query.get("mode", "abort") not in ("abort", "wait", "keep"):
            return web.json_response({"error": f"bad mode {request.query.get('mode')}"}, status=400)
        mode = request.query.get("mode", "abort")
        await self._halt(mode, request.query.get("clear_cache", "true") == "true" and mode != "keep")
        return web.json_response({"status": "paused"})

    async def _halt(self, mode: str, clear: bool) -> None:
        self._resumed.clear()
        if mode == "abort":  # streams in flight end with finish_reason abort, the waiting requests too
            self._aborts += 1
            self._aborting = True
            while self.running:
                await asyncio.sleep(self.step_s)
            self._aborting = False
        if clear:
            self._clear_cache()

    async def _sleep(self, request: web.Request) -> web.Response:
        """vLLM 0.32's sleep mode: ``/sleep`` pauses (from level 1 the cache cleared, the executor's tags asleep),
        ``/wake_up`` wakes tags and resumes once none sleeps, ``/is_sleeping``, ``/release_kv_cache_memory``."""
        self.dev_calls.append(request.path_qs)
        if request.path == "/is_sleeping":
            return web.json_response({"is_sleeping": not self._resumed.is_set() or bool(self.asleep_tags)})
        if request.path == "/release_kv_cache_memory":
            if self._resumed.is_set():
                return web.json_response({"error": "release_kv_cache_memory() requires a completed pause first"},
                                         status=500)
            self._clear_cache()
            self.sleeping = True
            return web.json_response({"status": "kv_cache_released"})
        if request.path == "/sleep":
            level = int(request.query.get("level", "1"))
            await self._halt(request.query.get("mode", "abort"), level >= 1)
            if level >= 1:
                self.asleep_tags = {"weights", "kv_cache"}
            self.sleeping = True
            return web.json_response({"status": "sleeping", "level": level})
        tags = request.query.getall("tags", [])
        self.asleep_tags -= set(tags) if tags else self.asleep_tags
        if not self.asleep_tags:
            self._resumed.set()
            self.sleeping = False
        return web.json_response({"status": "sleeping" if self.asleep_tags else "awake", "tags": tags or None})

    async def _rpc(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.rpc_calls.append((request.path, body))
        if request.path == "/abort_requests" and not (body or {}).get("request_ids"):
            self._aborts += 1  # (everything: the requests waiting end; ids are not tracked here)
        if request.path == "/is_scaling_elastic_ep":
            return web.json_response({"is_scaling_elastic_ep": False})
        if request.path == "/fault_tolerance/apply":  # (vLLM: accepted, recovery runs in the background)
            if body.get("instruction") != "retry":
                return web.json_response({"detail": f"Invalid instruction: '{body.get('instruction')}'."}, status=400)
            return web.json_response({"message": "Request accepted", "request_id": "ft-1"}, status=202)
        if request.path != "/collective_rpc":
            return web.json_response({"message": f"{request.path} done"})
        if "method" not in body:
            return web.json_response({"detail": "Missing 'method' in request body"}, status=400)
        return web.json_response({"results": [f"{self.url} {body['method']}"]})

    async def _server_info(self, request: web.Request) -> web.Response:
        """vLLM's ``/server_info?config_format=text|json`` (dev mode; ``padding``: an answer that long) and
        ``/fault_tolerance/status``."""
        self.dev_calls.append(request.path_qs)
        if request.path == "/fault_tolerance/status":
            return web.json_response({"status": "healthy"})
        fmt = request.query.get("config_format", "text")
        config = {"model": "m", "block_size": self.block_size} if fmt == "json" else f"model=m, block_size={self.block_size}"
        return web.json_response({"vllm_config": config, "vllm_env": {"VLLM_SERVER_DEV_MODE": "1"},
                                  "system_env": {"padding": "x" * self.server_info_padding}})

    async def _load_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.lora_calls.append((request.path, body))
        name = body["lora_name"]
        if name in self.adapters and not body.get("load_inplace"):
            return _lora_error(f"The lora adapter '{name}' has already been loaded.", 400)
        if name not in self.adapters:
            self.adapters.append(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.lora_calls.append((request.path, body))
        name = body["lora_name"]
        if name not in self.adapters:
            return _lora_error(f"The lora adapter '{name}' cannot be found.", 404)
        self.adapters.remove(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _tokenizer_info(self, request: web.Request) -> web.Response:
        self.pooled.append((request.path, dict(request.query)))
        return web.json_response({"tokenizer_class": "FakeTokenizer", "served_by": self.url})

    async def _audio(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()  # (aiohttp's own multipart parser: not the one ThunderAgent reads with)
        upload = form.get("file")
        fields: dict[str, Any] = {k: v for k, v in form.items() if isinstance(v, str)}
        if isinstance(upload, web.FileField):
            fields["file"] = upload.file.read()
        self.audio.append((request.path, fields))
        if "file" not in fields or fields.get("fail"):
            return web.json_response({"error": {"message": "bad audio", "type": "BadRequestError", "param": "file",
                                                "code": 400}}, status=400)
        words = [f"heard {len(fields['file'])} bytes", f" on {self.url}", f" as {fields.get('model')}"]
        if fields.get("stream") == "true":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, w in enumerate(words):
                last = i == len(words) - 1
                chunk = {"object": "transcription.chunk", "choices": [{"delta": {"content": w},
                                                                       "finish_reason": "stop" if last else None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.step_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        text = "".join(words)
        if fields.get("response_format") in ("text", "srt", "vtt"):
            return web.Response(text=text)
        return web.json_response({"text": text, "usage": {"type": "duration", "seconds": 1}})

    # -- prefix cache and KV events --------------------------------------------------------------
    def cache_prompt(self, prompt: list[int]) -> int:
        """Cache ``prompt``'s full blocks as a request would (its events published now, to whoever is
        subscribed); returns the blocks that were already cached."""
        return self._prefill(prompt)

    def _prefill(self, prompt: list[int]) -> int:
        bs = self.block_size
        full = len(prompt) // bs
        hit, parent, stored, removed = 0, None, [], []
        hashes: list[int] = []
        for b in range(full):
            h = hash((parent, tuple(prompt[b * bs:(b + 1) * bs]))) & 0x7FFF_FFFF_FFFF_FFFF
            hashes.append(h)
            parent = h
        for b, h in enumerate(hashes):
            if h in self._cache and hit == b:
                hit += 1
                self._cache.move_to_end(h)
        for b in range(hit, full):
            while len(self._cache) >= self.num_blocks:
                old, _ = self._cache.popitem(last=False)
                removed.append(old)
            self._cache[hashes[b]] = None
            stored.append(b)
        events: list[object] = []
        if removed:
            events.append({"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"})
        if stored:
            first = stored[0]
            events.append({"type": "BlockStored", "block_hashes": [hashes[b] for b in stored],
                           "parent_block_hash": hashes[first - 1] if first else None,
                           "token_ids": prompt[first * bs:full * bs], "block_size": bs, "lora_id": None,
                           "medium": "GPU"})
        if events:
            frames = encode_batch(len(self._batches), events, time.time())
            self._batches.append(frames)
            self._pub.send_multipart(frames)
        return min(hit, (len(prompt) - 1) // bs) * bs

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self._router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for frames in self._batches[max(0, first):]:
                await self._router.send_multipart([ident, b"", *frames])
            await self._router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


def _lora_error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError" if status == 400 else
                                         "NotFoundError", "param": None, "code": status}}, status=status)


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def fake_vllm_config(engines: list[FakeEngine], model_dir: object, block_size: int, *,
                     control: dict[str, object] | None = None, scheduler: dict[str, object] | None = None,
                     **node: object) -> Any:
    """The config of a vLLM fleet of ``engines`` (their HTTP, events and replay endpoints) with ``model_dir``'s
    tokenizer, fast heartbeats and a 16-token default ``max_tokens``; ``control``: more control-plane settings,
    ``scheduler``: scheduler settings, ``node``: more node-group settings."""
    from integration.conftest import test_config

    return test_config(
        model=str(model_dir), routing={"seed": 3}, **({"scheduler": scheduler} if scheduler else {}),
        control_plane={"heartbeat_interval": 0.1, "heartbeat_misses": 5, "default_max_tokens": 16, **(control or {})},
        execution_group={"nodes": [{"engine": "vllm", "block_size": block_size, **node, "endpoints": [
            {"url": e.url, "kv_events": e.events, "kv_replay": e.replay} for e in engines]}]})
