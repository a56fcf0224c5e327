"""The `scheduler:` section: the holding queue, program pacing, prefix grouping."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Final

from pydantic import Field, ValidationInfo, field_validator, model_validator

from thunderagent.config._base import _Strict, knob_needs_switch

#: a scheduler knob that acts only while the holding queue is on and the field it tunes is set
_KNOB_NEEDS: Final[Mapping[str, str]] = MappingProxyType({
    "overload_hold_s": "overload_prefills_in_flight",  # how long the overload gate stays engaged
    "admit_min_wait_s": "admit_ttft_factor",  # the least wait the SLO-style admission refuses
})


class PacingAccounting(str, Enum):
    paper = "paper"
    shared = "shared"


class ResumePlacement(str, Enum):
    most_free = "most_free"
    cached = "cached"


class ResumeOrder(str, Enum):
    arrival = "arrival"
    smallest = "smallest"


class IdleResume(str, Enum):
    head = "head"
    cached = "cached"


class PacingConfig(_Strict):
    """Program-aware pacing (``scheduler/pacing.py``): under KV pressure, agent programs are paused
    between turns so the others keep their cache, and resumed with hysteresis."""

    enabled: bool = Field(False, description="pause and resume agent programs by their workers' KV budget")
    accounting: PacingAccounting = Field(
        PacingAccounting.shared,
        description="a worker's demand: `paper` sums every program's tokens (the ThunderAgent paper's proxy); "
        "`shared` counts a prefix shared by several programs on the worker once (from their block hashes)",
    )
    placement: ResumePlacement = Field(
        ResumePlacement.cached,
        description="where a resumed program goes: `most_free` (the paper: most remaining KV) or `cached` (the "
        "worker the index says holds most of its blocks, when it has room; else the most free)",
    )
    resume_order: ResumeOrder = Field(
        ResumeOrder.arrival,
        description="order of paused and new programs within each class (held request, new, idle): `arrival` "
        "(oldest pause first, and nobody passes the head: a large program is not starved) or `smallest` (the "
        "paper's proxy: fewest context tokens first, and a program that does not fit is passed over)",
    )
    work_conserving: bool = Field(
        True, description="resume the next paused program on a worker that has nothing to run, whatever its KV "
        "demand (a worker idling while programs wait loses more than their recompute costs); off in the paper",
    )
    idle_resume: IdleResume = Field(
        IdleResume.head,
        description="which paused program a worker with nothing to run takes (work_conserving): `head` (the next in "
        "resume order, sent to the idle worker holding most of its blocks) or `cached` (the paused program holding "
        "most blocks on that worker, out of order; the head goes to an idle worker only where it holds blocks)",
    )
    sticky: bool = Field(
        False, description="a resumed program stays pinned to the worker it was resumed on until it is paused "
        "again (the paper's proxy); off: the pin holds for the turn it was resumed for, and its later turns are "
        "routed by cache and load like any request (a pinned program cannot leave a busy worker)",
    )
    tick_s: float = Field(1.0, gt=0, description="seconds between pacing decisions")
    pause_threshold: float = Field(
        0.95, gt=0, le=4.0, description="pause programs on a worker whose demand exceeds this fraction of its KV tokens"
    )
    resume_threshold: float = Field(
        0.8, gt=0, le=4.0, description="resume programs while the target worker's demand stays under this fraction"
    )
    max_pause_s: float = Field(
        60.0, gt=0, description="a program paused (or a new one held) this long is resumed whatever the pressure"
    )
    min_run_s: float = Field(120.0, ge=0, description="a resumed program is not paused again within this time")
    acting_half_life_s: float = Field(
        30.0, gt=0, description="on the resume side an idle (acting) program's tokens count half per this many seconds"
    )

    @field_validator("accounting", "placement", "resume_order", "work_conserving", "idle_resume", "sticky", "tick_s",
                     "pause_threshold", "resume_threshold", "max_pause_s", "min_run_s", "acting_half_life_s")
    @classmethod
    def _knobs_need_pacing(cls, v: object, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("enabled")), "scheduler.pacing.enabled")

    @model_validator(mode="after")
    def _consistent(self) -> PacingConfig:
        if self.idle_resume is IdleResume.cached and not self.work_conserving:
            raise ValueError("scheduler.pacing.idle_resume: cached chooses what an idle worker resumes, which only "
                             "happens with work_conserving: true")
        if self.resume_threshold >= self.pause_threshold:
            raise ValueError(f"scheduler.pacing.resume_threshold ({self.resume_threshold}) must be below "
                             f"pause_threshold ({self.pause_threshold}): without hysteresis programs flap")
        return self


class GroupingConfig(_Strict):
    """Prefix grouping and coalescing (``scheduler/grouping.py``): a request sharing a prefix with
    one in flight whose blocks are not stored yet waits for them on that worker instead of
    prefilling the prefix again; under load new requests wait a short window so their siblings
    can find them."""

    enabled: bool = Field(
        False, description="group requests sharing at least `group_min_blocks` leading blocks behind one leader "
        "per worker, and hold new requests up to the adaptive window under load",
    )
    coalesce: bool = Field(
        False, description="identical in-flight prefills (same full blocks, even fewer than `group_min_blocks`) "
        "follow the one already running",
    )
    window_max_ms: float = Field(
        10.0, ge=0, description="with `enabled`: the window new requests wait for siblings at full load (0 at idle, "
        "growing with the workers' queued prefill)",
    )
    batch_window_max_ms: float = Field(
        50.0, ge=0, description="with `enabled`: the window for the batch tier (priority < 0)",
    )
    group_min_blocks: int = Field(
        4, ge=1, description="leading blocks two requests must share to be grouped (with `enabled`)",
    )
    follower_max_wait_ms: float = Field(
        2000.0, gt=0, description="a follower whose leader's prefix is not stored after this long goes on its own",
    )

    @model_validator(mode="after")
    def _acts(self) -> GroupingConfig:
        # a knob set to a non-default value must act: the window and the threshold act only with
        # grouping, the follower bound with grouping or coalescing
        if not self.enabled:
            for name in ("window_max_ms", "batch_window_max_ms", "group_min_blocks"):
                if name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"scheduler.grouping.{name} acts only with scheduler.grouping.enabled: true; "
                                     "enable it or remove the field")
        if (not self.enabled and not self.coalesce and "follower_max_wait_ms" in self.model_fields_set
                and self.follower_max_wait_ms != type(self).model_fields["follower_max_wait_ms"].default):
            raise ValueError("scheduler.grouping.follower_max_wait_ms acts only with scheduler.grouping.enabled or "
                             "coalesce: true; enable one or remove the field")
        if self.batch_window_max_ms < self.window_max_ms:
            raise ValueError(f"scheduler.grouping.batch_window_max_ms ({self.batch_window_max_ms}) must be at least "
                             f"window_max_ms ({self.window_max_ms}): the batch tier waits longer, not shorter")
        return self

    @property
    def active(self) -> bool:
        return self.enabled or self.coalesce


class SchedulerConfig(_Strict):
    """The holding queue in front of the router (``scheduler/queue.py``), on by default: the bounded
    admission that keeps an overloaded server serving (429 + Retry-After past its bounds). Off: every
    request is routed the moment it arrives, into the engines' own queues. ``thunderagent sim`` runs
    it only when asked (``--scheduler on`` or ``enabled: true`` written in the config file)."""

    enabled: bool = Field(
        True, description="hold requests here while no worker can start them; false routes every request at once "
        "into the engines' own queues, without bound (no 429 under overload)",
    )
    engine_queue_depth: int = Field(
        0, ge=0,
        description="requests that may wait in an engine beyond its free sequence slots: a worker can start a "
        "request while running + waiting < its max_batch_size + this, its prefill backlog is under "
        "`engine_backlog_passes` passes and it is not busy (a worker that does not report its slots: while fewer "
        "than max(1, this) wait in its engine); when none can, requests wait in the scheduler, ordered by priority. "
        "0: nothing waits in an engine for a slot, so the scheduler's admission bound sees every wait",
    )
    engine_backlog_passes: float = Field(
        1.0, gt=0,
        description="queued prefill tokens (in passes of max_num_batched_tokens) under which a worker can start a "
        "request; with routing.disaggregation.mode always, a prefill worker too must be under it for a request of "
        "priority <= 0 to leave the scheduler (decode workers prefill nothing there, so they alone always look free)",
    )
    max_queued: int = Field(4096, ge=1, description="requests held at most; past it new ones get 429")
    max_queue_delay_s: float | None = Field(
        5.0, gt=0,
        description="a new request that would wait longer than this (requests held ahead x measured dispatch gap) "
        "gets 429 with Retry-After at once: under sustained overload the excess is refused and admitted requests' "
        "TTFT stays near a lightly loaded fleet's; null: only the count bounds (the simulator's replays use null)",
    )
    hold_admitted_programs: bool = Field(
        True,
        description="the wait bounds (max_queue_delay_s, admit_ttft_factor) refuse an agent program's first request "
        "only: once a request of a program was dispatched, its later steps are held, not refused with 429 (an agent "
        "mid-task that is refused retries or fails; under overload new programs are turned away instead). The count "
        "bounds (max_queued, max_queued_per_key) still refuse. false: every request alike",
    )
    max_queued_per_key: int = Field(1024, ge=1, description="requests held at most per route key (tenant)")
    max_wait_s: float = Field(
        30.0, gt=0, description="a request held this long goes next, whatever its tier and size"
    )
    aging_tokens_per_s: float = Field(
        2048.0, ge=0,
        description="short-first ageing: each second waited counts as this many fewer uncached prompt tokens",
    )
    affinity_candidates: int = Field(
        16, ge=1,
        description="when a worker frees up while others cannot start a request, the next request is the best of "
        "this many at the head of its route key's order (short first with ageing), and of the best requests of up "
        "to this many - 1 other route keys of its tier, re-ranked by the uncached prompt tokens on the workers that "
        "can start it now: a request whose cache holder is busy lets one through whose holder is free, instead of "
        "recomputing its prefix elsewhere (requests whose cache sat on busy workers only at enqueue are looked past, "
        "up to 4x this many). Priority tiers and max_wait_s are unchanged; a key served out of its "
        "turn goes at most one drr_quantum_tokens into debt, so route-key shares hold over time. 1: the order alone",
    )
    affinity_recompute_weight: float = Field(
        3.0, ge=0,
        description="in that re-ranking, each prompt token the workers that can start a request would compute "
        "although a worker that cannot holds it counts this many times more (recomputing cache the fleet has "
        "spends an overloaded fleet's capacity twice): a fresh request goes before one that can wait for its "
        "holder. 0: only the tokens to prefill count",
    )
    drr_quantum_tokens: int = Field(
        8192, ge=1, description="deficit round robin across route keys: prompt tokens a key may send per round"
    )
    program_idle_ttl_s: float = Field(
        600.0, gt=0, description="an agent program idle (acting) this long is terminated and forgotten"
    )
    max_programs: int = Field(
        10_000, ge=1, description="agent programs tracked at once: past it a new program's first request "
        "makes an idle program forgotten early, the idlest of the tenant holding the most (programs with a "
        "request in flight are never)"
    )
    pacing: PacingConfig = PacingConfig()
    grouping: GroupingConfig = GroupingConfig()
    overdue_share: float = Field(
        1.0, gt=0, le=1,
        description="share of dispatches that go to requests held `max_wait_s` or longer while any are held (the "
        "rest keep the priority / short-first order); 1: every overdue request goes first. Below 1, a sustained "
        "overload no longer turns the queue into FIFO, and overdue requests still drain at this share of the rate",
    )
    tracked_prefill_passes: float | None = Field(
        None, gt=0,
        description="dispatch gate on the router's own count instead of the engines' reports: a worker can start a "
        "request while the uncached prompt tokens the scheduler sent it and that have not produced a first token "
        "are at most this many passes (max_num_batched_tokens), and it is not busy (Dynamo's router_queue_threshold "
        "rule); null: the engine-reported gate (`engine_queue_depth`, `engine_backlog_passes`)",
    )
    prefills_in_flight: int | None = Field(
        None, ge=1,
        description="latency gate: a worker starts a request only while fewer than this many requests the scheduler "
        "sent it have no first token yet (besides the slot rule), and a request goes only to a worker that can "
        "start it now. With 1, an admitted request waits in the engine for at most a decode pass before its own "
        "prefill, never for another request's prefill; the engine admits new prompts one per prefill, so a fleet "
        "whose arrivals outpace that holds or refuses more. null: off",
    )
    overload_prefills_in_flight: int | None = Field(
        1, ge=1,
        description="the same latency gate as prefills_in_flight, engaged only while the fleet is overloaded: from "
        "a request refused with 429 for the wait it would have (max_queue_delay_s or admit_ttft_factor; not a count "
        "bound or a route key's quota) until overload_hold_s without one. Under sustained overload what is admitted "
        "then starts at once instead of behind another prefill "
        "(bench/overload.py: admitted TTFT p99 1.5x unloaded, 1.9-2.5x without); bursts the engines' free slots "
        "take are never refused, so they never engage it. Ignored while prefills_in_flight is set; null: off",
    )
    overload_hold_s: float = Field(
        10.0, gt=0, description="overload_prefills_in_flight stays engaged this long after the last 429 for load",
    )
    admit_ttft_factor: float | None = Field(
        2.0, gt=1,
        description="SLO-style admission: a request no worker can start now is held only while its predicted wait "
        "(requests held ahead and itself x the measured seconds per dispatch: what held requests really waited over "
        "the dispatches made meanwhile, or the mean drain gap if longer) stays within (factor - 1) x the measured "
        "service TTFT (dispatch to first token, smoothed), so what is admitted gets a TTFT within about factor x a "
        "lightly loaded fleet's; past it 429 with Retry-After. Acts once measured, with max_queue_delay_s as the "
        "hard cap; null: off (the simulator's replays use null)",
    )

    admit_min_wait_s: float = Field(
        0.05, ge=0,
        description="the least predicted wait admit_ttft_factor refuses: its bound is max(this, (factor - 1) x the "
        "service TTFT), so in front of servers that answer in a millisecond (engine: openai on a cache hit, a fake "
        "backend) a burst that waits a few ms for a slot is not turned away with 429s",
    )

    @field_validator("admit_ttft_factor")
    @classmethod
    def _admission_needs_queue(cls, v: object, info: ValidationInfo) -> object:
        if not info.data.get("enabled", True) and v is not None and v != cls.model_fields["admit_ttft_factor"].default:
            raise ValueError("scheduler.admit_ttft_factor acts only with scheduler.enabled: true; enable the holding "
                             "queue or remove the field")
        return v

    @field_validator("prefills_in_flight", "overload_prefills_in_flight")
    @classmethod
    def _gate_needs_queue(cls, v: int | None, info: ValidationInfo) -> int | None:
        name = info.field_name
        assert name is not None
        if v is not None and v != cls.model_fields[name].default and not info.data.get("enabled", True):
            raise ValueError(f"scheduler.{name} acts only with scheduler.enabled: true (the gate holds requests in "
                             "the holding queue); enable it or remove the field")
        return v

    @model_validator(mode="after")
    def _program_hold_needs_a_wait_bound(self) -> SchedulerConfig:
        if not self.hold_admitted_programs and (not self.enabled or (self.max_queue_delay_s is None
                                                                     and self.admit_ttft_factor is None)):
            raise ValueError("scheduler.hold_admitted_programs: false acts only with scheduler.enabled: true and a "
                             "wait bound (max_queue_delay_s or admit_ttft_factor); remove the field or set them")
        return self

    @field_validator(*_KNOB_NEEDS)
    @classmethod
    def _knob_needs_its_feature(cls, v: float, info: ValidationInfo) -> float:
        name = info.field_name
        assert name is not None
        feature = _KNOB_NEEDS[name]
        if v != cls.model_fields[name].default and (
                not info.data.get("enabled", True) or info.data.get(feature) is None):
            raise ValueError(f"scheduler.{name} acts only with scheduler.enabled: true and scheduler.{feature} set; "
                             "remove the field or turn them on")
        return v
