"""Per-tenant admission limits (``control_plane.tenant_limits``): a token bucket for the request
rate and a count of requests in flight, per tenant. Pure: the caller passes ``now``.

A request is admitted when its tenant has a free in-flight slot and a whole token in its bucket;
admitting takes both, and :meth:`TenantLimiter.done` gives the slot back when the answer ends (a
refused request takes neither). The bucket refills at ``requests_per_s`` up to its size (``burst``),
so a tenant idle for a while may send a burst at once, then its sustained rate. A refusal says
which limit refused and when a retry would pass: for the rate, exactly when the bucket next holds a
whole token; for the in-flight bound, unknown (no answer's end can be predicted), so a fixed
second.

The tenants limited are those of the config (named, or every one under ``"*"``); with keys on they
come from the key sources, so the state here is bounded by the tenants an operator configured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from thunderagent.config.tenants import ANY_TENANT, TenantLimit

#: what a refusal by the in-flight bound tells the client to wait (seconds)
IN_FLIGHT_RETRY_S = 1.0


@dataclass(slots=True, frozen=True)
class Refusal:
    limit: str  # "requests_per_s" or "max_in_flight": the field that refused
    retry_after: float  # seconds until a retry could pass (0 < retry_after)
    message: str


@dataclass(slots=True)
class _Account:
    rate: float  # tokens per second (0: no rate limit)
    size: float  # the bucket's size
    cap: int | None  # max_in_flight
    tokens: float
    at: float | None  # when ``tokens`` was last brought up to date (None: never: a full bucket)
    in_flight: int = 0


def _here(limit: TenantLimit) -> bool:
    return limit.requests_per_s is not None or limit.max_in_flight is not None


class TenantLimiter:
    def __init__(self, limits: Mapping[str, TenantLimit]) -> None:
        # ``max_programs`` is the program table's (scheduler/programs.py): an entry limiting only that
        # limits nothing here, and still replaces "*" for its tenant
        self._limits: dict[str, TenantLimit | None] = {t: lim if _here(lim) else None for t, lim in limits.items()}
        self._default = self._limits.pop(ANY_TENANT, None)
        self._accounts: dict[str, _Account] = {}

    def __bool__(self) -> bool:
        return self._default is not None or any(lim is not None for lim in self._limits.values())

    def limit_of(self, tenant: str) -> TenantLimit | None:
        return self._limits.get(tenant, self._default)

    def _account(self, tenant: str) -> _Account | None:
        acc = self._accounts.get(tenant)
        if acc is None:
            limit = self.limit_of(tenant)
            if limit is None:
                return None
            size = float(limit.bucket)
            acc = self._accounts[tenant] = _Account(limit.requests_per_s or 0.0, size, limit.max_in_flight, size, None)
        return acc

    def admit(self, tenant: str, now: float) -> Refusal | None:
        """Take a slot and a token for one request of ``tenant`` (None), or say why not."""
        acc = self._account(tenant)
        if acc is None:
            return None
        cap = acc.cap
        if cap is not None and acc.in_flight >= cap:
            return Refusal("max_in_flight", IN_FLIGHT_RETRY_S,
                           f"tenant {tenant!r} has {acc.in_flight} requests in flight, its limit "
                           f"(control_plane.tenant_limits max_in_flight: {cap})")
        if acc.rate:
            if acc.at is not None and now > acc.at:
                acc.tokens = min(acc.size, acc.tokens + (now - acc.at) * acc.rate)
            acc.at = now if acc.at is None or now > acc.at else acc.at
            if acc.tokens < 1.0:
                return Refusal("requests_per_s", (1.0 - acc.tokens) / acc.rate,
                               f"tenant {tenant!r} is over its request rate (control_plane.tenant_limits "
                               f"requests_per_s: {acc.rate:g}, burst: {acc.size:g})")
            acc.tokens -= 1.0
        acc.in_flight += 1
        return None

    def done(self, tenant: str) -> None:
        """One admitted request of ``tenant`` ended (answered, failed or abandoned)."""
        acc = self._accounts.get(tenant)
        if acc is not None and acc.in_flight > 0:
            acc.in_flight -= 1

    def in_flight(self, tenant: str) -> int:
        acc = self._accounts.get(tenant)
        return acc.in_flight if acc is not None else 0
