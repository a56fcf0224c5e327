"""The frontend side of per-tenant limits (``control_plane.tenant_limits``): each inference request
of a tenant key asks the pure :class:`~thunderagent.scheduler.tenant_limits.TenantLimiter` for a slot
before its body is read, and gives the slot back when its answer ends (streamed to the end, failed,
or its client gone: the handler's task ends in every case). A refusal is a 429 in OpenAI's shape with
``Retry-After`` (seconds, rounded up) and ``retry-after-ms``, which the official openai Python client
waits for before its own retry (up to two minutes).

Runs after the key check (it needs the tenant) and only on the routes it is given (the completion
endpoints): model listings, program endpoints, health and metrics are never limited.

A token limit (``tokens_per_min``) needs the prompt's length, known only inside the handler: the
handler calls :func:`take_prompt_tokens` once the prompt is tokenized (a refusal there is the same
429, or a 400 for a request larger than the tenant's whole bucket) and :func:`count_completion` with its
generation once it started; when the handler ends, the gate charges the tokens generated (all of
them: a client that went away mid-stream still had them computed), or gives the prompt's back if the
request never started (refused by the queue, no worker, client gone while held). With
``reserve_max_tokens`` (the default) a request that sets ``max_tokens`` takes them with its prompt, and
the end charges only the difference (gives back what it did not generate).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from thunderagent.config import ConfigError, TenantLimit
from thunderagent.config.tenants import ANY_TENANT
from thunderagent.frontend.auth import TENANT
from thunderagent.frontend.protocol import RequestError, error_body
from thunderagent.scheduler.tenant_limits import Refusal, TenantLimiter

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CODES = {"requests_per_s": "rate_limit_exceeded", "tokens_per_min": "tokens_rate_limit_exceeded",
          "max_in_flight": "too_many_requests_in_flight"}


class _Produced(Protocol):
    """A generation as the gate reads it (``control.generation.Generation``): the tokens produced so far."""

    produced: list[int]


# request keys: the tokens taken for the request (its prompt's, and the max_tokens reserved), and its
# generation (what it produced)
_PROMPT = web.RequestKey("tenant_prompt_tokens", tuple[int, int])
_UNSEEN = web.RequestKey("unseen_completion", int)  # a background response's charge (charge_unseen_completion)
GENERATION = web.RequestKey("generation", _Produced)  # the request as it started (tenants' charge, tracing)


class TenantRefused(Exception):
    """Raised by a handler through :func:`take_prompt_tokens`; the gate answers it."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


@dataclass(slots=True)
class TenantGate:
    limiter: TenantLimiter
    paths: frozenset[str]  # the canonical routes limited
    on_refused: Callable[[str, str], None]  # (tenant, limit): metrics
    on_in_flight: Callable[[str, int], None]  # (tenant, requests in flight now): metrics


GATE_KEY = web.AppKey("tenant_gate", TenantGate)


class SharedLimits(Protocol):
    """The other frontends of a NATS deployment, as far as tenant limits go
    (:class:`~thunderagent.control.tenant_peers.TenantPeers`)."""

    async def start(self, limiter: TenantLimiter, clock: Callable[[], float]) -> None: ...
    async def stop(self) -> None: ...


class _Programs(Protocol):
    """The program table (``scheduler.programs.ProgramTable``), as far as sharing ``max_programs`` goes."""

    peer_programs: Callable[[str, float], int] | None

    def busy(self, tenant: str) -> int: ...


def share_limits(app: web.Application, shared: SharedLimits | None, programs: _Programs) -> None:
    """With a gate and other frontends, the gate's limits hold across them: shared from start-up
    (after the fleet joined the bus) until clean-up (before it leaves). ``max_programs`` too: each
    frontend reports its tenants' programs with a request in flight, and ``programs`` (this frontend's
    table) counts the others' against each cap."""
    gate = app.get(GATE_KEY)
    if gate is None or shared is None:
        return
    gate.limiter.programs = programs.busy
    programs.peer_programs = gate.limiter.peer_programs

    async def start(app: web.Application) -> None:
        await shared.start(gate.limiter, asyncio.get_running_loop().time)

    async def stop(app: web.Application) -> None:
        await shared.stop()

    app.on_startup.append(start)
    app.on_cleanup.insert(0, stop)


class _Metrics(Protocol):
    def tenant_refused(self, tenant: str, limit: str) -> None: ...
    def tenant_in_flight(self, tenant: str, n: int) -> None: ...


def make_gate(limits: Mapping[str, TenantLimit], tenants: Collection[str], paths: Iterable[str],
              metrics: _Metrics, shared: bool = False) -> TenantGate | None:
    """The gate of ``limits`` over ``paths`` (None: no rate or in-flight limit configured, nor ``max_programs``
    to share: ``shared``, other frontends over NATS). ``tenants``: the tenants the API keys belong to; a limit
    naming another is refused (a typo would leave the tenant it meant unlimited)."""
    unknown = sorted(t for t in limits if t != ANY_TENANT and t not in tenants)
    if unknown:
        raise ConfigError(f"field 'control_plane.tenant_limits': no API key belongs to tenant {unknown[0]!r} "
                          f"(tenants with keys: {', '.join(sorted(tenants)[:10])})")
    limiter = TenantLimiter(limits, shared)
    if not limiter:  # none, or max_programs only (the program table's) on a frontend alone
        return None
    return TenantGate(limiter, frozenset(paths), metrics.tenant_refused, metrics.tenant_in_flight)


def take_prompt_tokens(request: web.Request, n: int, param: str, max_tokens: int = 0,
                       max_param: str = "max_tokens") -> None:
    """The handler of an admitted request has its ``n``-token prompt (the body field ``param``) and the
    ``max_tokens`` its client asked for (0: none, the field ``max_param``): with a token limit on its
    tenant, take the prompt's tokens (and, with ``reserve_max_tokens``, ``max_tokens`` more: what the
    request does not generate comes back when it ends) or raise :class:`TenantRefused` (a 429), or a
    :class:`RequestError` (400) for a request larger than the tenant's whole bucket."""
    gate = request.app.get(GATE_KEY)
    tenant = request.get(TENANT)
    if gate is None or tenant is None or not gate.limiter.counts_tokens(tenant):
        return
    reserve = max_tokens if gate.limiter.reserves(tenant) else 0
    refusal = gate.limiter.take_tokens(tenant, n, asyncio.get_running_loop().time(), reserve)
    if refusal is not None:
        if math.isinf(refusal.retry_after):  # never admitted: retrying cannot help
            gate.on_refused(tenant, refusal.limit)
            limit = gate.limiter.limit_of(tenant)
            fits = limit is not None and n <= limit.token_bucket  # then max_tokens made it too large
            raise RequestError(refusal.message, param=max_param if fits else param, code="request_too_large")
        raise TenantRefused(refusal)
    request[_PROMPT] = (n, reserve)


def charge_unseen_completion(request: web.Request, max_tokens: int | None, max_param: str) -> None:
    """A request whose completion this frontend never sees (a background response: the server generates it after
    its answer): with a token limit on its tenant it is charged its whole ``max_tokens`` when it ends, so it must
    name one (a 400 naming ``max_param`` otherwise)."""
    gate = request.app.get(GATE_KEY)
    tenant = request.get(TENANT)
    if gate is None or tenant is None or not gate.limiter.counts_tokens(tenant):
        return
    if max_tokens is None:
        raise RequestError(f"{max_param}: a background response's completion is not seen here; under the tenant's "
                           f"token limit it is charged in full, so it needs {max_param}", param=max_param)
    request[_UNSEEN] = max_tokens


def count_completion(request: web.Request, gen: _Produced) -> None:
    """The request started as ``gen``: what it produces is charged to its tenant when it ends (and its span says
    how it was routed: ``frontend/tracing.py``)."""
    request[GENERATION] = gen


def _settle(request: web.Request, limiter: TenantLimiter, tenant: str) -> None:
    """The request ended: charge what it generated, less what it reserved; all it took back if it never ran."""
    taken = request.get(_PROMPT)
    if taken is None:
        return
    prompt, reserved = taken
    gen = request.get(GENERATION)
    now = asyncio.get_running_loop().time()
    produced = None if gen is None else request.get(_UNSEEN, len(gen.produced))
    limiter.charge(tenant, produced - reserved if produced is not None else -(prompt + reserved), now)


def _duration(s: float) -> str:
    """A reset time as OpenAI writes it: ``250ms``, ``1.5s``, ``6m0s``."""
    if s < 1:
        return f"{math.ceil(s * 1000)}ms"
    if s < 60:
        return f"{round(s, 3):g}s"
    m, rest = divmod(s, 60)
    return f"{int(m)}m{round(rest, 3):g}s"


def rate_headers(request: web.Request) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the request's tenant, as its
    buckets hold now (empty when it has neither a request nor a token rate): clients that pace
    themselves on them (LiteLLM, LangChain) see this deployment's limits."""
    gate = request.app.get(GATE_KEY)
    tenant = request.get(TENANT)
    if gate is None or tenant is None:
        return {}
    return _headers(gate.limiter, tenant)


def _headers(limiter: TenantLimiter, tenant: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind, room in zip(("requests", "tokens"), limiter.headroom(tenant, asyncio.get_running_loop().time()),
                          strict=True):
        if room is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(room.limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(room.remaining)
            out[f"x-ratelimit-reset-{kind}"] = _duration(room.reset_s)
    return out


def refused_response(r: Refusal, limiter: TenantLimiter, tenant: str) -> web.Response:
    err = RequestError(r.message + "; retry later", status=429, code=_CODES[r.limit], type_="rate_limit_error")
    headers = {"Retry-After": str(max(1, math.ceil(r.retry_after))),
               "retry-after-ms": str(max(1, math.ceil(r.retry_after * 1000))), **_headers(limiter, tenant)}
    return web.Response(body=error_body(err), status=429, content_type="application/json", headers=headers)


@web.middleware
async def tenant_gate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    gate = request.app.get(GATE_KEY)
    tenant = request.get(TENANT)
    resource = request.match_info.route.resource
    if gate is None or tenant is None or resource is None or resource.canonical not in gate.paths:
        return await handler(request)
    limiter = gate.limiter
    refusal = limiter.admit(tenant, asyncio.get_running_loop().time())
    if refusal is not None:
        gate.on_refused(tenant, refusal.limit)
        return refused_response(refusal, limiter, tenant)
    gate.on_in_flight(tenant, limiter.in_flight(tenant))
    try:
        return await handler(request)
    except TenantRefused as exc:
        gate.on_refused(tenant, exc.refusal.limit)
        return refused_response(exc.refusal, limiter, tenant)
    finally:
        _settle(request, limiter, tenant)
        limiter.done(tenant)
        gate.on_in_flight(tenant, limiter.in_flight(tenant))
