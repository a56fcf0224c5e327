"""API keys and tenants (``control_plane.api_keys*``, ``admin_keys*``).

With keys on, every request carries ``Authorization: Bearer <key>`` (what the openai client sends) or
``x-api-key: <key>`` (what Anthropic's clients send):

- inference (``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``) and ``/v1/models`` need a
  tenant key;
  the request then belongs to that key's tenant: its cache salt is derived from the tenant
  (:func:`tenant_salt`), so tenants never share a cached prefix (here or in vLLM's own cache), and
  the tenant is its route key (fairness across tenants, not across client-chosen names);
- the admin endpoints (metrics, the planner) need an admin key: no key or an unknown one is 401,
  a tenant key 403;
- the program endpoints take either: a tenant key reaches its own programs only (program ids are
  namespaced by tenant), an admin key every tenant's (``frontend/programs_api.py``);
- ``/health`` stays public for load balancers but shows only ``status`` and ``healthy_workers``;
  the per-worker detail needs an admin key. ``/openapi.json`` is public;
- any other path (unknown routes included) needs a tenant key: nothing is open by omission.

Keys are looked up by their SHA-256 digest, never compared as strings: the time a lookup takes
depends on the digest of what the client sent, not on how many leading characters it guessed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from enum import Enum

from aiohttp import web

from thunderagent.config import ControlPlaneConfig
from thunderagent.config.auth import load_key_sources
from thunderagent.frontend.protocol import RequestError, error_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: request-local values set by the middleware
TENANT = web.RequestKey("tenant", str)  # the tenant of a tenant key; absent with keys off
DETAIL = web.RequestKey("detail", bool)  # whether the caller may see /health's detail (keys off, or an admin key)


class Access(Enum):
    PUBLIC = "public"  # anyone; an admin key unlocks the detail
    TENANT = "tenant"
    ADMIN = "admin"
    ANY = "any"  # a tenant key or an admin key (the handler scopes what a tenant reaches)


class KeyRing:
    """Tenant keys (``key -> tenant``) and admin keys, held as SHA-256 digests."""

    def __init__(self, tenants: Mapping[str, str], admins: Iterable[str]) -> None:
        self._tenants = {_digest(k): t for k, t in tenants.items()}
        self._admins = {_digest(k) for k in admins}
        self.tenants = frozenset(tenants.values())  # the tenants' names

    def tenant(self, key: str) -> str | None:
        return self._tenants.get(_digest(key))

    def is_admin(self, key: str) -> bool:
        return _digest(key) in self._admins


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


AUTH_KEY = web.AppKey("auth", KeyRing)
ACCESS_KEY = web.AppKey("access", dict)


def load_keyring(cp: ControlPlaneConfig) -> KeyRing | None:
    """The keys of the config's sources (files and environment read now); None with keys off."""
    if not cp.keys_on:
        return None
    tenants, admins = load_key_sources(cp.api_keys, cp.admin_keys, {
        "api_keys_file": cp.api_keys_file, "api_keys_env": cp.api_keys_env,
        "admin_keys_file": cp.admin_keys_file, "admin_keys_env": cp.admin_keys_env,
    })
    return KeyRing(tenants, admins)


def tenant_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The cache salt a request runs with: its tenant's, subdivided by the client's own salt.
    Tenant names hold no ``:``, so no client salt of one tenant can produce another tenant's salt."""
    if tenant is None:
        return client_salt
    return f"tenant:{tenant}:{client_salt}" if client_salt else f"tenant:{tenant}"


def bearer(request: web.Request) -> str | None:
    """The key: ``Authorization: Bearer <key>`` (OpenAI's clients), else ``x-api-key`` (Anthropic's)."""
    scheme, _, value = request.headers.get("Authorization", "").strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        return value
    return request.headers.get("x-api-key", "").strip() or None


def _unauthorized(message: str, code: str) -> web.Response:
    err = RequestError(message, status=401, code=code)
    return web.Response(body=error_body(err), status=401, content_type="application/json",
                        headers={"WWW-Authenticate": 'Bearer realm="thunderagent"'})


def _forbidden(message: str) -> web.Response:
    err = RequestError(message, status=403, code="admin_key_required", type_="permission_error")
    return web.Response(body=error_body(err), status=403, content_type="application/json")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Checks the key for the route's :class:`Access` (before the body is read)."""
    ring = request.app.get(AUTH_KEY)
    if ring is None:  # keys off: everything as without this middleware
        request[DETAIL] = True
        return await handler(request)
    resource = request.match_info.route.resource
    access = request.app[ACCESS_KEY].get(resource.canonical if resource else None, Access.TENANT)
    key = bearer(request)
    if key is None:
        if access is Access.PUBLIC:
            request[DETAIL] = False
            return await handler(request)
        return _unauthorized("no API key: send it as `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
                             "missing_api_key")
    admin = ring.is_admin(key)
    tenant = ring.tenant(key)
    if not admin and tenant is None:
        return _unauthorized("the API key is not valid", "invalid_api_key")
    if access is Access.ADMIN and not admin:
        return _forbidden(f"{request.method} {request.path} needs an admin key (control_plane.admin_keys)")
    if access is Access.TENANT and tenant is None:
        return _unauthorized("an admin key is not a tenant key: send a key of control_plane.api_keys",
                             "invalid_api_key")
    request[DETAIL] = admin
    if tenant is not None:
        request[TENANT] = tenant
    return await handler(request)
