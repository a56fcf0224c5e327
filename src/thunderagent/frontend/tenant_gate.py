"""The frontend side of per-tenant limits (``control_plane.tenant_limits``): each inference request
of a tenant key asks the pure :class:`~thunderagent.scheduler.tenant_limits.TenantLimiter` for a slot
before its body is read, and gives the slot back when its answer ends (streamed to the end, failed,
or its client gone: the handler's task ends in every case). A refusal is a 429 in OpenAI's shape with
``Retry-After`` (seconds, rounded up) and ``retry-after-ms``, which the official openai Python client
waits for before its own retry (up to two minutes).

Runs after the key check (it needs the tenant) and only on the routes it is given (the completion
endpoints): model listings, program endpoints, health and metrics are never limited.
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

_CODES = {"requests_per_s": "rate_limit_exceeded", "max_in_flight": "too_many_requests_in_flight"}


@dataclass(slots=True)
class TenantGate:
    limiter: TenantLimiter
    paths: frozenset[str]  # the canonical routes limited
    on_refused: Callable[[str, str], None]  # (tenant, limit): metrics
    on_in_flight: Callable[[str, int], None]  # (tenant, requests in flight now): metrics


GATE_KEY = web.AppKey("tenant_gate", TenantGate)


class _Metrics(Protocol):
    def tenant_refused(self, tenant: str, limit: str) -> None: ...
    def tenant_in_flight(self, tenant: str, n: int) -> None: ...


def make_gate(limits: Mapping[str, TenantLimit], tenants: Collection[str], paths: Iterable[str],
              metrics: _Metrics) -> TenantGate | None:
    """The gate of ``limits`` over ``paths`` (None: no rate or in-flight limit configured). ``tenants``: the tenants the
    API keys belong to; a limit naming another is refused (a typo would leave the tenant it meant
    unlimited)."""
    unknown = sorted(t for t in limits if t != ANY_TENANT and t not in tenants)
    if unknown:
        raise ConfigError(f"field 'control_plane.tenant_limits': no API key belongs to tenant {unknown[0]!r} "
                          f"(tenants with keys: {', '.join(sorted(tenants)[:10])})")
    limiter = TenantLimiter(limits)
    if not limiter:  # none, or max_programs only (the program table's)
        return None
    return TenantGate(limiter, frozenset(paths), metrics.tenant_refused, metrics.tenant_in_flight)


def refused_response(r: Refusal) -> web.Response:
    err = RequestError(r.message + "; retry later", status=429, code=_CODES[r.limit], type_="rate_limit_error")
    headers = {"Retry-After": str(max(1, math.ceil(r.retry_after))),
               "retry-after-ms": str(max(1, math.ceil(r.retry_after * 1000)))}
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
        return refused_response(refusal)
    gate.on_in_flight(tenant, limiter.in_flight(tenant))
    try:
        return await handler(request)
    finally:
        limiter.done(tenant)
        gate.on_in_flight(tenant, limiter.in_flight(tenant))
