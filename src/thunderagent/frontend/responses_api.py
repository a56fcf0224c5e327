"""``POST /v1/responses``: OpenAI's Responses API, relayed to the servers that serve it.

On a fleet that relays (``engine: openai``, or vLLM / SGLang with ``relay`` not ``off``) each request is
routed on the prompt the server will render (``frontend/responses.py``), relayed with the client's body to
that server's own ``/v1/responses``, and the answer (JSON, or the event stream) comes back as it came. The
fleet's scheduling applies as to any request (holding queue, programs, tenants, ``max_output_tokens``
accounting). ThunderAgent reads only what routing needs: ``model`` (optional, as vLLM takes it),
``input`` (required), ``instructions``, ``tools``, ``reasoning``, ``stream``, ``max_output_tokens``,
``previous_response_id``, and its own fields (``program_id``, ``priority``, ``explain``, ``cache_salt``;
``user`` is the route key with ``routing.route_key: body:user``).

A request continuing a stored response (``previous_response_id``) goes to the worker that answered it:
the server keeps that conversation in its own memory. This frontend remembers which worker answered each
of the last ``REMEMBERED`` responses it relayed (a frontend of a NATS deployment knows only its own: keep a
client's conversation on one frontend, e.g. with the Service's ``sessionAffinity: ClientIP``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

from thunderagent.frontend.protocol import MaxTokens, Priority
from thunderagent.frontend.relay import RelayFrontend, Routed, decode_both, no_servers
from thunderagent.frontend.responses import check_fields, to_chat
from thunderagent.types import RESPONSES_PATH, Passthrough

REMEMBERED = 100_000  # response id -> worker entries kept (~100 bytes each)
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')


# Lenient (unknown fields are the server's): what routing reads, typed.
class _Request(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)] | None = None
    input: str | list[Any]
    stream: bool | None = False
    max_output_tokens: MaxTokens | None = None
    previous_response_id: str | None = None
    cache_salt: str | None = None
    priority: Priority = 0
    explain: bool = False
    program_id: str | None = None
    user: str | None = None


class ResponsesApi:
    """The Responses API on a relaying fleet (``relay``: its frontend side; None: a fleet with no server to relay
    to, where it is a 404 that says so)."""

    def __init__(self, relay: RelayFrontend | None) -> None:
        self.relay = relay
        self._answered: OrderedDict[str, str] = OrderedDict()  # response id -> the worker that answered it

    def _remember(self, first: bytes, worker: str) -> None:
        found = _ID.search(first)
        if found is None:
            return
        answered = self._answered
        answered[found.group(1).decode(errors="replace")] = worker
        if len(answered) > REMEMBERED:
            answered.popitem(last=False)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        relay = self.relay
        if relay is None:
            raise no_servers("Responses API")
        body = await request.read()
        req, doc = decode_both(_Request, body)
        lora = relay.admit(req.model, lambda: check_fields(doc), "responses_api")
        pin = None
        if req.previous_response_id is not None:
            pin = self._answered.get(req.previous_response_id)  # its conversation is stored there
            if pin is not None:
                self._answered.move_to_end(req.previous_response_id)
        fields = Routed(req.max_output_tokens, req.cache_salt, req.priority, req.explain, req.program_id, req.user,
                        max_param="max_output_tokens")
        ids = relay.fe.tokenizer.apply_openai_chat(to_chat(doc), keep_call_order=True)  # (vLLM builds these messages)
        return await relay.dispatch(request, fields, ids, Passthrough(RESPONSES_PATH, body, bool(req.stream)), lora,
                                    "input", pin=pin, on_answer=self._remember)
