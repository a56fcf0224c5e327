"""Per-tenant limits (scheduler/tenant_limits.py): the token bucket's exact admissions and retry
times, the in-flight bound, the ``"*"`` default, and slots given back."""

from __future__ import annotations

import pytest

from thunderagent.config import ConfigError, TenantLimit, parse_config
from thunderagent.scheduler.tenant_limits import IN_FLIGHT_RETRY_S, TenantLimiter


def test_a_full_bucket_admits_its_burst_then_the_sustained_rate() -> None:
    lim = TenantLimiter({"acme": TenantLimit(requests_per_s=2.0, burst=3)})
    assert [lim.admit("acme", 10.0) for _ in range(3)] == [None, None, None]
    r = lim.admit("acme", 10.0)
    assert r is not None and r.limit == "requests_per_s" and r.retry_after == pytest.approx(0.5)
    r = lim.admit("acme", 10.2)  # 0.4 of a token back
    assert r is not None and r.retry_after == pytest.approx(0.3)
    assert lim.admit("acme", 10.5) is None  # one whole token at 10.5
    assert lim.admit("acme", 10.5) is not None
    # an idle spell refills to the burst, never past it
    assert [lim.admit("acme", 100.0) for _ in range(4)].count(None) == 3


def test_refusals_take_nothing_and_the_slots_come_back() -> None:
    lim = TenantLimiter({"acme": TenantLimit(max_in_flight=2)})
    assert lim.admit("acme", 0.0) is None and lim.admit("acme", 0.0) is None
    r = lim.admit("acme", 0.0)
    assert r is not None and r.limit == "max_in_flight" and r.retry_after == IN_FLIGHT_RETRY_S
    assert "max_in_flight: 2" in r.message and lim.in_flight("acme") == 2
    lim.done("acme")
    assert lim.in_flight("acme") == 1 and lim.admit("acme", 0.0) is None
    for _ in range(5):  # more ends than starts never go negative
        lim.done("acme")
    assert lim.in_flight("acme") == 0


def test_a_request_refused_by_its_in_flight_bound_keeps_its_token() -> None:
    lim = TenantLimiter({"acme": TenantLimit(requests_per_s=1.0, burst=2, max_in_flight=1)})
    assert lim.admit("acme", 0.0) is None
    assert lim.admit("acme", 0.0).limit == "max_in_flight"  # type: ignore[union-attr]
    lim.done("acme")
    assert lim.admit("acme", 0.0) is None  # the second token was not spent by the refusal
    lim.done("acme")
    assert lim.admit("acme", 0.0).limit == "requests_per_s"  # type: ignore[union-attr]


def test_the_default_entry_limits_every_tenant_apart_and_a_named_entry_replaces_it() -> None:
    lim = TenantLimiter({"*": TenantLimit(max_in_flight=1), "acme": TenantLimit(requests_per_s=100.0)})
    assert lim.admit("globex", 0.0) is None and lim.admit("globex", 0.0) is not None
    assert lim.admit("initech", 0.0) is None  # its own account, not globex's
    assert all(lim.admit("acme", 0.0) is None for _ in range(50))  # no in-flight bound for acme
    assert not TenantLimiter({}) and TenantLimiter({"*": TenantLimit(max_in_flight=1)})
    assert TenantLimiter({"acme": TenantLimit(max_in_flight=1)}).admit("globex", 0.0) is None  # not limited


def test_the_bucket_defaults_to_the_rate_rounded_up() -> None:
    assert TenantLimit(requests_per_s=2.5).bucket == 3 and TenantLimit(requests_per_s=0.2).bucket == 1
    lim = TenantLimiter({"acme": TenantLimit(requests_per_s=0.5)})
    assert lim.admit("acme", 0.0) is None
    assert lim.admit("acme", 1.0).retry_after == pytest.approx(1.0)  # type: ignore[union-attr]
    assert lim.admit("acme", 0.5).retry_after == pytest.approx(1.0)  # a clock going back adds nothing


@pytest.mark.parametrize(("limits", "field", "why"), [
    ({"acme": {"requests_per_s": 1}}, "control_plane", "acts only with API keys on"),
    ({"acme": {"burst": 2}}, "control_plane.tenant_limits.acme", "burst acts only with requests_per_s"),
    ({"acme": {}}, "control_plane.tenant_limits.acme", "limits nothing"),
    ({"acme": {"requests_per_s": 0}}, "control_plane.tenant_limits.acme.requests_per_s", "greater than 0"),
    ({"ac me": {"max_in_flight": 1}}, "control_plane.tenant_limits", "must be 1-64 characters"),
    ({"acme": {"max_in_flight": 1, "rps": 3}}, "control_plane.tenant_limits.acme.rps", "Extra inputs"),
])
def test_bad_limits_name_the_field(limits, field, why) -> None:  # type: ignore[no-untyped-def]
    keys = {} if field == "control_plane" else {"api_keys": {"k" * 20: "acme"}}
    with pytest.raises(ConfigError) as exc:
        parse_config({"control_plane": {**keys, "tenant_limits": limits}})
    assert f"field '{field}'" in str(exc.value) and why in str(exc.value), str(exc.value)
