"""Agent programs in a closed loop under KV pressure: program pacing against plain kv_aware routing.

Workload: the kv-cache-tester agentic-coding traces (a folder of ``trace_NNNN.json``; default
``../shared/traces/kv-cache-tester``), one program per session. Every program starts at t = 0 (they
arrive together) and issues its next request once its previous one finished plus its recorded think
time, capped at ``--think-cap`` seconds (the traces record human idle time too, up to hours; between
tool-driven turns it is seconds). The run stops at ``--horizon`` virtual seconds; steps/min counts
the requests finished by then.

Fleet: 8 simulated workers. Their KV is sized from the programs' **live context**, the sum over
programs of their mean prompt length (what a program holds on average while it runs): ``fits`` gives
every worker its share of the sum of the programs' *peak* contexts (nothing needs evicting), ``2x``
and ``4x`` make the live context twice and four times the fleet's KV.

Arms, same requests, same fleet: plain ``kv_aware``; ``+pacing paper`` (the ThunderAgent paper's
accounting: every program's tokens in full; resumed on the worker with the most room); ``+pacing
ours`` (a prefix shared by several programs on a worker counted once; a resumed program goes where the
index holds its blocks when there is room); ``+pacing ours, idle cached`` (and a worker with nothing to
run resumes the paused program holding most blocks there, not the head of the order). Per arm:
steps/min (and its ratio to kv_aware), prefix reuse, recomputed prompt tokens (prompt tokens not served from cache), Jain's fairness index of
steps per program, pause cycles per program per 10 minutes, the longest gap between two steps of a
program, and programs that completed no step.

Targets (issue 9): steps/min >= 1.5x kv_aware at 4x, >= 1.2x at 2x, >= 0.97x when everything fits;
recomputed tokens <= 1/3 of kv_aware's; <= 2 pause cycles per program per 10 minutes; Jain no more
than 0.05 below kv_aware's.

Run: ``python bench/agentic_pacing.py [--traces DIR] [--horizon S] [--think-cap S] [--ratio fits 2 4]
[--arms ...] [--pacing KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from _common import knob, print_table

from pydantic import ValidationError
from thunderagent.config import (Config, IdleResume, PacingAccounting, PacingConfig, Policy, ResumePlacement,
                                 SchedulerConfig)
from thunderagent.sim.driver import Simulator
from thunderagent.sim.traces import TraceRequest, load_traces

WORKERS = 8
BLOCK = 64
DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "kv-cache-tester"


def programs(requests: list[TraceRequest], think_cap: float) -> list[TraceRequest]:
    """Each session rebased to start at t = 0, think times capped."""
    first: dict[str, float] = {}
    for r in requests:
        if r.session is not None:
            first[r.session] = min(first.get(r.session, math.inf), r.arrival_s)
    out = []
    for r in requests:
        think = r.think_s if r.think_s is None else min(r.think_s, think_cap)
        out.append(dataclasses.replace(r, arrival_s=r.arrival_s - first.get(r.session or "", 0.0), think_s=think))
    return out


def kv_blocks_for(reqs: list[TraceRequest], ratio: str) -> int:
    by: dict[str, list[int]] = defaultdict(list)
    for r in reqs:
        by[r.session or r.request_id].append(r.input_length)
    if ratio == "fits":
        return math.ceil(sum(max(v) for v in by.values()) / WORKERS / BLOCK * 1.1)
    live = sum(statistics.mean(v) for v in by.values())
    return math.ceil(live / float(ratio) / WORKERS / BLOCK)


ARMS = ("kv_aware", "pacing paper", "pacing ours", "pacing ours, idle cached")


def arm(name: str, knobs: dict[str, object] | None = None) -> SchedulerConfig:
    """The scheduler config of an arm; ``knobs`` (``--pacing``) go into every pacing arm (validated)."""
    if name == "kv_aware":
        return SchedulerConfig(enabled=False)
    fields: dict[str, object] = {"enabled": True}
    if name == "pacing paper":
        fields.update(accounting=PacingAccounting.paper, placement=ResumePlacement.most_free, work_conserving=False,
                      sticky=True)
    elif name == "pacing ours, idle cached":
        fields.update(idle_resume=IdleResume.cached)
    elif name != "pacing ours":
        raise SystemExit(f"--arms: unknown arm {name!r} (one of {', '.join(ARMS)})")
    try:
        return SchedulerConfig(enabled=False, pacing=PacingConfig(**{**fields, **(knobs or {})}))
    except ValidationError as exc:
        raise SystemExit(f"--pacing: {exc}") from None


def run(reqs: list[TraceRequest], kv_blocks: int, sched: SchedulerConfig, horizon: float) -> dict[str, float]:
    cfg = Config()
    node = cfg.execution_group.nodes[0].model_copy(update={"kv_blocks": kv_blocks, "block_size": BLOCK})
    sim = Simulator(node, cfg.routing, WORKERS, Policy.kv_aware, scheduler=sched)
    out = sim.run(reqs, 1.0, closed_loop=True, horizon_s=horizon)
    x = out.result.extra
    steps: dict[str, list[float]] = defaultdict(list)
    prompt = cached = 0
    for r in reqs:
        a, f = out.times_by_id.get(r.request_id, (math.nan, -1.0))
        if 0 <= f <= horizon:
            steps[r.session or r.request_id].append(f)
    sessions = {r.session or r.request_id for r in reqs}
    gaps = [max(b - a for a, b in zip([0.0, *sorted(v)], sorted(v))) for v in steps.values()]
    prompt = out.result.extra.get("prompt_tokens", 0)
    pc = x.get("pacing", {}).get("pause_cycles_per_program_per_10min", {"max": 0.0, "mean": 0.0})
    del cached
    return {
        "steps_per_min": float(x["steps_per_min"]), "reuse": out.result.prefix_reuse,
        "recomputed": float(x.get("recomputed_prompt_tokens", math.nan)), "jain": float(x["jain_fairness_steps"]),
        "pause_max": float(pc["max"]), "pause_mean": float(pc["mean"]), "max_gap_s": max(gaps, default=math.nan),
        "unserved": float(len(sessions) - len(steps)), "prompt": float(prompt),
        "wall_s": out.result.wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--horizon", type=float, default=1200.0, help="virtual seconds simulated")
    ap.add_argument("--think-cap", type=float, default=30.0)
    ap.add_argument("--ratio", nargs="+", default=["fits", "2", "4"], help="live context / fleet KV: fits, 2, 4")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help=f"first is the reference; of {', '.join(ARMS)}")
    ap.add_argument("--pacing", type=knob, nargs="*", default=[], metavar="KEY=VALUE",
                    help="scheduler.pacing fields for every pacing arm (e.g. min_run_s=300)")
    args = ap.parse_args()
    knobs = dict(args.pacing)
    for name in args.arms:
        arm(name, knobs)  # a bad arm or knob fails before the runs
    if not args.traces.exists():
        sys.exit(f"no traces at {args.traces} (the kv-cache-tester folder from ../shared)")
    reqs = programs(load_traces([args.traces]), args.think_cap)
    print(f"{len(reqs):,} requests, {len({r.session for r in reqs})} programs, think capped at {args.think_cap:g} s, "
          f"horizon {args.horizon:g} s, {WORKERS} workers, pacing knobs {knobs or 'none'}")
    ideal = run(reqs, kv_blocks_for(reqs, "fits"), arm("kv_aware"), args.horizon)["steps_per_min"]
    print(f"everything cached (KV fits every program's peak): {ideal:.1f} steps/min, the bound for every arm below")
    for ratio in args.ratio:
        kv = kv_blocks_for(reqs, ratio)
        res = {name: run(reqs, kv, arm(name, knobs), args.horizon) for name in args.arms}
        base = res[args.arms[0]]
        rows = [(name, r["steps_per_min"], r["steps_per_min"] / base["steps_per_min"], r["steps_per_min"] / ideal,
                 f"{r['reuse']:.1%}",
                 r["recomputed"], r["recomputed"] / base["recomputed"] if base["recomputed"] else math.nan,
                 r["jain"], r["pause_mean"], r["pause_max"], r["max_gap_s"], int(r["unserved"]), r["wall_s"])
                for name, r in res.items()]
        print_table(f"live context {ratio}{'' if ratio == 'fits' else 'x'} the fleet's KV ({kv:,} blocks x {BLOCK} "
                    f"tokens per worker)",
                    ("arm", "steps/min", "vs kv_aware", "of bound", "reuse", "recomputed tok", "vs kv_aware", "Jain",
                     "pauses/prog/10min", "max", "max gap s", "unserved", "wall s"), rows)


if __name__ == "__main__":
    main()
