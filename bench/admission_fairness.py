"""Admission fairness: small and large agent programs arriving together on a fleet that fits a third.

Workload (synthetic, seeded): 64 programs arrive at t = 0, half starting with 1,536-token contexts and
half with 8,192 (a 1,024-token system prompt shared by all, then the program's own blocks). Each runs
10 turns in a closed loop: 128-256 output tokens, then a tool call of 2-8 s, then a prompt grown by
its output plus a 256-768-token tool result. 4 simulated workers whose KV together holds a third of the
programs' starting contexts.

Arms, same requests: plain kv_aware (every request routed at once); plain smallest-first, the paper
proxy's admission (its accounting and placement, ``resume_order: smallest``: fewest tokens first, a
program that does not fit is passed over, no ageing: ``max_pause_s`` 1,800 s, the hold bound of
Dynamo's thunderagent_router); and program pacing with the paper's accounting and placement, and with
ours (the defaults). In the last two, new programs wait for room in arrival order, never passed over
by smaller ones.

Per arm: time to first response (from the program's arrival to its first request's last token) p50 and
p99 for each half, the ratio large/small of the p99s, steps/min over the run, and Jain's index of steps
per program. Target (issue 9): large-half p99 <= 3x the small half's, steps/min not below the
smallest-first arm's by more than 5 % (the table gives both ratios: to kv_aware and to smallest-first).

Run: ``python bench/admission_fairness.py [--seed S]`` (about a minute).
"""

from __future__ import annotations

import argparse
import math
import random

from _common import print_table

from thunderagent.config import (Config, PacingAccounting, PacingConfig, Policy, ResumeOrder, ResumePlacement,
                                 SchedulerConfig)
from thunderagent.sim.driver import Simulator
from thunderagent.sim.results import Dist
from thunderagent.sim.traces import TraceRequest

WORKERS = 4
BLOCK = 64
PROGRAMS = 64
TURNS = 10
SYSTEM_BLOCKS = 16  # 1,024 tokens shared by every program
SIZES = (1536, 8192)


def workload(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    out = []
    for p in range(PROGRAMS):
        ctx = SIZES[p % 2]
        base = 1_000_000 * (p + 1)
        for t in range(TURNS):
            blocks = list(range(SYSTEM_BLOCKS)) + [base + i for i in range(-(-ctx // BLOCK) - SYSTEM_BLOCKS)]
            output = rng.randint(128, 256)
            out.append(TraceRequest(f"p{p}:{t}", 0.0, ctx, output, blocks, BLOCK, session=f"p{p}",
                                    think_s=None if t == 0 else rng.uniform(2.0, 8.0)))
            ctx += output + rng.randint(256, 768)
    return out


def run(reqs: list[TraceRequest], sched: SchedulerConfig, kv_blocks: int) -> dict[str, object]:
    cfg = Config()
    node = cfg.execution_group.nodes[0].model_copy(update={"kv_blocks": kv_blocks, "block_size": BLOCK})
    out = Simulator(node, cfg.routing, WORKERS, Policy.kv_aware, scheduler=sched).run(reqs, 1.0, closed_loop=True)
    first = {0: [], 1: []}
    for p in range(PROGRAMS):
        _, fin = out.times_by_id[f"p{p}:0"]
        first[p % 2].append(fin if fin >= 0 else math.inf)
    x = out.result.extra
    return {"small": Dist.of(first[0]), "large": Dist.of(first[1]), "steps": float(x["steps_per_min"]),
            "jain": float(x["jain_fairness_steps"]), "done": out.result.requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reqs = workload(args.seed)
    kv = math.ceil(sum(SIZES) * PROGRAMS / 2 / 3 / WORKERS / BLOCK)
    paper = PacingConfig(enabled=True, accounting=PacingAccounting.paper, placement=ResumePlacement.most_free,
                         work_conserving=False, sticky=True)
    smallest = PacingConfig(enabled=True, accounting=PacingAccounting.paper, placement=ResumePlacement.most_free,
                            work_conserving=False, resume_order=ResumeOrder.smallest, max_pause_s=1800.0,
                            sticky=True)
    arms = {"kv_aware": SchedulerConfig(enabled=False),
            "smallest-first (paper)": SchedulerConfig(enabled=False, pacing=smallest),
            "pacing (paper)": SchedulerConfig(enabled=False, pacing=paper),
            "pacing (ours)": SchedulerConfig(enabled=False, pacing=PacingConfig(enabled=True))}
    res = {name: run(reqs, s, kv) for name, s in arms.items()}
    base, ref = res["kv_aware"], res["smallest-first (paper)"]
    rows = [(name, r["small"].p50, r["small"].p99, r["large"].p50, r["large"].p99,
             r["large"].p99 / r["small"].p99, r["steps"], r["steps"] / base["steps"], r["steps"] / ref["steps"],
             r["jain"], r["done"])
            for name, r in res.items()]
    print(f"{PROGRAMS} programs (half {SIZES[0]:,}, half {SIZES[1]:,} starting tokens) x {TURNS} turns at t = 0, "
          f"{WORKERS} workers x {kv} blocks x {BLOCK} tokens (a third of the starting contexts)")
    print_table("time to first response (s), steps/min", ("arm", "small p50", "small p99", "large p50", "large p99",
                                                         "large/small p99", "steps/min", "vs kv_aware", "vs smallest", "Jain",
                                                         "requests done"), rows)


if __name__ == "__main__":
    main()
