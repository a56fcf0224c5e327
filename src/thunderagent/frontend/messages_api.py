"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API, relayed.

Claude Code and other Anthropic clients speak the Messages API; vLLM, SGLang and llama.cpp serve it. On a
fleet that relays (``engine: openai``, or vLLM / SGLang with ``relay`` not ``off``) ThunderAgent routes
each request on the prompt the server will render (``frontend/anthropic.py``), relays the client's body
to that server's own ``/v1/messages`` and the answer (JSON, or the event stream) back as it came; the
fleet's scheduling applies as to any request (holding queue, agent programs, tenants, API keys, which
Anthropic clients send as ``x-api-key``). ThunderAgent reads only what routing needs:

- ``model`` (a name this fleet serves, or a LoRA adapter every server lists), ``max_tokens`` (required,
  ≥ 1: the fleet's accounting), ``messages`` (a non-empty list of ``{role, content}``), ``stream``;
- its own fields: ``program_id``, ``priority`` (the holding queue's tier; not sent to the server, whose
  Messages API has none), ``explain``, ``cache_salt``; the route key ``body:user`` reads
  ``metadata.user_id``.

``count_tokens`` is answered here, from the same rendering (the model's tokenizer is needed: without
``model`` the byte-level stand-in would count bytes, so it is a 404 there). Simulated fleets and
``relay: off`` have no server to relay to: their ``/v1/messages`` is a 404 that says so.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

from thunderagent.frontend.anthropic import MESSAGES_PATH, check_fields, error_doc, to_chat
from thunderagent.frontend.auth import TENANT, tenant_salt
from thunderagent.frontend.protocol import MaxTokens, Priority, RequestError
from thunderagent.frontend.relay import RelayFrontend, Routed, decode_both, no_servers
from thunderagent.frontend.tokenizer import ByteTokenizer
from thunderagent.types import Passthrough


class _Message(msgspec.Struct):
    role: str
    content: str | list[Any]


class _Metadata(msgspec.Struct):
    user_id: str | None = None


# Lenient (unknown fields are the server's): what routing reads, typed.
class _Request(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    max_tokens: MaxTokens
    messages: Annotated[list[_Message], Meta(min_length=1)]
    stream: bool | None = False
    metadata: _Metadata | None = None
    cache_salt: str | None = None
    priority: Priority = 0
    explain: bool = False
    program_id: str | None = None


class _Count(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[_Message], Meta(min_length=1)]


_LEGACY_SESSION = re.compile(r"_session_([0-9A-Za-z-]{8,64})$")


def claude_session(user_id: str | None) -> str | None:
    """Claude Code's session id in ``metadata.user_id``: a JSON object's ``session_id`` (current clients), or the
    ``..._session_<uuid>`` suffix (older ones). None for anything else."""
    if not user_id:
        return None
    if user_id.startswith("{"):
        try:
            session = json.loads(user_id).get("session_id")
        except (ValueError, AttributeError):
            return None
        return session if isinstance(session, str) else None
    legacy = _LEGACY_SESSION.search(user_id)
    return legacy.group(1) if legacy else None


class MessagesApi:
    """The Messages API on a relaying fleet (``relay``: its frontend side; None: a fleet with no server to relay
    to, where both paths are a 404 that says so)."""

    def __init__(self, relay: RelayFrontend | None) -> None:
        self.relay = relay

    def _relay(self) -> RelayFrontend:
        if self.relay is None:
            raise no_servers("Messages API")
        return self.relay

    def _prompt(self, doc: dict[str, Any], scope: str | None = None) -> list[int]:
        tok = self._relay().fe.tokenizer
        chat = to_chat(doc, system_first=tok.system_first, effort_off=tok.thinking_off_effort())
        return tok.apply_openai_chat(chat, scope=scope)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        relay = self._relay()
        body = await request.read()
        req, doc = decode_both(_Request, body)
        lora = relay.admit(req.model, lambda: check_fields(doc), "messages_api")
        user = req.metadata.user_id if req.metadata is not None else None
        fields = Routed(req.max_tokens, req.cache_salt, req.priority, req.explain, req.program_id, user,
                        claude_session(user), model=req.model)
        pt = Passthrough(MESSAGES_PATH, body, bool(req.stream))
        scope = tenant_salt(request.get(TENANT), req.cache_salt)  # (a tenant's prompts reused by its own only)
        ids = await relay.fe.tokenize.run(len(body), self._prompt, doc, scope)
        return await relay.dispatch(request, fields, ids, pt, lora, "messages", anthropic=True)

    async def count_tokens(self, request: web.Request) -> web.Response:
        relay = self._relay()
        if isinstance(relay.fe.tokenizer, ByteTokenizer):
            raise RequestError("counting tokens needs the model's tokenizer: set `model` in the configuration",
                               status=404, code="not_found")
        req, doc = decode_both(_Count, body := await request.read())
        check_fields(doc)  # answered here: a field that would change nothing is a mistake to name
        if relay.fields is not None:  # (a vLLM / SGLang fleet checks model names; engine openai's servers do)
            relay.fe._check_model(req.model)
        n = len(await relay.fe.tokenize.run(len(body), self._prompt, doc, tenant_salt(request.get(TENANT), None)))
        return web.json_response({"input_tokens": n, "context_management": {"original_input_tokens": n}})


def anthropic_error(resp: web.StreamResponse) -> web.StreamResponse:
    """An error of the Messages API's paths in Anthropic's shape (``{"type": "error", "error": {type,
    message}}``), whichever layer refused (key check, tenant limits, the handler); its status and headers
    (``Retry-After``, rate limits, ``WWW-Authenticate``) kept. A server's own Anthropic error passes as is."""
    if not isinstance(resp, web.Response) or not isinstance(resp.body, bytes):
        return resp
    try:
        doc = json.loads(resp.body)
    except ValueError:
        return resp
    if not isinstance(doc, dict) or doc.get("type") == "error" or not isinstance(doc.get("error"), dict):
        return resp
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-type", "content-length")}
    return web.json_response(error_doc(resp.status, str(doc["error"].get("message", ""))), status=resp.status,
                             headers=headers)
