"""Config of prefill/decode disaggregation: the transfer plane's knobs (per node group, the seed's
``kv_cache_transfer``) and the per-request decision (``routing.disaggregation``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from thunderagent.config._base import _Strict, knob_needs_switch


class KvTransferConfig(_Strict):
    """The transfer plane (``transfer/plane.py``) that moves a prefill worker's KV to a decode worker.
    Set it on the ``role: prefill`` node group (required there); the plane is fleet-wide, so one
    prefill group configures it (several prefill groups must agree)."""

    enabled: bool = Field(False, description="this group's workers prefill for others and their KV moves "
                          "(required for role prefill, refused without one)")
    bandwidth_gbps: float = Field(25.0, gt=0, description="default link bandwidth, gigabits/s, until transfers "
                                  "on a link are measured (EWMA of completed transfers)")
    latency_s: float = Field(0.001, ge=0, description="per-transfer fixed cost (setup, round trip), seconds")
    max_inflight: int = Field(4, ge=1, description="transfers moving at once, fleet-wide; more wait (backpressure)")
    max_inflight_bytes: int = Field(64 << 30, ge=1, description="bytes moving at once, fleet-wide; more wait")
    max_transfer_bytes: int = Field(16 << 30, ge=1, description="a cache larger than this is not moved: the "
                                    "request prefills where it decodes (16 GiB: 128 Ki tokens at 128 KiB each)")
    # Llama-3-8B in fp16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 128 KiB per token.
    bytes_per_token: int = Field(131072, ge=1, description="KV bytes per token (model-dependent)")
    target_watermark: float = Field(0.7, gt=0, le=1, description="a transfer is refused when the decode worker's "
                                    "active KV blocks after it would exceed this share of its pool")
    timeout_factor: float = Field(4.0, gt=1, description="a transfer still running this many times its estimate "
                                  "(plus latency) is cut and fails (cause timeout); the request prefills locally")
    ewma_alpha: float = Field(0.3, gt=0, le=1, description="weight of a completed transfer in its link's "
                              "measured bandwidth")

    @field_validator("bandwidth_gbps", "latency_s", "max_inflight", "max_inflight_bytes", "max_transfer_bytes",
                     "bytes_per_token", "target_watermark", "timeout_factor", "ewma_alpha")
    @classmethod
    def _knobs_need_switch(cls, v: object, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("enabled")),
                                 "kv_cache_transfer.enabled")


class DisaggConfig(_Strict):
    """Per-request prefill/decode decision (``scheduler/disagg.py``); acts only in a fleet with a
    ``role: prefill`` group. ``always``: every request with a full uncached block prefills on the
    prefill pool (waiting for the plane when it is full); ``conditional``: only when it pays (see the
    fields); ``never``: prefill where it decodes (prefill workers then stay idle)."""

    mode: Literal["always", "conditional", "never"] = "conditional"
    # About one pass (max_num_batched_tokens' default): a prefill that fits one pass delays the decoders
    # sharing it once; a longer one stalls them pass after pass (the ITL tail), and that is what moving pays for.
    min_uncached_tokens: int = Field(
        8192, ge=0, description="conditional: prefill remotely only when the chosen decode worker lacks more than "
        "this many prompt tokens (shorter prefills disturb its decodes for one pass at most)",
    )
    max_prefill_queue_passes: float = Field(
        8.0, gt=0, description="conditional: the chosen prefill worker's queued prefill tokens must stay under "
        "this many passes (max_num_batched_tokens), else the request prefills locally",
    )
    max_ttft_cost_s: float = Field(
        1.0, ge=0, description="conditional: the remote path's estimated time to first token (prefill worker's "
        "backlog + its prefill + the transfer) may exceed the local one (decode worker's backlog + its prefill) by "
        "at most this many seconds: the TTFT given up to keep a long prefill off the decode worker's passes",
    )
