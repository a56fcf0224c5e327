"""Per-tenant limits (scheduler/tenant_limits.py): the token bucket's exact admissions and retry
times, the in-flight bound, the ``"*"`` default, and slots given back."""

from __future__ import annotations

import math

import pytest

from thunderagent.config import ConfigError, TenantLimit, parse_config
from thunderagent.frontend.tenant_gate import _duration
from thunderagent.scheduler.tenant_limits import IN_FLIGHT_RETRY_S, PEER_TTL_S, Headroom, TenantLimiter, Usage


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
    ({"acme": {"token_burst": 100}}, "control_plane.tenant_limits.acme", "token_burst acts only with tokens_per_min"),
    ({"acme": {"max_in_flight": 2, "reserve_max_tokens": False}}, "control_plane.tenant_limits.acme",
     "reserve_max_tokens acts only with tokens_per_min"),
    ({"acme": {"tokens_per_min": 0}}, "control_plane.tenant_limits.acme.tokens_per_min", "greater than or equal to 1"),
    ({"acme": {"requests_per_s": 0}}, "control_plane.tenant_limits.acme.requests_per_s", "greater than 0"),
    ({"ac me": {"max_in_flight": 1}}, "control_plane.tenant_limits", "must be 1-64 characters"),
    ({"acme": {"max_in_flight": 1, "rps": 3}}, "control_plane.tenant_limits.acme.rps", "Extra inputs"),
])
def test_bad_limits_name_the_field(limits, field, why) -> None:  # type: ignore[no-untyped-def]
    keys = {} if field == "control_plane" else {"api_keys": {"k" * 20: "acme"}}
    with pytest.raises(ConfigError) as exc:
        parse_config({"control_plane": {**keys, "tenant_limits": limits}})
    assert f"field '{field}'" in str(exc.value) and why in str(exc.value), str(exc.value)


def test_tokens_take_the_prompt_at_admission_and_the_completion_as_it_ends() -> None:
    lim = TenantLimiter({"acme": TenantLimit(tokens_per_min=600)})  # 10 tokens/s, a minute's worth held
    assert lim.counts_tokens("acme") and not lim.counts_tokens("globex")
    assert lim.tokens_left("acme", 0.0) == 600 and lim.tokens_left("globex", 0.0) is None
    assert lim.admit("acme", 0.0) is None and lim.take_tokens("acme", 500, 0.0) is None
    lim.charge("acme", 200, 0.0)  # the completion: the bucket goes into debt
    assert lim.tokens_left("acme", 0.0) == -100
    r = lim.take_tokens("acme", 50, 0.0)
    assert r is not None and r.limit == "tokens_per_min" and r.retry_after == pytest.approx(15.0)
    assert "the prompt's 50 tokens, 0 left" in r.message and "tokens_per_min: 600" in r.message
    assert lim.tokens_left("acme", 0.0) == -100  # a refusal takes nothing
    assert lim.take_tokens("acme", 50, 14.9) is not None and lim.take_tokens("acme", 50, 15.0) is None
    lim.charge("acme", -50, 15.0)  # a prompt given back (the request never ran)
    assert lim.tokens_left("acme", 15.0) == pytest.approx(50)
    lim.charge("acme", -10_000, 16.0)  # never past the bucket
    assert lim.tokens_left("acme", 100.0) == 600


def test_a_tenant_limit_dumped_with_its_defaults_loads_again() -> None:
    limit = TenantLimit(max_in_flight=2)
    assert TenantLimit.model_validate(limit.model_dump()) == limit


def test_a_reservation_takes_max_tokens_with_the_prompt_and_the_end_settles_the_difference() -> None:
    lim = TenantLimiter({"acme": TenantLimit(tokens_per_min=600), "globex": TenantLimit(
        tokens_per_min=600, reserve_max_tokens=False)})
    assert lim.reserves("acme") and not lim.reserves("globex") and not lim.reserves("initech")
    assert lim.admit("acme", 0.0) is None and lim.take_tokens("acme", 100, 0.0, reserve=300) is None
    assert lim.tokens_left("acme", 0.0) == 200
    r = lim.take_tokens("acme", 100, 0.0, reserve=150)  # 250 asked, 200 held
    assert r is not None and r.retry_after == pytest.approx(5.0)
    assert "the prompt's 100 tokens + max_tokens 150, 200 left" in r.message
    lim.charge("acme", 40 - 300, 0.0)  # it generated 40 of its 300: 260 come back
    assert lim.tokens_left("acme", 0.0) == 460
    too_big = lim.take_tokens("acme", 100, 0.0, reserve=550)
    assert too_big is not None and too_big.retry_after == math.inf
    assert "the prompt's 100 tokens + max_tokens 550 are more than" in too_big.message


def test_a_prompt_larger_than_the_bucket_is_never_admitted_and_gives_its_request_token_back() -> None:
    lim = TenantLimiter({"acme": TenantLimit(requests_per_s=1.0, burst=1, tokens_per_min=60, token_burst=100)})
    assert lim.admit("acme", 0.0) is None
    r = lim.take_tokens("acme", 101, 0.0)
    assert r is not None and r.retry_after == math.inf and "more than tenant 'acme'" in r.message
    lim.done("acme")
    assert lim.admit("acme", 0.0) is None  # the refused request's token came back
    assert lim.take_tokens("acme", 100, 0.0) is None  # the whole bucket: admitted
    lim.done("acme")
    assert lim.admit("acme", 0.5).limit == "requests_per_s"  # type: ignore[union-attr]
    assert TenantLimit(tokens_per_min=90).token_bucket == 90


def test_frontends_report_their_use_and_take_each_others() -> None:
    limits = {"acme": TenantLimit(requests_per_s=1.0, burst=4, tokens_per_min=600, max_in_flight=3)}
    a, b = TenantLimiter(limits), TenantLimiter(limits)
    assert a.report() == [] and a.admit("acme", 0.0) is None and a.take_tokens("acme", 100, 0.0) is None
    assert a.admit("acme", 0.0) is None and a.take_tokens("acme", 700, 0.0) is not None  # refused: gives back
    a.done("acme")
    assert a.report() == [Usage("acme", 1, 100, 1)] and a.report() == [Usage("acme", 0, 0, 1)]  # renewed
    for use in (Usage("acme", 1, 100, 1), Usage("acme", 2, 300, 2)):
        b.absorb("fa", use, 0.0)
    assert b.tokens_left("acme", 0.0) == 200  # 600 less a's 400
    assert b.admit("acme", 0.0) is None  # a's 2 in flight (its latest report) + b's first: under 3
    assert b.admit("acme", 0.0).limit == "max_in_flight"  # type: ignore[union-attr]  # 2 + 1: the cap
    b.absorb("fa", Usage("acme", 0, 0, 1), 0.1)
    r = b.admit("acme", 0.1)  # a slot now, but no request token: a's 3 admissions were taken here too
    assert r is not None and r.limit == "requests_per_s" and r.retry_after == pytest.approx(0.9)
    b.done("acme")
    assert b.report() == [Usage("acme", 1, 0, 0)] and b.report() == []
    # a frontend that stops reporting stops counting after PEER_TTL_S
    b.absorb("fa", Usage("acme", 0, 0, 3), 1.0)
    assert b.admit("acme", 1.0 + PEER_TTL_S).limit == "max_in_flight"  # type: ignore[union-attr]
    assert b.admit("acme", 1.01 + PEER_TTL_S) is None
    b.absorb("fa", Usage("globex", 5, 5, 5), 3.0)  # a tenant not limited here: nothing kept
    assert b.tokens_left("globex", 3.0) is None and b.admit("globex", 3.0) is None


def test_shared_frontends_report_their_busy_programs_for_each_others_caps() -> None:
    """Over NATS (``shared``), a tenant limited only by ``max_programs`` has an account too: each report
    carries its programs with a request in flight here (``programs``: the table's count), renewed while
    any are, and the others count them until a report says 0 or stops coming (``PEER_TTL_S``)."""
    limits = {"acme": TenantLimit(max_programs=3), "globex": TenantLimit(max_in_flight=2)}
    assert not TenantLimiter({"acme": TenantLimit(max_programs=3)})  # alone: the program table's alone
    a, b = TenantLimiter(limits, shared=True), TenantLimiter(limits, shared=True)
    assert a and a.admit("acme", 0.0) is None  # no bucket, no in-flight bound: admitted
    busy = {"acme": 2}
    a.programs = lambda tenant: busy.get(tenant, 0)
    assert a.report() == [Usage("acme", 1, 0, 1, 2)]
    a.done("acme")
    assert a.report() == [Usage("acme", 0, 0, 0, 2)]  # renewed while it has some
    busy["acme"] = 0
    assert a.report() == [Usage("acme", 0, 0, 0, 0)] and a.report() == []  # the 0 said once
    b.absorb("fa", Usage("acme", 0, 0, 0, 2), 0.0)
    b.absorb("fb", Usage("acme", 0, 0, 1, 1), 0.5)
    assert b.peer_programs("acme", 0.5) == 3 and b.peer_programs("globex", 0.5) == 0
    assert b.peer_programs("acme", 1.01) == 1  # fa's report not renewed: it stops counting
    b.absorb("fb", Usage("acme", 0, 0, 0, 0), 1.1)
    assert b.peer_programs("acme", 1.1) == 0


def test_headroom_is_what_each_bucket_holds_and_when_it_is_full_again() -> None:
    lim = TenantLimiter({"acme": TenantLimit(requests_per_s=2.0, burst=4, tokens_per_min=600),
                         "globex": TenantLimit(max_in_flight=1)})
    assert lim.headroom("acme", 0.0) == (Headroom(4, 4, 0.0), Headroom(600, 600, 0.0))
    assert lim.admit("acme", 0.0) is None and lim.take_tokens("acme", 100, 0.0) is None
    lim.charge("acme", 550, 0.0)  # 50 tokens of debt
    requests, tokens = lim.headroom("acme", 0.25)
    assert requests == Headroom(4, 3, pytest.approx(0.25))  # 3.5 held: 0.5 short, at 2 per second
    assert tokens == Headroom(600, 0, pytest.approx(64.75))  # -47.5 held: 647.5 short, at 10 per second
    assert lim.headroom("globex", 0.0) == (None, None) and lim.headroom("initech", 0.0) == (None, None)


@pytest.mark.parametrize(("s", "text"), [(0.0, "0ms"), (0.2501, "251ms"), (1.5, "1.5s"), (59.9996, "60s"),
                                         (360.0, "6m0s"), (62.5, "1m2.5s")])
def test_reset_times_are_written_as_openai_writes_them(s: float, text: str) -> None:
    assert _duration(s) == text
