"""A replay's per-request records and the :class:`RunResult` summed up from them.

Kept apart from the event loop (``sim/driver.py``): the driver fills one :class:`Track` per request;
:func:`summarize` turns the tracks and the engines' counters into the JSON-shaped result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from thunderagent.config import Policy
from thunderagent.engine.accounting import TokenAccounting
from thunderagent.engine.preemption import PreemptKnobs
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.sim.migrate import MigrationSim
from thunderagent.sim.pd import PdSim
from thunderagent.sim.results import Dist, RunResult


@dataclass(slots=True)
class Track:
    """One request of a replay, as the driver saw it (virtual seconds)."""

    arrival: float
    input_length: int
    best_known: int
    worker: int  # -1 while held in the scheduler
    priority: int = 0
    queue_wait: float = 0.0
    first: float = -1.0
    last: float = -1.0
    end: float = -1.0  # finish time (last output; a rejected request's too)
    tokens: int = 0
    cached: int = 0
    done: bool = False
    program: str | None = None  # its agent program, with pacing on


class Replay(Protocol):
    """What :func:`summarize` reads off the simulator."""

    policy: Policy
    engines: list[SimulatedEngine]
    accounts: list[TokenAccounting]
    preempt: PreemptKnobs | None
    dispatcher: Dispatcher
    pd: PdSim | None
    mig: MigrationSim | None
    kv_event_blocks: int
    refused: int


def summarize(sim: Replay, tracks: dict[str, Track], wall_s: float, decision_ns: Sequence[int]) -> RunResult:
    """The run's result. ``decision_ns``: the wall time of each routing decision (the driver's clock:
    prompt hashing, the scheduler's admission and the router; not the simulated engines)."""
    itl: dict[float, int] = {}
    for a in sim.accounts:
        a.merge_into(itl)
    done = [t for t in tracks.values() if t.done]
    ttft = [(t.first - t.arrival) * 1e3 for t in done if t.first >= 0]
    e2e = [((t.last if t.last >= 0 else t.first) - t.arrival) * 1e3 for t in done if t.first >= 0]
    prompt = sum(t.input_length for t in done)
    cached = sum(t.cached for t in done)
    if sim.pd is not None:  # KV moved from a prefill worker was computed there: not a cache hit
        cached -= sum(sim.pd.moved.get(rid, 0) for rid, t in tracks.items() if t.done)
    recompute = sum(max(0, t.best_known - t.cached) for t in done)
    duration = max(0.0, max((t.last for t in done), default=0.0))  # (-1: every request ended without a token)
    engines = sim.engines
    return RunResult(
        system="thunderagent",
        policy=sim.policy.value,
        requests=len(done),
        ttft_ms=Dist.of(ttft),
        itl_ms=Dist.of_counts(itl),
        e2e_ms=Dist.of(e2e),
        prefix_reuse=cached / prompt if prompt else 0.0,
        prefill_recompute_rate=recompute / prompt if prompt else 0.0,
        throughput_rps=len(done) / duration if duration > 0 else 0.0,
        wall_s=wall_s,
        extra={
            "incomplete_requests": len(tracks) - len(done),
            # ended without a token: refused by the engine (longer than its KV cache) or by the router
            # (``refused_requests``); only when some were, so results of runs without any keep their shape
            **({"rejected_requests": len(done) - len(ttft)} if len(ttft) < len(done) else {}),
            **({"refused_requests": sim.refused} if sim.refused else {}),
            "prompt_tokens": prompt,
            "recomputed_prompt_tokens": prompt - cached,  # prompt tokens not served from cache
            "preemptions": sum(e.preemptions for e in engines),
            "computed_prefill_tokens": sum(e.prefill_tokens for e in engines),  # engines' own count
            # only with routing.preempt_enabled: results of runs without it keep their shape
            **({"priority_preemptions": sum(e.priority_preemptions for e in engines)}
               if sim.preempt is not None else {}),
            "duration_s": duration,
            "utilization": (sum(e.busy_ns for e in engines) / 1e9 / (duration * len(engines))
                            if duration > 0 else 0.0),
            # blocks named by the KV events the index took (stored + removed): the event load one
            # frontend replica must ingest to hold this fleet's index
            "kv_event_blocks": sim.kv_event_blocks,
            **_scheduler_extra(sim, done, duration),
            **({"grouping": dict(g.stats)} if (g := sim.dispatcher.grouper) is not None else {}),
            **({"pd": sim.pd.stats()} if sim.pd is not None else {}),
            **({"migration": sim.mig.stats()} if sim.mig is not None else {}),
        },
        decision_us=Dist.of([ns / 1e3 for ns in decision_ns]) if decision_ns else None,
    )


def _pacing_extra(sim: Replay, duration: float) -> dict[str, object]:
    """With program pacing on: pauses, resumes and pause cycles per program per 10 minutes."""
    pacer = sim.dispatcher.pacer
    if pacer is None:
        return {}
    cycles = [p.pause_cycles for p in sim.dispatcher.programs]
    per10 = 600.0 / duration if duration > 0 else 0.0
    return {"pacing": {
        "pauses": pacer.pauses, "resumes": pacer.resumes, "forced_resumes": pacer.forced_resumes,
        "pause_cycles_per_program_per_10min": {"mean": sum(cycles) / len(cycles) * per10 if cycles else 0.0,
                                               "max": max(cycles, default=0) * per10},
    }}


def _scheduler_extra(sim: Replay, done: list[Track], duration: float) -> dict[str, object]:
    """With the scheduler on: queue wait and TTFT per priority tier (ms)."""
    if sim.dispatcher.queue is None:
        return _pacing_extra(sim, duration)
    by_tier: dict[int, list[float]] = {}
    for t in done:
        if t.first >= 0:
            by_tier.setdefault(t.priority, []).append((t.first - t.arrival) * 1e3)
    waits = Dist.of([t.queue_wait * 1e3 for t in done])
    return {
        "queue_wait_ms": {"mean": waits.mean, "p99": waits.p99, "max": max((t.queue_wait * 1e3 for t in done),
                                                                             default=0.0)},
        "ttft_ms_by_priority": {str(k): {"n": len(v), "mean": Dist.of(v).mean, "p99": Dist.of(v).p99}
                                for k, v in sorted(by_tier.items())},
        "held_at_end": sim.dispatcher.held(),
        "affinity_dispatches": sim.dispatcher.affinity_dispatches,
        **_pacing_extra(sim, duration),
    }
