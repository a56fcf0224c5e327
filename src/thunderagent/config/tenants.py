"""Per-tenant limits (``control_plane.tenant_limits``): a sustained request rate with a burst, a
sustained token rate (prompt + completion tokens per minute) and a bound on requests in flight
(``scheduler/tenant_limits.py``, at the frontend), and a bound on the agent programs the tenant holds
(``scheduler/programs.py``)."""

from __future__ import annotations

import math

from pydantic import Field, model_validator

from thunderagent.config._base import _Strict
from thunderagent.config.auth import check_tenant

#: the ``tenant_limits`` entry of every tenant not named there
ANY_TENANT = "*"


class TenantLimit(_Strict):
    """One tenant's limits; a field left out does not limit."""

    requests_per_s: float | None = Field(
        None, gt=0, description="inference requests admitted per second, sustained (token bucket refill)",
    )
    burst: int | None = Field(
        None, ge=1, description="requests admitted at once after an idle spell (the bucket's size); default "
        "requests_per_s rounded up, at least 1",
    )
    tokens_per_min: int | None = Field(
        None, ge=1, description="prompt + completion tokens per minute, sustained (a token bucket): a request is "
        "admitted while the bucket holds its prompt's tokens, which it takes; its completion's tokens are taken when "
        "it ends, and may leave the bucket below zero (later requests then wait for it to refill)",
    )
    token_burst: int | None = Field(
        None, ge=1, description="tokens the bucket holds at most (default tokens_per_min): a prompt longer than this "
        "is refused with 400, never admitted",
    )
    reserve_max_tokens: bool = Field(
        True, description="with tokens_per_min: a request that sets max_tokens (or max_completion_tokens) takes them "
        "with its prompt, as OpenAI counts them, and gets back what it did not generate when it ends, so in-flight "
        "generation never overshoots the bucket; false: its completion is counted only when it ends",
    )
    max_in_flight: int | None = Field(
        None, ge=1, description="inference requests admitted and not yet answered at once (held in the "
        "scheduler's queue or being generated)",
    )
    max_programs: int | None = Field(
        None, ge=1, description="agent programs the tenant holds in the program table at once: past it a new "
        "program evicts the tenant's own idlest one, and is refused (429) while none of them is idle",
    )

    @model_validator(mode="after")
    def _something(self) -> TenantLimit:
        if self.burst is not None and self.requests_per_s is None:
            raise ValueError("burst acts only with requests_per_s")
        if self.token_burst is not None and self.tokens_per_min is None:
            raise ValueError("token_burst acts only with tokens_per_min")
        if not self.reserve_max_tokens and self.tokens_per_min is None:  # (the default: a dumped config loads)
            raise ValueError("reserve_max_tokens acts only with tokens_per_min")
        if (self.requests_per_s is None and self.tokens_per_min is None and self.max_in_flight is None
                and self.max_programs is None):
            raise ValueError("limits nothing: set requests_per_s, tokens_per_min, max_in_flight and/or max_programs")
        return self

    @property
    def bucket(self) -> int:
        """The token bucket's size (``burst``, else the rate rounded up)."""
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.requests_per_s or 0))

    @property
    def token_bucket(self) -> int:
        """The token bucket's size in tokens (``token_burst``, else a minute's worth)."""
        return self.token_burst if self.token_burst is not None else self.tokens_per_min or 0


def check_tenant_limits(v: dict[str, TenantLimit]) -> dict[str, TenantLimit]:
    for tenant in v:
        if tenant != ANY_TENANT:
            check_tenant(tenant)
    return v


def program_caps(limits: dict[str, TenantLimit]) -> tuple[dict[str, int | None], int | None]:
    """``max_programs`` per named tenant (None: unbounded; a named entry replaces ``"*"``), and the
    ``"*"`` entry's for the others."""
    default = limits.get(ANY_TENANT)
    return ({t: lim.max_programs for t, lim in limits.items() if t != ANY_TENANT},
            default.max_programs if default is not None else None)
