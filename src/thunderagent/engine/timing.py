"""Pass-time models of the simulated engine.

A model answers one question: how long does one forward pass take, given what the batch holds?
It is pure arithmetic on the pass's shape, so the same model runs under the live server and under
the simulator. The default is NVIDIA Dynamo mocker's polynomial (Dynamo 1.6.1, ``dynamo.mocker``):

    pass_ms = pf(T) / speedup + dec(p) / (speedup * decode_speedup)

    pf(T)  = a*T^2 + b*T + c           (ms; pf(0) = 0: a pass without prompt tokens pays no prefill)
    dec(p) = max(floor, d2*p^2 + d1*p + d0), p = min(1, A / total_kv_tokens)
             (ms; 0 when nothing decodes)

``T`` is the number of new prompt tokens in the batch and ``A`` the summed sequence length of the
requests decoding in the pass. The two terms are added, not maxed: the mocker runs them back to back.
"""

from __future__ import annotations

from typing import Protocol

from thunderagent.config import TimingConfig


class TimingModel(Protocol):
    def pass_time(self, prefill_tokens: int, decode_kv_tokens: int, total_kv_tokens: int, any_decode: bool) -> float:
        """Duration of one forward pass, in **seconds**."""
        ...


class PolynomialTiming:
    """Dynamo mocker's polynomial timing model (coefficients from :class:`TimingConfig`)."""

    __slots__ = ("_a", "_b", "_c", "_d2", "_d1", "_d0", "_floor", "_pf_scale", "_dec_scale")

    def __init__(self, cfg: TimingConfig | None = None) -> None:
        cfg = cfg or TimingConfig()
        self._a, self._b, self._c = cfg.prefill_coeffs
        self._d2, self._d1, self._d0 = cfg.decode_coeffs
        self._floor = cfg.decode_floor_ms
        # Fold the ms->s conversion and the speedups into two multipliers, once.
        self._pf_scale = 1e-3 / cfg.speedup
        self._dec_scale = 1e-3 / (cfg.speedup * cfg.decode_speedup)

    def prefill_ms(self, tokens: int) -> float:
        """pf(T) in ms, before speedups."""
        if tokens <= 0:
            return 0.0
        return (self._a * tokens + self._b) * tokens + self._c

    def decode_ms(self, p: float) -> float:
        """dec(p) in ms, before speedups (``p`` = decoding KV tokens / total KV tokens, clamped to 1)."""
        if p > 1.0:
            p = 1.0
        v = (self._d2 * p + self._d1) * p + self._d0
        return v if v > self._floor else self._floor

    def pass_time(self, prefill_tokens: int, decode_kv_tokens: int, total_kv_tokens: int, any_decode: bool) -> float:
        t = self.prefill_ms(prefill_tokens) * self._pf_scale if prefill_tokens > 0 else 0.0
        if any_decode:
            p = decode_kv_tokens / total_kv_tokens if total_kv_tokens > 0 else 1.0
            t += self.decode_ms(p) * self._dec_scale
        return t


def make_timing(cfg: TimingConfig) -> TimingModel:
    """The timing model a node's config asks for."""
    if cfg.model == "polynomial":
        return PolynomialTiming(cfg)
    raise ValueError(f"unknown timing model {cfg.model!r}")  # pragma: no cover - config validates the literal
