"""``routing``: the router's policy, its cost weights, hot-prefix replicas, and what rides along
(disaggregation, autotuning, cache migration): :class:`RoutingConfig`, re-exported by
:mod:`thunderagent.config`."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from thunderagent.config._base import _Strict, knob_needs_switch
from thunderagent.config.autotune import AutotuneConfig
from thunderagent.config.transfer import DisaggConfig, MigrationConfig


class Policy(str, Enum):
    kv_aware = "kv_aware"
    round_robin = "round_robin"
    random = "random"
    least_loaded = "least_loaded"
    power_of_two = "power_of_two"


class CostWeights(_Strict):
    prefill: float = Field(1.0, ge=0, description="weight of uncached prompt tokens")
    queue: float = Field(1.0, ge=0, description="weight of the worker's queued prefill tokens")
    # A decoding token slows each pass of its worker a little (one budget slot per sequence, a
    # KV-size-dependent decode time) but far less than a prompt token costs to prefill once; at
    # weight 1 a conversation would leave the worker holding its whole context as soon as a
    # neighbour decodes a context of similar size. 0.1 keeps decode load a balancing signal.
    decode: float = Field(0.1, ge=0, description="weight of the worker's decode tokens (KV footprint)")
    overlap_credit: float = Field(1.0, ge=0, le=1, description="share of cached tokens credited")
    credit_load_scale: float = Field(
        4.0, gt=0, description="queued prefill passes at which the cache credit is halved"
    )
    memory: float = Field(1.0, ge=0, description="penalty per unit of KV usage above the watermark")
    contention: float = Field(
        1.0, ge=0,
        description="extra charge per waiting request on recomputing tokens another worker holds",
    )


class HotPrefixConfig(_Strict):
    """Hot-prefix replicas (``router/hot.py``, kv_aware policy only). A prefix is *hot* when every worker
    holding it is backlogged while another worker has room; the router then sends its request to a new
    replica (the lowest-cost worker with room) so that worker warms up, up to ``max_replicas`` per prefix.
    Replicas retire, newest first, once the prefix has not been hot for ``retire_after_s``."""

    enabled: bool = Field(False, description="add replicas for hot prefixes (off: the cost function alone "
                          "decides, its load-shrunk cache credit being the only spreading)")
    max_replicas: int = Field(2, ge=1, description="extra workers a hot prefix may be sent to, per prefix")
    min_prefix_tokens: int = Field(
        512, ge=1, description="a shared prefix shorter than this is never replicated (its recompute is cheap)",
    )
    hot_backlog_passes: float = Field(
        1.0, gt=0, description="a holder counts as overloaded at this many passes (max_num_batched_tokens) of "
        "queued prefill tokens, or when busy; a prefix is hot only while all its holders are overloaded",
    )
    room_backlog_passes: float = Field(
        0.5, ge=0, description="a non-holder has room (can become a replica) below this many passes of queued "
        "prefill tokens, when not busy; must be below hot_backlog_passes (hysteresis)",
    )
    min_requests: int = Field(
        2, ge=1, description="requests that must find the prefix hot (within retire_after_s of each other) "
        "before the first replica is added: one backlogged request is not demand",
    )
    retire_after_s: float = Field(
        10.0, gt=0, description="seconds without the prefix being hot after which its newest replica retires "
        "(one per period; the set is forgotten when empty)",
    )
    max_prefixes: int = Field(
        1024, ge=1, description="hot prefixes tracked at most; past it the least recently hot is forgotten",
    )

    @field_validator("max_replicas", "min_prefix_tokens", "hot_backlog_passes", "room_backlog_passes",
                     "min_requests", "retire_after_s", "max_prefixes")
    @classmethod
    def _knobs_need_switch(cls, v: float, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("enabled")), "routing.hot_prefix.enabled")

    @model_validator(mode="after")
    def _hysteresis(self) -> HotPrefixConfig:
        if self.room_backlog_passes >= self.hot_backlog_passes:
            raise ValueError(
                f"room_backlog_passes ({self.room_backlog_passes}) must be below hot_backlog_passes "
                f"({self.hot_backlog_passes}): a worker with room must not count as overloaded"
            )
        return self


class RoutingConfig(_Strict):
    policy: Policy = Policy.kv_aware
    weights: CostWeights = CostWeights()
    temperature: float = Field(
        0.0, ge=0, description="0 = argmin; > 0 = softmax among the near-ties (cost within tie_margin of the best)"
    )
    tie_margin: float = Field(
        512.0, ge=0, description="with temperature > 0: workers whose cost is within this many prefill-token "
        "equivalents of the best are near-ties, the softmax samples among them only (0 = argmin)",
    )
    candidate_limit: int = Field(
        4, ge=1, description="kv_aware over a maintained fleet view (router/candidates.py): score the workers "
        "holding a prefix plus this many least loaded (more only while one could still win); fleets this small "
        "or smaller are scanned whole",
    )
    whole_scan_max_workers: int = Field(
        16, ge=0, description="fleets of at most this many workers are scored whole, without the fleet view's "
        "selection (cheaper there: bench/route_decision.py); the choice is the same either way up to 4 x "
        "candidate_limit workers. 0: the selection from candidate_limit + 1 workers",
    )
    memory_watermark: float = Field(0.7, ge=0, le=1)
    busy_kv_usage: float = Field(0.98, gt=0, le=1, description="KV usage at which a worker counts as busy")
    fallback: Literal["policy", "least_loaded", "reject"] = Field(
        "policy",
        description="when every worker is busy: apply the policy to all of them (a saturated fleet still "
        "benefits from cache hits most), route to the least loaded, or answer 503",
    )
    # A prediction must outlive the queueing delay of the request that made it: under load the next
    # turn of a conversation can arrive before the previous one was even prefilled. A stale one
    # costs at most one misroute (events and lazy verification correct the index).
    prediction_ttl: float = Field(120.0, gt=0, description="seconds a predicted index entry lives unconfirmed")
    # kv.check: a primary-hash collision can then only cost a miss, never a false hit. Cost measured
    # in bench/README.md (Double hash).
    double_hash: bool = Field(
        True, description="verify indexed blocks with a second, independent 64-bit hash (kv.check)"
    )
    miss_overlap_fraction: float = Field(
        0.0, ge=0, le=1,
        description="a request whose best and worst worker overlap differ by at most this share of the "
        "prompt is a cache miss everywhere: it is balanced by recent request rate, not by cost",
    )
    balance_half_life: float = Field(
        30.0, gt=0, description="seconds over which recent requests per worker decay (miss balancing)"
    )
    seed: int | None = Field(None, description="RNG seed for tie-breaks and sampling (None = random)")
    migration_limit: int = Field(
        3, ge=0, description="times a request whose worker died, stalled or failed mid-stream continues on another "
        "worker (prompt + tokens so far); 0 = off: it ends with an error",
    )
    preempt_enabled: bool = Field(
        False, description="simulated engines: a waiting request that cannot be admitted (no KV blocks or no "
        "sequence slot) evicts running lower-priority ones (recompute) when its TTFT saved x tier weight exceeds the "
        "victims' recompute time plus their memory cost (engine/preemption.py)",
    )
    preempt_tier_weight: float = Field(
        1.0, gt=0,
        description="with preempt_enabled: weight of a second of TTFT saved per priority level above the victim",
    )
    preempt_memory_cost_s: float = Field(
        0.5, ge=0, description="with preempt_enabled: seconds charged for evicting victims that hold the whole KV "
        "pool, in proportion to the share they hold",
    )
    fallback_to_local: bool = Field(
        True, description="prefill locally on the decode worker when a remote prefill does not pay or fails; false: "
        "strict disaggregation (needs a role: prefill group and disaggregation.mode always): a decode worker never "
        "prefills what it does not hold, a request waits for the prefill pool or is refused, and a failed remote "
        "prefill or transfer is routed again (the failed workers left out) instead of prefilled locally",
    )
    route_key: str = Field(
        "header:x-thunderagent-route-key",
        pattern=r"^(header:[A-Za-z0-9-]+|body:user)$",
        description="where a request's route key (tenant / business line) is read: `header:NAME` or `body:user`; "
        "the scheduler shares its queue fairly across keys",
    )
    hot_prefix: HotPrefixConfig = HotPrefixConfig()
    disaggregation: DisaggConfig = Field(DisaggConfig(), description="prefill/decode split per request (acts "
                                         "with a role: prefill node group)")
    autotune: AutotuneConfig = AutotuneConfig()  # online tuning of the cost weights (router/autotune.py)
    migration: MigrationConfig = MigrationConfig()  # cache migration under skew (transfer/migration.py)

    @field_validator("preempt_tier_weight", "preempt_memory_cost_s")
    @classmethod
    def _preempt_knobs_need_preemption(cls, v: float, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("preempt_enabled")),
                                 "routing.preempt_enabled")

    @model_validator(mode="after")
    def _hot_prefix_needs_kv_aware(self) -> RoutingConfig:
        if self.hot_prefix.enabled and self.policy is not Policy.kv_aware:
            raise ValueError(f"hot_prefix.enabled acts with policy kv_aware only (policy is {self.policy.value}): "
                             "other policies ignore the cache; disable hot_prefix or use kv_aware")
        if self.autotune.enabled:
            self.autotune.check_start(self.policy is Policy.kv_aware, self.weights)
        if not self.fallback_to_local and self.disaggregation.mode != "always":
            raise ValueError(f"fallback_to_local: false (strict disaggregation) needs disaggregation.mode always "
                             f"(it is {self.disaggregation.mode}: that mode prefills locally by design)")
        return self

