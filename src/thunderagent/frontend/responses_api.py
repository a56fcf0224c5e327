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
the server keeps that conversation in its own memory. So do ``GET /v1/responses/{id}`` (the stored response)
and ``POST /v1/responses/{id}/cancel``. This frontend remembers which worker answered each of the last
``REMEMBERED`` responses it relayed. An id it does not know (answered through another frontend of a NATS
deployment, or before a restart) is looked for: each routable server is asked for it in turn (a ``GET``
through the fleet's usual dispatch), and the first that has it answers, and is remembered.

A ``background`` response (``store`` on) is answered by the server at once (``queued``) and generated after: it
is routed and relayed as any request, its worker remembered from that answer; its reads (``?stream=true`` and
``starting_after`` replay its events) and its cancel go to that worker. ThunderAgent sees none of its completion,
so its load is what the server's own reports say (vLLM's ``/metrics``), its agent program's step ends with the
answer, and a tenant with a token limit is charged its whole ``max_output_tokens`` (which it then needs).

With API keys on, a tenant reaches only the stored responses it created through this frontend: another
tenant's id, or one this frontend does not remember, is a 404 (nothing is looked for: a server's store does
not say whose a response is). Keep a tenant's conversations on one frontend (the Service's
``sessionAffinity: ClientIP``, README "Deploying on Kubernetes").
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

from thunderagent.frontend.auth import TENANT, tenant_salt
from thunderagent.frontend.protocol import MaxTokens, Priority, RequestError
from thunderagent.frontend.relay import RelayFrontend, Routed, decode_both, no_servers
from thunderagent.frontend.responses import check_fields, to_chat
from thunderagent.frontend.tenant_gate import charge_unseen_completion
from thunderagent.types import RESPONSE_ID, RESPONSES_PATH, Passthrough

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
    background: bool | None = False


_READ = Routed(1, None, 0, False, None, None)  # a stored response's read or cancel: what dispatch reads of it


class ResponsesApi:
    """The Responses API on a relaying fleet (``relay``: its frontend side; None: a fleet with no server to relay
    to, where it is a 404 that says so)."""

    def __init__(self, relay: RelayFrontend | None) -> None:
        self.relay = relay
        # response id -> (the worker that answered it, the tenant whose it is: None with API keys off)
        self._answered: OrderedDict[str, tuple[str, str | None]] = OrderedDict()

    def _relay(self) -> RelayFrontend:
        if self.relay is None:
            raise no_servers("Responses API")
        return self.relay

    def _remember(self, rid: str, worker: str, tenant: str | None) -> None:
        answered = self._answered
        answered[rid] = (worker, tenant)
        answered.move_to_end(rid)
        if len(answered) > REMEMBERED:
            answered.popitem(last=False)

    def _remembering(self, tenant: str | None) -> Callable[[bytes, str], None]:
        def on_answer(first: bytes, worker: str) -> None:
            found = _ID.search(first)
            if found is not None:
                self._remember(found.group(1).decode(errors="replace"), worker, tenant)
        return on_answer

    async def _worker_of(self, request: web.Request, rid: str) -> tuple[str | None, web.StreamResponse | None]:
        """The worker storing response ``rid`` for this request's client: remembered, or (API keys off) looked for
        on every routable server; None where it is not found (or is another tenant's). Found by looking, also
        that server's answer to the read (a read of it needs no second one)."""
        tenant = request.get(TENANT)
        known = self._answered.get(rid)
        if known is not None:
            if known[1] != tenant:
                return None, None
            self._answered.move_to_end(rid)
            return known[0], None
        if tenant is not None:
            return None, None
        relay = self._relay()
        served: list[str] = []  # the worker that answered (a server that failed the read: another one)
        for w in [w.worker_id for w in relay.fe.fleet.routable()]:
            resp = await relay.dispatch(request, _READ, [], Passthrough(f"{RESPONSES_PATH}/{rid}", b"", False, "GET"),
                                        None, "response_id", pin=w, on_answer=lambda _, w: served.append(w), plain=0)
            if resp.status == 200 and served:
                self._remember(rid, served[-1], None)
                return served[-1], resp
        return None, None

    async def stored(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{response_id}`` (a stored response) and ``POST .../cancel``, on the server storing it."""
        relay = self._relay()
        rid = request.match_info["response_id"]
        cancel = request.method == "POST"
        if not RESPONSE_ID.fullmatch(rid):
            raise RequestError(f"{rid[:64]!r} is not a response id", param="response_id")
        query = "" if cancel else _replay_query(request)  # (a background response's events replayed)
        if cancel and request.query:
            name = sorted(request.query)[0]
            raise RequestError(f"query parameter {name!r} is not taken by a cancel", param=name)
        if cancel and await request.read():
            raise RequestError("cancelling a response takes no body")
        worker, read = await self._worker_of(request, rid)
        if worker is None:
            raise RequestError(f"no stored response {rid!r} is known", param="response_id", status=404,
                               code="not_found")
        if read is not None and not cancel and not query:
            return read  # (found by reading it)
        path = f"{RESPONSES_PATH}/{rid}" + ("/cancel" if cancel else query)
        read_pt = Passthrough(path, b"", bool(query), "POST" if cancel else "GET")
        return await relay.dispatch(request, _READ, [], read_pt, None, "response_id", pin=worker, plain=0)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        relay = self._relay()
        body = await request.read()
        req, doc = decode_both(_Request, body)
        lora = relay.admit(req.model, lambda: check_fields(doc), "responses_api")
        pin = None
        if req.previous_response_id is not None:  # its conversation is stored there
            pin, _ = await self._worker_of(request, req.previous_response_id)
            if pin is None and request.get(TENANT) is not None:
                raise RequestError(f"no stored response {req.previous_response_id!r} is known",
                                   param="previous_response_id", status=404, code="not_found")
        if req.background:  # the server generates after its answer: the tenant's token limit charges it up front
            charge_unseen_completion(request, req.max_output_tokens, "max_output_tokens")
        fields = Routed(req.max_output_tokens, req.cache_salt, req.priority, req.explain, req.program_id, req.user,
                        max_param="max_output_tokens")
        ids = await relay.fe.tokenize.run(len(body), relay.fe.tokenizer.apply_openai_chat, to_chat(doc),
                                          keep_call_order=True,  # (vLLM builds these messages)
                                          scope=tenant_salt(request.get(TENANT), req.cache_salt))
        return await relay.dispatch(request, fields, ids, Passthrough(RESPONSES_PATH, body, bool(req.stream)), lora,
                                    "input", pin=pin, on_answer=self._remembering(request.get(TENANT)))


def _replay_query(request: web.Request) -> str:
    """A stored response's read: ``?stream=true`` (and ``starting_after=N``) replays a background response's events
    as the server stores them (vLLM's query, passed on in one canonical form); "" for a plain read."""
    q = request.query
    unknown = sorted(set(q) - {"stream", "starting_after"})
    if unknown:
        raise RequestError(f"query parameter {unknown[0]!r} is not taken (stream, starting_after)", param=unknown[0])
    stream = q.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise RequestError(f"stream: true or false, got {q['stream'][:32]!r}", param="stream")
    after = q.get("starting_after")
    if after is not None and (stream != "true" or not after.isdigit() or len(after) > 10):
        raise RequestError("starting_after: an event's sequence number (0 or more), with stream=true",
                           param="starting_after")
    if stream != "true":
        return ""
    return "?stream=true" + ("" if after is None else f"&starting_after={int(after)}")
