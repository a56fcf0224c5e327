"""Relayed requests: the client's body to the server, the server's answer to the client, unchanged.

Two fleets relay: an ``engine: openai`` fleet relays every request; a vLLM / SGLang fleet
(``relay: unmodelled``, the default) relays the requests that ask for what ThunderAgent does not model
(tools, tool-call history, ``response_format``, logprobs, penalties, ``n``, images, the engine's own
sampling fields: ``frontend/relay_fields.py``) and serves the others as token ids. There the name in
``model`` is ThunderAgent's (checked here; the worker sends the server's own), fields neither side
takes are refused by name, and the worker rewrites ThunderAgent's fields (``execution/relay_body.py``).

The client's body is forwarded byte for byte to the server the router picks, and the server's
answer (SSE bytes or JSON) is relayed as it came (``execution/openai_relay.py``): one HTTP hop. What
this frontend still reads and checks, because routing needs it or because it is ours to answer:

- the body is a JSON object with a string ``model`` (the server checks the name: clients send the
  name the servers serve, which ThunderAgent forwards unchanged);
- the prompt, to hash it: chat ``messages`` (a non-empty list of ``{role, content}``; content parts
  other than text are forwarded but not hashed) or the completion's ``prompt`` (text, token ids, or a
  one-element list of text), tokenized with ``model``'s tokenizer when one is configured, else with
  the byte-level stand-in;
- ``stream`` (a boolean), and ``max_tokens`` / ``max_completion_tokens`` when present (≥ 1: the
  router's load accounting; absent, ``control_plane.default_max_tokens`` is assumed and nothing is
  added to the body);
- ThunderAgent's own fields (``program_id``, ``priority``, ``cache_salt``, ``lora_name``,
  ``explain``, ``user``) are read for scheduling *and* stay in the body: a strict server may refuse
  them, so prefer the ``x-thunderagent-program-id`` / ``x-thunderagent-explain`` headers there.

Everything else (sampling, stop strings, tools, logprobs, response formats, ``n``...) is the
server's to validate and apply. API keys, body-size and connection limits apply as for any fleet.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, TypeVar

import msgspec
from aiohttp import web
from msgspec import Meta

from thunderagent.frontend.aborted import relayed_aborted_answer
from thunderagent.frontend.anthropic import error_doc
from thunderagent.frontend.auth import DETAIL, TENANT, tenant_salt
from thunderagent.frontend.protocol import MaxTokens, Priority, RequestError, prompt_input
from thunderagent.frontend.relay_fields import MESSAGE_KEYS, RelayFields
from thunderagent.frontend.tenant_gate import count_completion, rate_headers, take_prompt_tokens
from thunderagent.control.deadline import DeadlineExceeded, timeout_message
from thunderagent.control.fleet import Fleet, Generation
from thunderagent.control.generation import HeldAborted
from thunderagent.frontend.tokenizer import Tokenizer
from thunderagent.frontend.trace_context import OUR_PARENT, trace_headers
from thunderagent.types import FinishReason, Passthrough, TokenOutput

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_FAILED = frozenset({FinishReason.ERROR, FinishReason.UNAVAILABLE})


def _failed(out: TokenOutput) -> bool:
    """A finished output that is not the server's own end: failed, or ended by the fleet (a relayed
    end always carries the server's bytes; one the fleet settled after a loss carries none). A server's own
    ``abort`` (vLLM's, e.g. a pause in abort mode) is its answer, passed on as it came."""
    return out.finish_reason in _FAILED or out.raw is None


# Lenient structs (no forbid_unknown_fields): only what routing reads is typed; the rest is the server's.
class _Message(msgspec.Struct):
    role: str
    content: str | list[Any] | None = None


class _Request(msgspec.Struct, kw_only=True):
    model: str
    stream: bool = False
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    messages: Annotated[list[_Message], Meta(min_length=1)] | None = None
    prompt: str | list[int | str] | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    priority: Priority = 0
    explain: bool = False
    user: str | None = None
    program_id: str | None = None
    extra_body: dict[str, Any] | None = None


_decoder = msgspec.json.Decoder(_Request)
_doc = msgspec.json.Decoder(dict[str, Any])
T = TypeVar("T")


def _decode(body: bytes) -> _Request:
    return decode_body(_decoder, body)


def _usage_asked(body: bytes) -> bool:
    """Whether a relayed body asks for a streamed usage chunk (``stream_options.include_usage``)."""
    options = _doc.decode(body).get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """A request body through its lenient struct's decoder, failures as the 400s that name what is wrong."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise RequestError("request body is nested too deeply", code="nesting_too_deep") from exc


def decode_both(kind: type[T], body: bytes) -> tuple[T, dict[str, Any]]:
    """A relayed body parsed once: the whole document (what is checked and rendered), and the fields routing
    reads typed from it (``kind``, a lenient struct), failures as the same 400s."""
    doc: dict[str, Any] = decode_body(_doc, body)
    try:
        return msgspec.convert(doc, kind), doc
    except msgspec.ValidationError as exc:
        raise RequestError(str(exc)) from exc


@dataclass(slots=True)
class Routed:
    """What :meth:`RelayFrontend.dispatch` and the frontend's route-key and program readers take of a request
    of an API with its own body (the Messages and Responses APIs)."""

    max_tokens: int | None
    cache_salt: str | None
    priority: int
    explain: bool
    program_id: str | None
    user: str | None
    client_session: str | None = None  # Claude Code's session: the program when the request names none
    max_param: str = "max_tokens"  # the budget field, named in its errors
    extra_body: dict[str, Any] | None = None
    model: str | None = None  # the model the client named (its abort answer names it: frontend/aborted.py)


def _with_type(headers: tuple[tuple[str, str], ...], content_type: str | None) -> tuple[tuple[str, str], ...]:
    return headers if content_type is None else (*headers, ("Content-Type", content_type))


def relaying(relay: RelayFrontend | None, request: web.Request, query: frozenset[str] = frozenset()) -> RelayFrontend:
    """The fleet's relay, for a path only servers serve (a 404 without one); a query parameter but ``query``'s is a
    400 naming it."""
    if relay is None:
        raise no_servers(f"{request.path} endpoint")
    extra = sorted(set(request.query) - query)
    if extra:
        but = f" but {', '.join(sorted(query))}" if query else ""
        raise RequestError(f"query parameters are not taken on {request.path}{but}: {extra[0]!r}", param=extra[0])
    return relay


def no_servers(api: str) -> RequestError:
    """The 404 of an API only servers serve, on a fleet with none to relay to."""
    return RequestError(f"the {api} is relayed to vLLM, SGLang or OpenAI-compatible servers; this fleet has none to "
                        "relay to (simulated workers, or relay: off)", status=404, code="not_found")
_INDEX = re.compile(r"\[\d+\]")


def _label(why: str | None) -> str:
    """The relayed requests' label: the top-level field (one the check let through), or ``messages.<key>`` for a
    message's; nothing deeper, so the label set stays bounded whatever clients nest."""
    if why is None:
        return "all"  # relay: all (every request)
    parts = _INDEX.sub("", why).split(".")
    if parts[0] == "messages" and len(parts) > 1 and parts[1] in MESSAGE_KEYS:
        return f"messages.{parts[1]}"
    return parts[0] or "unknown"


def upstream_error(worker: str | None, out: TokenOutput, anthropic: bool = False) -> web.Response:
    """A server's refusal as an OpenAI error (``anthropic``: an Anthropic one): its own body when it has that
    shape (with its status), else wrapped (502 for a server fault, the server's status for a 4xx). ``worker``:
    its id, or None where the caller may not see it (a tenant)."""
    raw, status = out.raw or b"", out.raw_status
    try:
        doc = json.loads(raw)
        shaped = isinstance(doc.get("error"), dict) and (not anthropic or doc.get("type") == "error")
    except (ValueError, AttributeError):
        shaped = False
    if shaped and 400 <= status:
        return web.Response(body=raw, status=status, content_type="application/json")
    # a body that is not OpenAI's shape (a proxy's error page, a trace) may name the fleet's hosts: admins only
    text = raw[:200].decode(errors="replace") if worker is not None else ""
    why = (f"HTTP {status}: {text}" if text else f"HTTP {status}") if raw else f"the request {out.finish_reason}"
    message = f"{_who(worker)} failed the request ({why})"
    status = status if 400 <= status < 500 else 502
    if anthropic:
        return web.json_response(error_doc(status, message), status=status)
    err = {"message": message, "type": "server_error", "param": None, "code": "upstream_error"}
    return web.json_response({"error": err}, status=status)


def _who(worker: str | None) -> str:
    return "the worker" if worker is None else f"worker {worker}"


def _error_event(worker: str | None, out: TokenOutput, anthropic: bool = False, why: str | None = None) -> bytes:
    msg = why or f"{_who(worker)} failed while streaming the request ({out.finish_reason}); it cannot be resumed"
    if anthropic:
        return b"event: error\ndata: " + json.dumps(error_doc(502, msg)).encode() + b"\n\n"
    err = {"message": msg, "type": "server_error", "param": None, "code": "worker_failed"}
    return b"data: " + json.dumps({"error": err}).encode() + b"\n\ndata: [DONE]\n\n"


class _Frontend(Protocol):
    """What the relay uses of :class:`~thunderagent.frontend.app.Frontend` (no import: app imports us)."""

    fleet: Fleet
    tokenizer: Tokenizer
    max_tokens_default: int

    def _check_model(self, model: str) -> str | None: ...
    def budget(self, prompt_ids: list[int], asked: int | None, max_param: str, prompt_param: str,
               relayed: bool = False) -> int: ...
    def _route_key(self, request: web.Request, req: Any) -> str: ...
    @staticmethod
    def _program_id(request: web.Request, req: Any) -> str | None: ...
    @staticmethod
    def _explain(request: web.Request, body_flag: bool) -> bool: ...
    def tenant_usage(self, request: web.Request, gen: Any) -> None: ...


class RelayFrontend:
    """``POST /v1/chat/completions`` and ``/v1/completions`` relayed: every request of an ``engine: openai``
    fleet (``fields`` None: the server checks everything), or a vLLM / SGLang fleet's unmodelled ones
    (``fields``: what those engines take)."""

    def __init__(self, fe: _Frontend, fields: RelayFields | None = None) -> None:
        self.fe = fe
        self.fields = fields

    async def handle(self, request: web.Request, chat: bool, why: str | None = None) -> web.StreamResponse:
        """``why``: the field that sent a vLLM / SGLang fleet's request here (the relayed requests' metric; None with
        ``relay: all``)."""
        fe = self.fe
        body = await request.read()
        doc: dict[str, Any] | None = None
        if chat or self.fields is not None:
            req, doc = decode_both(_Request, body)
        else:  # an engine openai completion: the typed fields only
            req = _decode(body)
        fields = self.fields

        def check() -> None:  # (admit calls it only on a fleet that checks fields, where doc was parsed)
            assert fields is not None and doc is not None
            fields.check(doc, chat)

        lora = self.admit(req.model, check, _label(why))
        tok = fe.tokenizer
        if chat:
            if req.messages is None:
                raise RequestError("`messages` is required", param="messages")
            assert doc is not None
            ids = await fe.tokenize.run(len(body), tok.apply_openai_chat, doc,  # with tools and calls, as served
                                        scope=tenant_salt(request.get(TENANT), req.cache_salt))
        else:
            if req.prompt is None:
                raise RequestError("`prompt` is required", param="prompt")
            prompt = prompt_input(req.prompt)
            ids = await fe.tokenize.run(len(body), tok.encode_prompt, prompt, tenant_salt(request.get(TENANT),
                                        req.cache_salt)) if isinstance(prompt, str) else prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await self.dispatch(request, req, ids, Passthrough(path, body, req.stream), lora,
                                   "messages" if chat else "prompt")

    def admit(self, model: str | None, check: Callable[[], None], label: str) -> str | None:
        """The name routing keys the request on (its ``lora_name``), if any. On a vLLM / SGLang fleet: the LoRA adapter
        ``model`` names, the name checked (a 404 for one no server serves; the worker sends the server's own), then
        the request's fields (``check``), and the request is counted as relayed (``label``). On an ``engine: openai``
        fleet the servers check both, and every ``model`` is the key: its prompts hash apart from other models'
        (whether or not a server listed it yet: a hash must not change when a poll lands), and where some servers
        list it, it goes only to those (a fleet of several models, LoRA adapters alike)."""
        fe = self.fe
        if self.fields is None:
            return model
        lora = fe._check_model(model) if model is not None else None
        check()
        fe.fleet.metrics.relayed.labels(label).inc()
        return lora

    async def dispatch(self, request: web.Request, req: Any, ids: list[int], pt: Passthrough, lora: str | None,
                       prompt_param: str, anthropic: bool = False, pin: str | None = None,
                       on_answer: Callable[[bytes, str], None] | None = None,
                       plain: int | None = None, content_type: str | None = None,
                       answer_type: str = "application/json") -> web.StreamResponse:
        """Route ``pt`` (the client's body) on the prompt ``ids`` and relay the server's answer. ``req``: the
        fields routing reads (``max_tokens`` / ``max_completion_tokens``, ``cache_salt``, ``lora_name``,
        ``priority``, ``program_id``, ``explain``, ``user``); ``anthropic``: errors in the Messages API's shape;
        ``pin``: the worker it goes to while routable; ``on_answer(first bytes, worker)``: told of the server's
        answer once it starts (a whole body, or the first events of a stream); ``plain``: a request that generates
        nothing (``ids`` empty: routed on load alone, no program step), charging the tenant these tokens;
        ``content_type``: the body's, when it is not JSON (sent on with it); ``answer_type``: the content type of a
        whole (unstreamed) answer."""
        fe = self.fe
        if not ids and plain is None:
            raise RequestError("prompt is empty", param=prompt_param)
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        max_param = getattr(req, "max_param", None) or (
            "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens")
        # the fleet's accounting (the body is sent as it is: without max_tokens the server picks what fits)
        max_tokens = fe.budget(ids, asked, max_param, prompt_param, relayed=True) if plain is None else 1
        carried = fe.fleet.prompt_limit
        if carried is not None and carried.body_bytes is not None and len(pt.body) > carried.body_bytes:
            raise RequestError(f"the request's body ({len(pt.body)} bytes) exceeds the {carried.body_bytes} bytes "
                               f"{carried.why}", status=413, code="request_too_large")
        explained = fe._explain(request, req.explain)
        # the tenant's token limit, if any (nothing to reserve for a plain request: it generates nothing)
        take_prompt_tokens(request, len(ids) if plain is None else plain, prompt_param,
                           (asked or 0) if plain is None else 0, max_param)
        try:
            gen = await fe.fleet.start_generation(
                ids, max_tokens, cache_salt=tenant_salt(request.get(TENANT), req.cache_salt) if plain is None else None,
                lora_name=lora or getattr(req, "lora_name", None), priority=req.priority,
                route_key=fe._route_key(request, req),
                program_id=fe._program_id(request, req) if plain is None else None,
                tenant=request.get(TENANT), passthrough=pt, pin=pin,
                headers=_with_type(trace_headers(request.headers, request.get(OUR_PARENT)), content_type),
            )
        except HeldAborted as e:  # ended by /abort_requests before a server had it (the other paths: a 503)
            answer = relayed_aborted_answer(pt.path, pt.stream, req.model or "", e.request_id, len(ids),
                                            _usage_asked(pt.body), rate_headers(request))
            if answer is None:
                raise
            return answer
        count_completion(request, gen)
        shown = request[DETAIL]

        def worker() -> str | None:  # the one serving now (a request can be routed again)
            return gen.decision.worker_id if shown else None  # worker ids are the fleet's detail: tenants see none

        headers = {"x-thunderagent-worker": gen.decision.worker_id} if shown else {}
        headers.update(rate_headers(request))  # the tenant's limits, as its buckets hold now
        if explained:  # the body is the server's: the explanation goes in a header
            headers["x-thunderagent-explanation"] = json.dumps(gen.decision.explain(), separators=(",", ":"))
        outputs = fe.fleet.outputs(gen)

        def failed(out: TokenOutput) -> web.Response:  # an error answer: the server's, or ours at the deadline
            if gen.timed_out:
                raise DeadlineExceeded(fe.fleet.deadlines.timeout_s)
            return upstream_error(worker(), out, anthropic)

        try:
            out = await anext(outputs)
            if out.finished and _failed(out):  # refused before any byte: an error answer
                return failed(out)
            if on_answer is not None:
                on_answer(out.raw or b"", gen.decision.worker_id)
            if not pt.stream:
                while not out.finished:
                    out = await anext(outputs)
                if _failed(out):
                    return failed(out)
                if shown:
                    headers["x-thunderagent-worker"] = gen.decision.worker_id  # routed again: the one that served
                return web.Response(body=out.raw, content_type=answer_type, headers=headers)
            return await self._stream(request, worker(), out, outputs, headers, anthropic, gen)
        finally:
            await outputs.aclose()  # aborts the server's request if it did not finish
            fe.tenant_usage(request, gen)

    async def _stream(self, request: web.Request, worker: str | None, out: TokenOutput, outputs: Any,
                      headers: dict[str, str], anthropic: bool, gen: Generation) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        try:
            await resp.prepare(request)  # aiohttp holds the headers back until the first bytes
            while not out.finished:
                if out.raw:
                    await resp.write(out.raw)
                out = await anext(outputs)
            # the last bytes go with the end of the chunked body: one send, not two (a stream that
            # arrived in one read leaves in one write, headers included)
            end = b""
            if _failed(out):
                why = timeout_message(self.fe.fleet.deadlines.timeout_s) if gen.timed_out else None
                end = _error_event(worker, out, anthropic, why)
            await resp.write_eof(end or out.raw or b"")
        except (ConnectionResetError, ConnectionError) as exc:
            log.info("client went away during a relayed stream: %s", exc)
        return resp
