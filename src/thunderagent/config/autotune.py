"""``routing.autotune``: the online tuner of the kv_aware cost's hit-versus-load weights
(``router/autotune.py``; seed 000 §6, learned scheduling).

Off by default. Every knob below acts only with ``enabled: true`` (refused otherwise, naming the field)."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator, model_validator

from thunderagent.config._base import _Strict, knob_needs_switch

#: the weights the tuner may move: none of them enters ``cost.base_load`` (the fleet view orders free
#: workers by it), so swapping them never leaves that view's order stale
TUNABLE = ("credit_load_scale", "contention", "overlap_credit")

_KNOBS = ("params", "window", "switch_every", "pool_trials", "min_samples", "step", "min_step", "z", "max_rel_noise",
          "credit_load_scale_bounds", "contention_bounds", "overlap_credit_bounds", "log_steps", "settle_requests",
          "settle_max_requests")


class AutotuneConfig(_Strict):
    """A coordinate-wise hill climb on mean TTFT: one weight one step up or down is tried against the kept
    weights, the two alternating every ``switch_every`` finished requests until each has ``window``; the step
    is kept only if its mean TTFT is lower by more than ``z`` standard errors of the difference, else reverted."""

    enabled: bool = False
    params: tuple[str, ...] = Field(("credit_load_scale", "contention"), description="the weights tuned, in turn "
                                    "(any of credit_load_scale, contention, overlap_credit)")
    window: int = Field(1000, ge=2, description="finished requests a trial needs under each of the two weight "
                        "settings (the gains at stake are a few % of TTFT: with 200 the tuner kept nothing in "
                        "100,000 simulated requests where 1,000 found the grid's best)")
    switch_every: int = Field(25, ge=1, description="during a trial the tried and the kept weights alternate every "
                              "this many finished requests (both see the same traffic)")
    pool_trials: int = Field(4, ge=1, description="a reverted move's samples count again in its next trial, up to "
                             "this many windows per arm (1 = every trial starts afresh)")
    min_samples: int = Field(50, ge=2, description="no comparison with fewer finished requests in a window")
    step: float = Field(8.0, gt=1, description="a step multiplies or divides the weight by this at first (clamped "
                        "to its bounds); after a round in which every move reverted it shrinks to its square root, "
                        "down to min_step (a coarse step finds a gain a fine one is too small to show; the fine one "
                        "then refines it)")
    min_step: float = Field(2.0, gt=1, description="the finest step; rounds at it that keep nothing are followed by "
                            "rests (settle_requests)")
    z: float = Field(2.0, ge=0, description="a step is kept only if it lowers the mean TTFT by more than z standard "
                     "errors of the difference (the noise gate)")
    max_rel_noise: float = Field(0.25, gt=0, description="a window whose mean TTFT's standard error exceeds this "
                                 "share of its mean is too noisy: no step is tried or judged on it")
    credit_load_scale_bounds: tuple[float, float] = Field((0.5, 64.0), description="safe range of credit_load_scale")
    contention_bounds: tuple[float, float] = Field((0.0625, 16.0), description="safe range of contention")
    overlap_credit_bounds: tuple[float, float] = Field((0.25, 1.0), description="safe range of overlap_credit")
    log_steps: int = Field(32, ge=1, description="steps kept for /health (the newest)")
    settle_requests: int = Field(1000, ge=0, description="once every move from the kept weights was tried and "
                                 "reverted, the kept weights run alone (no trial) for this many finished requests "
                                 "before the moves are tried again; each further round without a keep doubles it, up "
                                 "to settle_max_requests, and a keep resets it (a converged tuner stops spending half "
                                 "its traffic on worse weights, and still re-checks for drift). 0: trials never rest")
    settle_max_requests: int = Field(32000, ge=0, description="the longest rest between rounds of trials")

    @field_validator(*_KNOBS)
    @classmethod
    def _knobs_need_switch(cls, v: object, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("enabled", False)),
                                 "routing.autotune.enabled")

    @field_validator("params")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [p for p in v if p not in TUNABLE]
        if bad or not v or len(set(v)) != len(v):
            raise ValueError(f"distinct names among {', '.join(TUNABLE)} are needed, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _ranges(self) -> AutotuneConfig:
        for p in TUNABLE:
            lo, hi = self.bounds(p)
            if not 0 < lo <= hi:
                raise ValueError(f"{p}_bounds: 0 < low <= high is needed, got {(lo, hi)}")
        if self.overlap_credit_bounds[1] > 1:
            raise ValueError("overlap_credit_bounds: the credit is a share, at most 1")
        if self.min_step > self.step:
            raise ValueError(f"min_step ({self.min_step}) must not exceed step ({self.step})")
        if self.settle_max_requests < self.settle_requests:
            raise ValueError(f"settle_max_requests ({self.settle_max_requests}) must not be below settle_requests "
                             f"({self.settle_requests})")
        if self.min_samples > self.window:
            raise ValueError(f"min_samples ({self.min_samples}) must not exceed window ({self.window})")
        return self

    def bounds(self, param: str) -> tuple[float, float]:
        b: tuple[float, float] = getattr(self, f"{param}_bounds")
        return b

    def check_start(self, kv_aware: bool, weights: object) -> None:
        """With the tuner on: the policy must be kv_aware and each tuned weight start inside its bounds."""
        if not kv_aware:
            raise ValueError("autotune.enabled acts with policy kv_aware only (the others use no cost weights)")
        for p in self.params:
            lo, hi = self.bounds(p)
            v = getattr(weights, p)
            if not lo <= v <= hi:
                raise ValueError(f"autotune: weights.{p} = {v} lies outside autotune.{p}_bounds {(lo, hi)}")
