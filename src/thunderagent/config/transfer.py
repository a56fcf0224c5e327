"""Config of prefill/decode disaggregation: the transfer plane's knobs (per node group, the seed's
``kv_cache_transfer``) and the per-request decision (``routing.disaggregation``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from thunderagent.config._base import _Strict, knob_needs_switch


class SimKvFaults(_Strict):
    """Faults the simulated workers' KV byte transport injects (``execution/kv_bytes.py``): tests and
    chaos drills. Each is a real failure path: the decode worker's pull fails with a cause and the
    request prefills on its decode worker (``thunderagent_pd_fallbacks_total{cause}``)."""

    slow_link_bps: float | None = Field(None, gt=0, description="the prefill side sends at most this many "
                                        "bytes/s; a pull running past its timeout fails (cause kv_timeout)")
    interrupt_p: float = Field(0.0, ge=0, le=1, description="share of pulls whose connection the prefill side "
                               "cuts mid-transfer (cause kv_interrupted)")
    corrupt_p: float = Field(0.0, ge=0, le=1, description="share of pulls with one byte flipped after its "
                             "block's checksum was taken (cause kv_checksum)")
    target_full_p: float = Field(0.0, ge=0, le=1, description="share of pulls the decode side refuses as if its "
                                 "KV pool could not take the blocks (cause target_full; a pool really too full "
                                 "refuses the same way)")
    seed: int = Field(0, description="seed of the faults' draws (per worker)")


class LinkEstimate(_Strict):
    """A measured link (``thunderagent probe-links`` writes these): the plane's starting estimate for
    transfers from ``src`` to ``dst`` instead of the configured default."""

    src: str = Field(min_length=1)
    dst: str = Field(min_length=1)
    bandwidth_gbps: float = Field(gt=0)
    latency_s: float = Field(ge=0)


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

    # Simulated workers move real bytes (execution/kv_bytes.py): the prefill worker serves each
    # handed-off block's payload over TCP, the decode worker pulls and checksums it before admitting.
    sim_block_bytes: int | None = Field(None, ge=0, description="simulated workers: payload bytes per KV block "
                                        "moved over TCP from the prefill to the decode worker (on "
                                        "routing.migration.link: from a copy's source to its target) (None: "
                                        "bytes_per_token x block_size, what the plane charges; 0: no bytes move, "
                                        "the block hashes alone)")
    sim_host: str = Field("127.0.0.1", min_length=1, description="simulated workers: address their KV byte "
                          "servers bind and advertise to decode workers")
    sim_faults: SimKvFaults = SimKvFaults()
    links: tuple[LinkEstimate, ...] = Field((), description="measured links (thunderagent probe-links --yaml): "
                                            "the plane starts from these estimates instead of bandwidth_gbps / "
                                            "latency_s")
    warmup_tokens: int = Field(0, ge=0, description="live fleets: each link from a prefill worker to a decode "
                               "worker runs one handoff of this many tokens (whole blocks) once both are routable "
                               "(start-up, a worker added), so vLLM pays its NIXL handshake then and the link "
                               "learns its measured rate before clients (control/link_warmup.py); 0: off")

    @field_validator("bandwidth_gbps", "latency_s", "max_inflight", "max_inflight_bytes", "max_transfer_bytes",
                     "bytes_per_token", "target_watermark", "timeout_factor", "ewma_alpha", "sim_block_bytes",
                     "sim_host", "sim_faults", "links", "warmup_tokens")
    @classmethod
    def _knobs_need_switch(cls, v: object, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("enabled")),
                                 "kv_cache_transfer.enabled")


def sim_fields_set(plane: KvTransferConfig) -> list[str]:
    """The simulated workers' byte fields ``plane`` sets to other than their defaults: by value, not by
    ``model_fields_set`` (a config dumped and read again, as a deployment file written from a Config,
    names every field at its default)."""
    fields = type(plane).model_fields
    return sorted(f for f in ("sim_block_bytes", "sim_host", "sim_faults")
                  if getattr(plane, f) != fields[f].get_default(call_default_factory=True))


def check_sim_fields(where: str, engine: str, plane: KvTransferConfig) -> None:
    """The simulated workers' byte fields act only on a simulated prefill group."""
    sim = sim_fields_set(plane)
    if engine != "simulated" and sim:
        raise ValueError(f"{where}.{sorted(sim)[0]}: simulated workers' KV bytes; engine {engine} moves its own KV "
                         "(remove it)")


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


class MigrationConfig(_Strict):
    """Cache migration under sustained skew (``transfer/migration.py``, kv_aware only): when a worker's
    prefill backlog stays past ``hot_backlog_passes`` for ``sustain_s`` while another worker has room, its
    most-demanded prefixes are copied to that worker over the transfer plane (when the copy is faster than
    recomputing them there); the index then holds them on the target and the cost function routes there."""

    enabled: bool = Field(False, description="copy a backlogged worker's most-demanded prefixes to a worker "
                          "with room (off: prefixes spread only by recompute)")
    interval_s: float = Field(0.1, gt=0, description="seconds between two looks at the fleet")
    # Short on purpose: the cost function spills a hot prefix's requests to recompute elsewhere once its
    # holder's load exceeds the prefix's length; a copy must land before that to spare the recompute.
    sustain_s: float = Field(0.25, ge=0, description="a worker is a source once its load stayed past "
                             "hot_backlog_passes (or it was busy) this long: a blip is not skew")
    hot_backlog_passes: float = Field(1.0, gt=0, description="load at which a worker counts as hot, in passes "
                                      "(max_num_batched_tokens) of the cost function's load terms (queued prefill, "
                                      "decode weight x decode tokens, memory)")
    room_backlog_passes: float = Field(0.25, ge=0, description="a worker below this load (same units), not busy, "
                                       "may receive a copy (so may one hot_backlog_passes or more below the "
                                       "source's load); must be below hot_backlog_passes")
    min_prefix_tokens: int = Field(2048, ge=1, description="shorter shared prefixes are never copied "
                                   "(recomputing them is cheap)")
    # Low on purpose: a request counts only when some worker already held its prefix (a reuse), and a skew
    # that starts as a burst spreads its demand over the hot prefixes: waiting for several requests per
    # prefix lets the cost function spill them to recompute first (bench/migration_skew.py: 3.0 missed the
    # 2x target on one seed of three in each skew shape, 1.0 met it on all).
    min_demand: float = Field(1.0, gt=0, description="requests (decayed by demand_half_life_s) found reusing "
                              "a prefix that it must have drawn to be copied")
    demand_half_life_s: float = Field(10.0, gt=0, description="half-life of a prefix's request count")
    max_per_tick: int = Field(4, ge=1, description="copies planned at most per look")
    max_gbps: float | None = Field(None, gt=0, description="copies move at most this many gigabits a second on "
                                   "average (one second of it may go at once; a larger copy goes, and the next "
                                   "ones wait its time): the rest of the link stays for prefill/decode handoffs; "
                                   "None: no cap")
    max_prefixes: int = Field(256, ge=1, description="prefixes whose demand is tracked; past it the least "
                              "recently requested is forgotten")
    link: KvTransferConfig = Field(KvTransferConfig(), description="the plane copies move on in a fleet without "
                                   "a prefill group (link.enabled: true there; a prefill group's plane is shared "
                                   "and this must stay unset)")

    @field_validator("interval_s", "sustain_s", "hot_backlog_passes", "room_backlog_passes", "min_prefix_tokens",
                     "min_demand", "demand_half_life_s", "max_per_tick", "max_prefixes", "link", "max_gbps")
    @classmethod
    def _knobs_need_switch(cls, v: object, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("enabled")), "routing.migration.enabled")

    @field_validator("link")
    @classmethod
    def _no_warmup(cls, v: KvTransferConfig) -> KvTransferConfig:
        if v.warmup_tokens:
            raise ValueError("warmup_tokens: the links warmed up are a prefill group's (set it on that group's "
                             "kv_cache_transfer), not the copies' link")
        return v

    @model_validator(mode="after")
    def _hysteresis(self) -> MigrationConfig:
        if self.room_backlog_passes >= self.hot_backlog_passes:
            raise ValueError(f"room_backlog_passes ({self.room_backlog_passes}) must be below hot_backlog_passes "
                             f"({self.hot_backlog_passes}): a target must not count as hot")
        return self
