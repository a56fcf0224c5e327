"""OpenAI-compatible HTTP frontend (aiohttp).

Parses and validates requests, applies the chat template, hands the tokens to the :class:`Fleet`
and formats the result as OpenAI JSON or server-sent events. Every error leaves in OpenAI's shape;
the server keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from thunderagent.config import Config
from thunderagent.control.deadline import DeadlineExceeded
from thunderagent.control.fleet import Fleet, Generation, NoWorkerAvailable, QueueFull
from thunderagent.control.generation import HeldAborted
from thunderagent.frontend.aborted import aborted_answer
from thunderagent.frontend.anthropic import ANTHROPIC_PATHS, COUNT_TOKENS_PATH, MESSAGES_PATH
from thunderagent.frontend.auth import (ACCESS_KEY, AUTH_KEY, DETAIL, TENANT, Access, auth_middleware, load_keyring,
                                        tenant_salt)
from thunderagent.frontend.errorlog import ERROR_LOG_KEY, ErrorLog
from thunderagent.frontend.limits import LIMITS_KEY, limits_middleware
from thunderagent.frontend.tenant_gate import (GATE_KEY, SharedLimits, count_completion, make_gate, rate_headers,
                                               share_limits, take_prompt_tokens, tenant_gate_middleware)
from thunderagent.frontend.openapi import PATH as OPENAPI_PATH, add_openapi_route
from thunderagent.frontend.protocol import (SERVER, ChatCompletionRequest, CompletionRequest, RequestError, Unmodelled,
                                            check_program_id, decode_request, error_body, message_text, prompt_input,
                                            stop_list)
from thunderagent.frontend.programs_api import Peers, ProgramsApi
from thunderagent.frontend.admin_api import AdminApi, add_admin_routes
from thunderagent.control.worker_admin import WorkerAdmin
from thunderagent.frontend.messages_api import MessagesApi, anthropic_error
from thunderagent.frontend.relay import RelayFrontend
from thunderagent.frontend.trace_context import OUR_PARENT, trace_headers
from thunderagent.frontend.tracing import TRACING_KEY, make_tracing
from thunderagent.frontend.responses_api import ResponsesApi
from thunderagent.frontend.server_api import ServerApi, add_routes
from thunderagent.frontend.audio_api import AudioApi, add_routes as add_audio_routes
from thunderagent.frontend.relay_fields import fleet_relay
from thunderagent.frontend.streaming import TextChunk, stream_text
from thunderagent.frontend.tokenize_metrics import TokenizeCollector
from thunderagent.frontend.tokenize_pool import TokenizePool
from thunderagent.frontend.tokenizer import ChatMessage, Tokenizer
from thunderagent.scheduler.programs import PROGRAM_ID, program_key
from thunderagent.types import AUDIO_PATHS, RESPONSES_PATH, SERVER_PATHS, TOKENIZER_INFO_PATH, FinishReason, Sampling

log = logging.getLogger(__name__)

FLEET_KEY = web.AppKey("fleet", Fleet)
FRONTEND_KEY: web.AppKey[Frontend] = web.AppKey("frontend")
WORKER_HEADER = "x-thunderagent-worker"
PROGRAM_HEADER = "x-thunderagent-program-id"
DYNAMO_SESSION_HEADER = "x-dynamo-session-id"
CLAUDE_SESSION_HEADER = "x-claude-code-session-id"  # Claude Code's, one per session
EXPLAIN_HEADER = "x-thunderagent-explain"
#: the routes that generate (what control_plane.tenant_limits counts)
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", MESSAGES_PATH, RESPONSES_PATH)
#: the relayed paths that generate nothing or not from text (each counted by a tenant's request limits)
SERVED_PATHS = (*SERVER_PATHS, TOKENIZER_INFO_PATH, *AUDIO_PATHS)
#: the paths whose requests get a span of ours (tracing on): everything sent to a worker
TRACED_PATHS = (*INFERENCE_PATHS, COUNT_TOKENS_PATH, *SERVED_PATHS, f"{RESPONSES_PATH}/{{response_id}}",
                f"{RESPONSES_PATH}/{{response_id}}/cancel")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_enc = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(err: RequestError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=error_body(err), status=err.status, content_type="application/json", headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-shaped error; nothing escapes as a bare 500 page."""
    fleet = request.app[FLEET_KEY]
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    try:
        resp = await handler(request)
    except RequestError as err:
        resp = _error(err)
    except NoWorkerAvailable as exc:
        resp = _error(RequestError(str(exc), status=503, code="no_healthy_worker", type_="server_error"),
                      headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))})
    except HeldAborted as exc:  # (a held request of an API without an abort answer: frontend/aborted.py)
        resp = _error(RequestError(f"{exc}; retry", status=503, code="request_aborted", type_="server_error"))
    except DeadlineExceeded as exc:  # (control_plane.request_timeout_s)
        resp = _error(RequestError(str(exc), status=504, code="request_timeout", type_="server_error"))
    except QueueFull as exc:
        resp = _error(RequestError(f"{exc}; retry later", status=429, code=exc.code, type_="rate_limit_error"),
                      headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))})
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[FLEET_KEY].cfg.control_plane.max_body_bytes
        resp = _error(RequestError(
            f"request body too large: limit is {limit} bytes (control_plane.max_body_bytes)",
            status=413, code="body_too_large",
        ))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = _error(RequestError(exc.reason, status=exc.status, type_="invalid_request_error"))
    except Exception as exc:  # logged once per cause per interval: a flood of one bug is one line
        request.app[ERROR_LOG_KEY].exception(exc, "internal error on %s %s", request.method, request.path)
        resp = _error(RequestError("internal server error", status=500, type_="server_error"))
    if endpoint in ANTHROPIC_PATHS and resp.status >= 400:
        resp = anthropic_error(resp)
    fleet.metrics.count_request(endpoint, resp.status)
    return resp


class Frontend:
    def __init__(self, fleet: Fleet, tokenizer: Tokenizer, max_tokens_default: int, route_key: str,
                 tokenize: TokenizePool) -> None:
        self.fleet = fleet
        self.tokenizer = tokenizer
        self.tokenize = tokenize  # long prompts tokenized off the event loop (frontend/tokenize_pool.py)
        self.max_tokens_default = max_tokens_default
        self.route_key = route_key
        #: an engine openai fleet: requests and answers pass through unchanged (frontend/relay.py)
        self.relay: RelayFrontend | None = None
        #: a vLLM / SGLang fleet's relay: the requests the token path does not model (relay: unmodelled)
        self.unmodelled: RelayFrontend | None = None
        #: Anthropic's Messages API, relayed (frontend/messages_api.py; a 404 on a fleet that cannot relay)
        self.messages_api = MessagesApi(None)
        #: OpenAI's Responses API, relayed (frontend/responses_api.py; a 404 on a fleet that cannot relay)
        self.responses_api = ResponsesApi(None)

    def _text(self, gen: Generation, stops: list[str]) -> AsyncIterator[TextChunk]:
        return stream_text(self.fleet.outputs(gen), self.tokenizer.decoder(), stops)

    # -- helpers -----------------------------------------------------------------------------
    def _check_model(self, model: str) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model), one some worker's server serves by name
        (vLLM's ``/v1/models``; routing sends the request only to workers listing it); a 404 for any other name."""
        if model == self.fleet.model_name:
            return None
        if self.fleet.registry.adapter(model)[0]:
            return model
        raise RequestError(f"The model `{model}` does not exist", param="model", status=404, code="model_not_found")

    def budget(self, prompt_ids: list[int], asked: int | None, max_param: str, prompt_param: str,
               relayed: bool = False) -> int:
        """The request's max_tokens: what it asked, else the default cut to what fits the largest worker (as
        vLLM defaults); a 400 up front for what no worker holds or no bus message carries (``relayed``: its prompt is
        not sent, the relay checks its body instead)."""
        max_tokens = asked or self.max_tokens_default
        limit = self.fleet.max_context_tokens
        if limit is not None and not asked and len(prompt_ids) < limit:
            max_tokens = min(max_tokens, limit - len(prompt_ids))  # not asked for: what fits (as vLLM defaults)
        if limit is not None and len(prompt_ids) + max_tokens > limit:
            # The engine would reject it anyway (it can never hold the sequence): say why, up front.
            too_long = len(prompt_ids) >= limit
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the {limit} "
                               "tokens the largest worker holds (its KV cache, or the max_model_len its server "
                               "reported)", param=prompt_param if too_long else max_param,
                               code="context_length_exceeded")
        carried = self.fleet.prompt_limit
        if carried is not None and not relayed and len(prompt_ids) > carried.tokens:
            # Sent anyway, it would end unserved (a NATS message too large is dropped by the bus).
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) exceeds the {carried.tokens} tokens {carried.why}",
                               param=prompt_param, code="context_length_exceeded")
        return max_tokens

    def _route_key(self, request: web.Request, req: ChatCompletionRequest | CompletionRequest) -> str:
        """The request's route key: its tenant with API keys on, else from where ``routing.route_key`` says."""
        tenant: str | None = request.get(TENANT)
        if tenant is not None:  # fair shares across tenants, not across names a client picks
            return tenant
        where, _, name = self.route_key.partition(":")
        return request.headers.get(name, "") if where == "header" else req.user or ""

    @staticmethod
    def _program_id(request: web.Request, req: ChatCompletionRequest | CompletionRequest) -> str | None:
        """The agent program a request belongs to: our header, the body's ``program_id`` (top level
        or in ``extra_body``, as the ThunderAgent paper's proxy reads it), Dynamo's session header, or else
        Claude Code's session (its header, or its ``metadata.user_id`` on the Messages API: a malformed one
        is no program, not an error); as the program table's key: the tenant's own program with API keys
        on (``tenant/id``)."""
        nested = (req.extra_body or {}).get("program_id")
        for value in (request.headers.get(PROGRAM_HEADER), req.program_id, nested,
                      request.headers.get(DYNAMO_SESSION_HEADER)):
            if value is not None:
                return program_key(request.get(TENANT), check_program_id(value))
        session = request.headers.get(CLAUDE_SESSION_HEADER) or getattr(req, "client_session", None)
        return program_key(request.get(TENANT), session) if session and PROGRAM_ID.match(session) else None

    @staticmethod
    def _explain(request: web.Request, body_flag: bool) -> bool:
        """Whether the answer carries the routing explanation (asked for in the body or the header).
        It shows every worker's load, the detail ``/health`` shows admins only: with API keys on, a
        key that is not also an admin key asking for it gets a 403 (before anything is routed)."""
        asked = body_flag or request.headers.get(EXPLAIN_HEADER, "").lower() in ("1", "true", "yes")
        if asked and not request[DETAIL]:
            raise RequestError("explain: the routing explanation shows every worker's load; with API keys on it "
                               "needs a key that is also an admin key (control_plane.admin_keys)", param="explain",
                               status=403, code="admin_key_required", type_="permission_error")
        return asked

    @staticmethod
    def _usage(gen: Generation, last: TextChunk) -> dict[str, Any]:
        return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": last.completion_tokens,
                "total_tokens": gen.prompt_tokens + last.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}

    async def _run(self, request: web.Request, req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int],
                   chat: bool, lora: str | None = None) -> web.StreamResponse:
        """``lora``: the LoRA adapter ``model`` named (:meth:`_check_model`), else the ``lora_name`` field's."""
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        max_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        stops = stop_list(req.stop)
        prompt_param = "messages" if chat else "prompt"
        if not prompt_ids:
            raise RequestError("prompt is empty after tokenization", param=prompt_param)
        max_tokens = self.budget(prompt_ids, asked, max_param, prompt_param)
        sampling = Sampling(req.temperature, req.top_p, req.seed)
        explained = self._explain(request, req.explain)
        take_prompt_tokens(request, len(prompt_ids), prompt_param,  # the tenant's token limit, if any
                           max_tokens if asked else 0, max_param)
        try:
            gen = await self.fleet.start_generation(
                prompt_ids, max_tokens, cache_salt=tenant_salt(request.get(TENANT), req.cache_salt),
                lora_name=lora or req.lora_name, priority=req.priority, sampling=sampling,
                route_key=self._route_key(request, req), program_id=self._program_id(request, req),
                tenant=request.get(TENANT), headers=trace_headers(request.headers, request.get(OUR_PARENT)),
            )
        except HeldAborted as e:  # ended by /abort_requests before a worker had it: vLLM's answer (aborted.py)
            return aborted_answer(chat, req.stream, req.model, e.request_id, len(prompt_ids),
                                  bool(req.stream_options and req.stream_options.include_usage), rate_headers(request),
                                  relayed=False)
        count_completion(request, gen)
        shown = request[DETAIL]  # worker ids are the fleet's detail: tenants see none (API keys on, no admin key)
        headers = {WORKER_HEADER: gen.decision.worker_id} if shown else {}
        headers.update(rate_headers(request))  # the tenant's limits, as its buckets hold now
        explain = gen.decision.explain() if explained else None
        created = int(time.time())
        cid = ("chatcmpl-" if chat else "cmpl-") + gen.request_id
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return await self._stream(request, gen, stops, headers, explain, cid, created, req.model, chat,
                                          include_usage)
            return await self._complete(gen, stops, headers, explain, cid, created, req.model, chat, shown)
        finally:
            self.tenant_usage(request, gen)

    def tenant_usage(self, request: web.Request, gen: Generation) -> None:
        """A started request ended: its tokens, per tenant (API keys on)."""
        tenant = request.get(TENANT)
        if tenant is not None:
            self.fleet.metrics.tenant_tokens(tenant, gen.prompt_tokens, len(gen.produced))

    async def _complete(
        self, gen: Generation, stops: list[str], headers: dict[str, str], explain: dict[str, object] | None,
        cid: str, created: int, model: str, chat: bool, shown: bool,
    ) -> web.Response:
        """A non-streaming response: the whole text, or an OpenAI error when nothing was generated."""
        text_parts: list[str] = []
        last: TextChunk | None = None
        async for chunk in self._text(gen, stops):
            text_parts.append(chunk.text)
            last = chunk
        assert last is not None, "a generation always ends with a final chunk"
        text = "".join(text_parts)
        if last.finish_reason == FinishReason.ERROR:  # never a 200 with part of a text: it is an error
            if gen.timed_out:
                raise DeadlineExceeded(self.fleet.deadlines.timeout_s)
            moved = f" (migrated {gen.migrations} times)" if gen.migrations else ""
            who = f"worker {gen.decision.worker_id}" if shown else "the worker"
            raise RequestError(f"{who} failed while serving the request{moved} and no worker could take it over; "
                               "retry", status=502, code="worker_failed", type_="server_error")
        if last.finish_reason == FinishReason.UNAVAILABLE and not text:  # no worker could take it, even routed again
            raise NoWorkerAvailable("no worker could take the request (engines unreachable)")
        if chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": last.finish_reason, "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": last.finish_reason, "logprobs": None}
        body: dict[str, Any] = {
            "id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": self._usage(gen, last),
        }
        if explain is not None:
            body["thunderagent"] = explain
        if shown:
            headers[WORKER_HEADER] = gen.decision.worker_id  # a request can be routed again (worker lost)
        return web.Response(body=_enc.encode(body), content_type="application/json", headers=headers)

    async def _stream(
        self, request: web.Request, gen: Generation, stops: list[str], headers: dict[str, str],
        explain: dict[str, object] | None, cid: str, created: int, model: str, chat: bool, include_usage: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            payload = {"id": cid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
            return b"data: " + _enc.encode(payload) + b"\n\n"

        def choice(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        stream = self._text(gen, stops)
        try:
            await resp.prepare(request)
            if chat:
                first_extra = {"thunderagent": explain} if explain is not None else {}
                await resp.write(event([choice(None, None, role=True)], **first_extra))
            last: TextChunk | None = None
            async for chunk in stream:
                last = chunk
                if chunk.text or chunk.finish_reason:
                    await resp.write(event([choice(chunk.text, chunk.finish_reason)]))
            assert last is not None
            if include_usage:
                await resp.write(event([], usage=self._usage(gen, last)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError) as exc:
            log.info("client went away during stream %s: %s", gen.request_id, exc)
        finally:
            await stream.aclose()  # aborts the engine request if it did not finish
        return resp

    # -- handlers ----------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        if self.relay is not None:
            return await self.relay.handle(request, chat=True)
        try:
            req = decode_request(body := await request.read(), ChatCompletionRequest)
            assert isinstance(req, ChatCompletionRequest)
            messages = [ChatMessage(m.role, message_text(m, i)) for i, m in enumerate(req.messages)]
        except Unmodelled as why:
            if self.unmodelled is None:
                raise
            return await self.unmodelled.handle(request, chat=True, why=why.param or "unknown")
        lora = self._check_model(req.model)
        ids = await self.tokenize.run(len(body), self.tokenizer.apply_chat_template, messages,  # (scope: its salt)
                                      scope=tenant_salt(request.get(TENANT), req.cache_salt))
        return await self._run(request, req, ids, chat=True, lora=lora)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if self.relay is not None:
            return await self.relay.handle(request, chat=False)
        try:
            req = decode_request(body := await request.read(), CompletionRequest)
        except Unmodelled as why:
            if self.unmodelled is None:
                raise
            return await self.unmodelled.handle(request, chat=False, why=why.param or "unknown")
        assert isinstance(req, CompletionRequest)
        lora = self._check_model(req.model)
        prompt = prompt_input(req.prompt)
        ids = prompt if not isinstance(prompt, str) else await self.tokenize.run(
            len(body), self.tokenizer.encode_prompt, prompt, tenant_salt(request.get(TENANT), req.cache_salt))
        return await self._run(request, req, ids, chat=False, lora=lora)

    async def planner(self, request: web.Request) -> web.Response:
        return web.json_response(self.fleet.planner.summary(self.fleet.now()))

    async def models(self, request: web.Request) -> web.Response:
        base, served = self.fleet.model_name, self.fleet.registry.adapters_anywhere()
        if self.relay is not None and self.relay.fields is None and served:  # engine openai: the servers' models
            return web.json_response({"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "thunderagent"} for m in served]})
        body = {"object": "list", "data": [
            {"id": base, "object": "model", "created": 0, "owned_by": "thunderagent"},
            *({"id": a, "object": "model", "created": 0, "owned_by": "thunderagent", "parent": base}
              for a in served),  # the LoRA adapters some worker serves
        ]}
        return web.json_response(body)

    async def health(self, request: web.Request) -> web.Response:
        summary = self.fleet.health_summary()
        if not request[DETAIL]:  # API keys on and no admin key: what a load balancer needs, no more
            summary = {k: summary[k] for k in ("status", "healthy_workers")}
        return web.json_response(summary, status=200 if summary["healthy_workers"] else 503, dumps=json.dumps)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.fleet.metrics.render(), headers={"Content-Type": self.fleet.metrics.content_type})


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER  # the product only (protocol.SERVER)


def create_app(cfg: Config, *, fleet: Fleet | None = None, tokenizer: Tokenizer | None = None,
               peers: Peers | None = None, shared_limits: SharedLimits | None = None) -> web.Application:
    """The HTTP frontend in front of ``fleet`` (by default the single-process fleet of the config's
    workers: simulated, or real engine servers). ``tokenizer`` defaults to the model's own when
    ``cfg.model`` is set (loaded here, before serving), else the byte-level one. ``peers``: the other
    frontends of a NATS deployment (program releases reach them too); ``shared_limits``: the same, for
    per-tenant limits that hold across them."""
    from thunderagent.assemble import build_fleet, load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer(cfg)
    if fleet is None:
        fleet = build_fleet(cfg, tokenizer)
    # tenant limits after the key check (they need the tenant), before the body is read (a refusal is cheap); a
    # request's span (tracing on) around everything, so that it sees the status the client gets
    tracing = make_tracing(cfg.control_plane.tracing, TRACED_PATHS)
    app = web.Application(middlewares=[*([tracing.middleware] if tracing else []), errors_middleware, auth_middleware,
                                       tenant_gate_middleware, limits_middleware],
                          client_max_size=cfg.control_plane.max_body_bytes)
    app[FLEET_KEY] = fleet
    if tracing is not None:
        app[TRACING_KEY] = tracing
    app[LIMITS_KEY] = cfg.control_plane
    app[ERROR_LOG_KEY] = ErrorLog(log, cfg.control_plane.error_log_interval_s)
    ring = load_keyring(cfg.control_plane)  # reads key files and variables: a ConfigError names the field
    if ring is None and cfg.control_plane.admin_api:
        log.warning("admin API on without API keys: anyone who reaches %s:%d may cordon, add or remove workers",
                    cfg.control_plane.host, cfg.control_plane.port)
    if ring is not None:
        app[AUTH_KEY] = ring
        gate = make_gate(cfg.control_plane.tenant_limits, ring.tenants, INFERENCE_PATHS + SERVED_PATHS, fleet.metrics,
                         shared=shared_limits is not None)
        if gate is not None:
            app[GATE_KEY] = gate
    fe = Frontend(fleet, tokenizer, cfg.control_plane.default_max_tokens, cfg.routing.route_key,
                  TokenizePool(cfg.control_plane.tokenizer.threads, cfg.control_plane.tokenizer.offload_bytes))
    fleet.metrics.registry.register(TokenizeCollector(fe.tokenize, tokenizer))  # (read at each scrape)
    app[FRONTEND_KEY] = fe
    nodes = cfg.execution_group.nodes
    if nodes and all(n.engine == "openai" for n in nodes):
        fe.relay = RelayFrontend(fe)
        fe.messages_api = MessagesApi(fe.relay)
        fe.responses_api = ResponsesApi(fe.relay)
    elif (fields := fleet_relay(nodes)) is not None:  # vllm / sglang, one mode (config.resolve_relay)
        if nodes[0].relay == "all":
            fe.relay = RelayFrontend(fe, fields)  # every request, checked as the unmodelled ones
        else:
            fe.unmodelled = RelayFrontend(fe, fields)
        fe.messages_api = MessagesApi(fe.relay or fe.unmodelled)
        fe.responses_api = ResponsesApi(fe.relay or fe.unmodelled)
    access: dict[str | None, Access] = {}  # what a route needs with API keys on (frontend/auth.py)

    def route(method: str, path: str, handler: Handler, needs: Access) -> None:
        (app.router.add_get if method == "GET" else app.router.add_post)(path, handler)  # GET also serves HEAD
        access[path] = needs

    chat_path, completions_path, messages_path, responses_path = INFERENCE_PATHS
    route("POST", chat_path, fe.chat_completions, Access.TENANT)
    route("POST", completions_path, fe.completions, Access.TENANT)
    route("POST", messages_path, fe.messages_api.messages, Access.TENANT)  # Anthropic's (Claude Code)
    route("POST", COUNT_TOKENS_PATH, fe.messages_api.count_tokens, Access.TENANT)
    route("POST", responses_path, fe.responses_api.responses, Access.TENANT)  # OpenAI's (Codex, Agents SDK)
    route("GET", f"{RESPONSES_PATH}/{{response_id}}", fe.responses_api.stored, Access.TENANT)  # a stored one
    route("POST", f"{RESPONSES_PATH}/{{response_id}}/cancel", fe.responses_api.stored, Access.TENANT)
    add_routes(lambda method, path, handler: route(method, path, handler, Access.TENANT),
               ServerApi(fe.relay or fe.unmodelled))  # embeddings, scores, the server's tokenizer
    add_audio_routes(lambda method, path, handler: route(method, path, handler, Access.TENANT),
                     AudioApi(fe.relay or fe.unmodelled))  # speech to text
    route("GET", "/v1/models", fe.models, Access.TENANT)
    programs = ProgramsApi(fleet, peers)  # a tenant key: its own programs; an admin key: everyone's
    route("GET", "/v1/programs", programs.listing, Access.ANY)
    route("GET", "/v1/programs/{program_id}", programs.one, Access.ANY)
    route("POST", "/v1/programs/{program_id}/release", programs.release, Access.ANY)
    route("POST", "/programs/release", programs.release_body, Access.ANY)
    route("GET", "/v1/planner", fe.planner, Access.ADMIN)  # scaling advice (control/planner_hook.py)
    add_admin_routes(lambda method, path, handler: route(method, path, handler, Access.ADMIN),  # cordon, add, remove
                     AdminApi(WorkerAdmin(fleet), cfg.control_plane.admin_api))
    route("GET", "/health", fe.health, Access.PUBLIC)  # the detail needs an admin key
    if cfg.metrics.enabled:
        route("GET", cfg.metrics.path, fe.metrics, Access.ADMIN)
    add_openapi_route(app, cfg)
    access[OPENAPI_PATH] = Access.PUBLIC
    app[ACCESS_KEY] = access

    async def on_startup(app: web.Application) -> None:
        await fleet.start()

    async def on_cleanup(app: web.Application) -> None:
        await fleet.planner.stop()  # its actions still running
        await fleet.stop()
        fe.tokenize.close()
        if tracing is not None:  # the spans still batched go out (blocking: off the loop)
            await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.on_response_prepare.append(_server_header)
    share_limits(app, shared_limits, fleet.programs)  # after the fleet joined the bus; stopped before it leaves
    return app
