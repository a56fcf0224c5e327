"""Per-tenant admission limits (``control_plane.tenant_limits``): a token bucket for the request
rate, one for prompt + completion tokens, and a count of requests in flight, per tenant. Pure: the
caller passes ``now``.

A request is admitted when its tenant has a free in-flight slot and a whole token in its bucket;
admitting takes both, and :meth:`TenantLimiter.done` gives the slot back when the answer ends (a
refused request takes neither). The bucket refills at ``requests_per_s`` up to its size (``burst``),
so a tenant idle for a while may send a burst at once, then its sustained rate. A refusal says
which limit refused and when a retry would pass: for the rate, exactly when the bucket next holds a
whole token; for the in-flight bound, unknown (no answer's end can be predicted), so a fixed
second.

Tokens (``tokens_per_min``) are counted in two steps, because a request's size is known only once its
body is read and its completion's only once it ends: :meth:`TenantLimiter.take_tokens` takes the
prompt's tokens once it is tokenized (refused while the bucket holds fewer: then the request gives
its request token back, so the refusal took nothing), and :meth:`TenantLimiter.charge` the
completion's when it ends. Charging after the fact may leave the bucket below zero: a tenant's
overshoot is at most what its requests in flight generate, and the next prompt waits until the debt
is refilled. A request that never ran has its prompt given back (``charge`` with a negative count).

Several frontends (over NATS) share their tenants' limits: each reports what it admitted and took
since its last report, and how many requests it has in flight, per tenant (:meth:`TenantLimiter.report`,
every ``control.tenant_peers.REPORT_INTERVAL_S``), and every other frontend takes that from its own
buckets and counts those requests against ``max_in_flight`` (:meth:`TenantLimiter.absorb`). A
tenant's limits then hold across the frontends, overshot at most by what the others admit within one
report interval; a peer's in-flight count that is not renewed within ``PEER_TTL_S`` (the frontend is
gone) stops counting.

The tenants limited are those of the config (named, or every one under ``"*"``); with keys on they
come from the key sources, so the state here is bounded by the tenants an operator configured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from thunderagent.config.tenants import ANY_TENANT, TenantLimit

#: what a refusal by the in-flight bound tells the client to wait (seconds)
IN_FLIGHT_RETRY_S = 1.0
#: another frontend's in-flight count stops counting this long after its last report (seconds)
PEER_TTL_S = 1.0


@dataclass(slots=True, frozen=True)
class Refusal:
    limit: str  # "requests_per_s", "tokens_per_min" or "max_in_flight": the field that refused
    retry_after: float  # seconds until a retry could pass (0 < retry_after; inf: never, the request is too large)
    message: str


@dataclass(slots=True)
class _Bucket:
    rate: float  # refill per second
    size: float
    level: float
    at: float | None = None  # when ``level`` was last brought up to date (None: never: full)

    def refill(self, now: float) -> None:
        if self.at is not None and now > self.at:
            self.level = min(self.size, self.level + (now - self.at) * self.rate)
        if self.at is None or now > self.at:
            self.at = now

    def take(self, n: float, now: float) -> None:
        """Take ``n`` (below zero: a debt), or give ``-n`` back (never past the size)."""
        self.refill(now)
        self.level = min(self.size, self.level - n)


@dataclass(slots=True, frozen=True)
class Usage:
    """One tenant's use at one frontend since its last report (the other frontends take it too)."""

    tenant: str
    requests: int  # admitted
    tokens: int  # taken (prompts and completions, less prompts given back)
    in_flight: int  # now
    programs: int = 0  # its agent programs there with a request in flight, now (``max_programs``)


@dataclass(slots=True, frozen=True)
class Headroom:
    """What one of a tenant's buckets holds now (OpenAI's ``x-ratelimit-*`` headers tell clients)."""

    limit: int  # the bucket's size
    remaining: int  # whole units it holds now (0 in debt)
    reset_s: float  # until it is full again


@dataclass(slots=True)
class _Account:
    requests: _Bucket | None  # requests_per_s
    tokens: _Bucket | None  # tokens_per_min, in tokens per second
    cap: int | None  # max_in_flight
    shares_programs: bool = False  # max_programs: its busy programs are reported to the other frontends
    in_flight: int = 0
    sent_requests: int = 0  # admitted since the last report
    sent_tokens: int = 0  # taken since the last report
    told_in_flight: int = 0  # ``in_flight`` as last reported
    told_programs: int = 0  # busy programs as last reported
    #: another frontend -> (its requests in flight, its busy programs, when told)
    peers: dict[str, tuple[int, int, float]] | None = None

    def fresh_peers(self, now: float) -> list[tuple[int, int, float]]:
        peers = self.peers
        if not peers:
            return []
        for origin in [o for o, (_, _, at) in peers.items() if now - at > PEER_TTL_S]:
            del peers[origin]  # not renewed: that frontend is gone
        return list(peers.values())

    def peer_in_flight(self, now: float) -> int:
        return sum(n for n, _, _ in self.fresh_peers(now))


def _here(limit: TenantLimit) -> bool:
    return limit.requests_per_s is not None or limit.tokens_per_min is not None or limit.max_in_flight is not None


class TenantLimiter:
    def __init__(self, limits: Mapping[str, TenantLimit], shared: bool = False) -> None:
        """``shared``: the frontend shares limits with others (NATS): then ``max_programs`` is shared too (the
        program table enforces it, scheduler/programs.py; an account carries the tenant's busy programs
        between frontends). Alone, an entry limiting only ``max_programs`` limits nothing here, and still
        replaces "*" for its tenant."""
        def kept(lim: TenantLimit) -> bool:
            return _here(lim) or (shared and lim.max_programs is not None)

        self._limits: dict[str, TenantLimit | None] = {t: lim if kept(lim) else None for t, lim in limits.items()}
        self._default = self._limits.pop(ANY_TENANT, None)
        self._accounts: dict[str, _Account] = {}
        #: a tenant's programs here with a request in flight (``ProgramTable.busy``), for the reports
        self.programs: Callable[[str], int] = lambda tenant: 0

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
            rps, tpm = limit.requests_per_s, limit.tokens_per_min
            acc = self._accounts[tenant] = _Account(
                _Bucket(rps, limit.bucket, limit.bucket) if rps is not None else None,
                _Bucket(tpm / 60.0, limit.token_bucket, limit.token_bucket) if tpm is not None else None,
                limit.max_in_flight, limit.max_programs is not None)
        return acc

    def admit(self, tenant: str, now: float) -> Refusal | None:
        """Take a slot and a token for one request of ``tenant`` (None), or say why not."""
        acc = self._account(tenant)
        if acc is None:
            return None
        cap = acc.cap
        busy = acc.in_flight + acc.peer_in_flight(now) if cap is not None else 0
        if cap is not None and busy >= cap:
            return Refusal("max_in_flight", IN_FLIGHT_RETRY_S,
                           f"tenant {tenant!r} has {busy} requests in flight, its limit "
                           f"(control_plane.tenant_limits max_in_flight: {cap})")
        b = acc.requests
        if b is not None:
            b.refill(now)
            if b.level < 1.0:
                return Refusal("requests_per_s", (1.0 - b.level) / b.rate,
                               f"tenant {tenant!r} is over its request rate (control_plane.tenant_limits "
                               f"requests_per_s: {b.rate:g}, burst: {b.size:g})")
            b.level -= 1.0
        acc.in_flight += 1
        acc.sent_requests += 1
        return None

    def counts_tokens(self, tenant: str) -> bool:
        """``tenant`` has a token limit (its requests' tokens are worth counting)."""
        limit = self.limit_of(tenant)
        return limit is not None and limit.tokens_per_min is not None

    def reserves(self, tenant: str) -> bool:
        """``tenant``'s requests take their ``max_tokens`` with their prompt (``reserve_max_tokens``)."""
        limit = self.limit_of(tenant)
        return limit is not None and limit.tokens_per_min is not None and limit.reserve_max_tokens

    def take_tokens(self, tenant: str, n: int, now: float, reserve: int = 0) -> Refusal | None:
        """An admitted request of ``tenant`` has an ``n``-token prompt (and reserves ``reserve`` more for its
        completion): take them all (None), or say why not. A refused request gives back the request token
        :meth:`admit` took (its slot comes back with :meth:`done`, as for every admitted request)."""
        acc = self._account(tenant)
        b = acc.tokens if acc is not None else None
        if acc is None or b is None:
            return None
        b.refill(now)
        total = n + reserve
        if total <= b.level:
            b.level -= total
            acc.sent_tokens += total
            return None
        if acc.requests is not None:  # refused: it takes nothing
            acc.requests.take(-1.0, now)
            acc.sent_requests -= 1
        what = (f"control_plane.tenant_limits tokens_per_min: {b.rate * 60:g}, token_burst: {b.size:g}")
        asked = f"the prompt's {n} tokens" + (f" + max_tokens {reserve}" if reserve else "")
        if total > b.size:
            return Refusal("tokens_per_min", math.inf,
                           f"{asked} are more than tenant {tenant!r}'s token bucket holds ({what})")
        return Refusal("tokens_per_min", (total - b.level) / b.rate,
                       f"tenant {tenant!r} is over its token rate: {asked}, {max(0, int(b.level))} left ({what})")

    def headroom(self, tenant: str, now: float) -> tuple[Headroom | None, Headroom | None]:
        """``tenant``'s request and token buckets at ``now`` (None: not limited by that one)."""
        acc = self._account(tenant)
        if acc is None:
            return None, None
        out = []
        for b in (acc.requests, acc.tokens):
            if b is None:
                out.append(None)
                continue
            b.refill(now)
            out.append(Headroom(int(b.size), max(0, math.floor(b.level)), max(0.0, (b.size - b.level) / b.rate)))
        return out[0], out[1]

    def tokens_left(self, tenant: str, now: float) -> float | None:
        """What ``tenant``'s token bucket holds at ``now`` (below zero: a debt); None without a token limit."""
        acc = self._account(tenant)
        b = acc.tokens if acc is not None else None
        if b is None:
            return None
        b.refill(now)
        return b.level

    def charge(self, tenant: str, n: int, now: float) -> None:
        """Take ``n`` more tokens of ``tenant`` (a completion's, as it ended; the bucket may go below
        zero), or give ``-n`` back (a prompt taken for a request that never ran)."""
        acc = self._accounts.get(tenant)
        b = acc.tokens if acc is not None else None
        if acc is not None and b is not None and n:
            b.take(n, now)
            acc.sent_tokens += n

    def report(self) -> list[Usage]:
        """What changed since the last report, per tenant, for the other frontends: the requests and
        tokens taken, and the requests in flight (renewed while any are, so they keep counting there)."""
        out = []
        for tenant, acc in self._accounts.items():
            busy = self.programs(tenant) if acc.shares_programs else 0
            if acc.sent_requests or acc.sent_tokens or acc.in_flight or acc.told_in_flight or busy or acc.told_programs:
                out.append(Usage(tenant, acc.sent_requests, acc.sent_tokens, acc.in_flight, busy))
                acc.sent_requests = acc.sent_tokens = 0
                acc.told_in_flight, acc.told_programs = acc.in_flight, busy
        return out

    def peer_programs(self, tenant: str, now: float) -> int:
        """``tenant``'s programs with a request in flight at the other frontends, as last reported (a report
        not renewed within ``PEER_TTL_S`` stops counting)."""
        acc = self._accounts.get(tenant)
        return 0 if acc is None else sum(p for _, p, _ in acc.fresh_peers(now))

    def absorb(self, origin: str, use: Usage, now: float) -> None:
        """Frontend ``origin`` reported ``use``: take it from this frontend's buckets (they may go below
        zero), and count its requests in flight against ``max_in_flight`` until it reports again."""
        acc = self._account(use.tenant)
        if acc is None:  # not limited here (a frontend with another config): nothing to share
            return
        for b, n in ((acc.requests, use.requests), (acc.tokens, use.tokens)):
            if b is not None and n:
                b.take(n, now)
        if acc.cap is not None or acc.shares_programs:
            if acc.peers is None:
                acc.peers = {}
            if use.in_flight or use.programs:
                acc.peers[origin] = (use.in_flight, use.programs, now)
            else:
                acc.peers.pop(origin, None)

    def done(self, tenant: str) -> None:
        """One admitted request of ``tenant`` ended (answered, failed or abandoned)."""
        acc = self._accounts.get(tenant)
        if acc is not None and acc.in_flight > 0:
            acc.in_flight -= 1

    def in_flight(self, tenant: str) -> int:
        acc = self._accounts.get(tenant)
        return acc.in_flight if acc is not None else 0
