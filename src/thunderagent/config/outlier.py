"""``control_plane.outlier``: slow-worker ejection and circuit breaking (``control/breaker.py``)."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator, model_validator

from thunderagent.config._base import _Strict, knob_needs_switch


class OutlierConfig(_Strict):
    """A worker that is alive but slow, or that keeps failing, leaves routing for a while and is
    probed back (half-open) before it takes full traffic again.

    - **Slow**: over the last ``window_s``, the median TTFT or median inter-token latency of the
      requests a worker finished is more than ``factor`` times the fleet's median of the other
      workers' medians (needs ``min_requests`` finished on it and at least 3 workers reporting).
    - **Failing**: ``failure_threshold`` requests in a row ended in an error on it (client aborts
      do not count).

    An ejected worker is out for ``eject_s``, doubled on every re-ejection up to ``max_eject_s``;
    then ``probe_requests`` requests at a time go to it (half-open): one that finishes normal
    (not slow by the same rule) closes the breaker, a slow or failed one ejects it again. Never
    more than ``max_ejected_fraction`` of the fleet is out at once (the slowest stay in first)."""

    enabled: bool = True
    window_s: float = Field(60.0, gt=0, description="seconds of finished requests the medians cover")
    factor: float = Field(3.0, gt=1, description="a worker is slow past this multiple of the fleet's median")
    min_requests: int = Field(10, ge=1, description="requests finished on a worker in the window before it is judged")
    min_itl_s: float = Field(
        0.02, ge=0, description="inter-token latencies below this are never slow (noise on an idle fleet)"
    )
    min_ttft_s: float = Field(0.25, ge=0, description="TTFTs below this are never slow")
    failure_threshold: int = Field(5, ge=1, description="errors in a row that open a worker's breaker")
    eject_s: float = Field(30.0, gt=0, description="first ejection's length (seconds)")
    max_eject_s: float = Field(300.0, gt=0, description="longest ejection after repeated ones")
    probe_requests: int = Field(1, ge=1, description="requests at a time sent to a half-open worker")
    max_ejected_fraction: float = Field(
        0.34, gt=0, le=1, description="most of the fleet out at once (floor; at least one worker always stays)"
    )

    @field_validator("window_s", "factor", "min_requests", "min_itl_s", "min_ttft_s", "failure_threshold", "eject_s",
                     "max_eject_s", "probe_requests", "max_ejected_fraction")
    @classmethod
    def _knobs_need_switch(cls, v: object, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("enabled", True)),
                                 "control_plane.outlier.enabled")

    @model_validator(mode="after")
    def _eject_bounds(self) -> OutlierConfig:
        if self.max_eject_s < self.eject_s:
            raise ValueError(f"max_eject_s ({self.max_eject_s}) is shorter than eject_s ({self.eject_s})")
        return self
