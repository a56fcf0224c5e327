"""Polynomial timing model: values from reference/dynamo-mocker.md §3."""

from __future__ import annotations

import pytest

from thunderagent.config import TimingConfig
from thunderagent.engine.timing import PolynomialTiming, make_timing

TOTAL = 16384 * 64


@pytest.mark.parametrize(
    ("tokens", "ms"),
    [(1, 16.517), (64, 17.475), (512, 24.386), (1024, 32.491), (4096, 85.756), (8192, 169.137)],
)
def test_prefill_polynomial_matches_reference(tokens: int, ms: float) -> None:
    assert PolynomialTiming().prefill_ms(tokens) == pytest.approx(ms, abs=5e-4)


def test_prefill_exact_values() -> None:
    t = PolynomialTiming()
    assert t.prefill_ms(512) == pytest.approx(24.385704, abs=1e-6)
    assert t.prefill_ms(8192) == pytest.approx(169.136918, abs=1e-6)
    assert t.prefill_ms(1) == pytest.approx(4.209989e-07 + 1.518344e-02 + 16.50142, rel=1e-12)


def test_prefill_of_nothing_is_free() -> None:
    t = PolynomialTiming()
    assert t.prefill_ms(0) == 0.0
    assert t.pass_time(0, 0, TOTAL, False) == 0.0


def test_decode_bounds() -> None:
    t = PolynomialTiming()
    assert t.decode_ms(0.0) == pytest.approx(5.74)
    # The reference text says 33.01 at a full pool, but its own coefficients give
    # -25.74 + 54.01 + 5.74 = 34.01 (the parabola peaks past p = 1, so this is the maximum).
    assert t.decode_ms(1.0) == pytest.approx(34.01)
    assert t.decode_ms(5.0) == pytest.approx(34.01)  # p is clamped to 1
    assert all(5.74 <= t.decode_ms(i / 100) <= 34.01 for i in range(101))
    # The floor only bites with other coefficients.
    low = PolynomialTiming(TimingConfig(decode_coeffs=(0.0, 0.0, 0.2), decode_floor_ms=1.0))
    assert low.decode_ms(0.5) == 1.0


def test_pass_time_is_a_sum_in_seconds() -> None:
    t = PolynomialTiming()
    expected_ms = t.prefill_ms(2048) + t.decode_ms(527 / TOTAL)
    assert t.pass_time(2048, 527, TOTAL, True) == pytest.approx(expected_ms / 1e3, rel=1e-12)
    # no decoder: no decode term, whatever A says
    assert t.pass_time(2048, 527, TOTAL, False) == pytest.approx(t.prefill_ms(2048) / 1e3, rel=1e-12)
    # decode only
    assert t.pass_time(0, 513, TOTAL, True) == pytest.approx(t.decode_ms(513 / TOTAL) / 1e3, rel=1e-12)


def test_first_decode_of_512_token_request() -> None:
    t = PolynomialTiming()
    # 595.510770 - 24.385704 = sum of 99 decode steps over A = 513 .. 611
    total = sum(t.decode_ms((512 + k) / TOTAL) for k in range(1, 100))
    assert total == pytest.approx(595.510770 - 24.385704, abs=2e-6)


def test_speedup_halves_everything_decode_speedup_only_decode() -> None:
    base = PolynomialTiming()
    fast = PolynomialTiming(TimingConfig(speedup=2.0))
    dfast = PolynomialTiming(TimingConfig(decode_speedup=2.0))
    args = (1024, 4096, TOTAL, True)
    pf = base.prefill_ms(1024) / 1e3
    dec = base.decode_ms(4096 / TOTAL) / 1e3
    assert base.pass_time(*args) == pytest.approx(pf + dec, rel=1e-12)
    assert fast.pass_time(*args) == pytest.approx((pf + dec) / 2, rel=1e-12)
    assert dfast.pass_time(*args) == pytest.approx(pf + dec / 2, rel=1e-12)


def test_make_timing_returns_polynomial() -> None:
    m = make_timing(TimingConfig())
    assert isinstance(m, PolynomialTiming)
    assert m.pass_time(512, 0, TOTAL, False) == pytest.approx(0.024385704, abs=1e-9)
