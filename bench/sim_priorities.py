"""Priorities at 90 % load, in the simulator: the scheduler's holding queue against FCFS, same requests.

Workload (``shared_prefix`` generator, seeded): Poisson arrivals of independent requests (a 1,024-token
prefix drawn from 500 groups, so little sharing, plus a 256-3,072-token unique suffix; 32-256 output
tokens) on 8 simulated workers; 20 % of them, drawn at random, carry priority 1. The arrival rate is
90 % of the fleet's capacity, measured first as its completion rate when flooded with the same requests.

Arms, on the very same requests:
- **fcfs**: no scheduler, priorities stripped (arrival order everywhere);
- **engine only**: no scheduler, priorities passed to the engines (they order their own waiting queues);
- **scheduler**: the holding queue on (priority tiers, short first with ageing, ``max_wait_s``), priorities set.

Targets (issue 9): high-priority TTFT p99 >= 1.5x better than FCFS, low-priority TTFT mean <= 1.25x
worse, and no request held past ``max_wait_s``.

Run: ``python bench/sim_priorities.py [--requests N] [--seed S]`` (about a minute with the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import random

from _common import print_table

from thunderagent.config import Config, Policy, SchedulerConfig
from thunderagent.sim.driver import Simulator
from thunderagent.sim.generators import shared_prefix
from thunderagent.sim.results import Dist

WORKERS = 8
TARGET_UTILIZATION = 0.9
MAX_WAIT_S = 30.0


def workload(n: int, rate: float, seed: int) -> list:
    reqs = shared_prefix(500, 1024, (256, 3072), n, rate, (32, 256), seed=seed)
    rng = random.Random(seed + 1)
    return [dataclasses.replace(r, priority=1 if rng.random() < 0.2 else 0) for r in reqs]


def run(reqs: list, scheduler: SchedulerConfig | None, keep_priority: bool, seed: int):
    cfg = Config()
    node = cfg.execution_group.nodes[0]
    if not keep_priority:
        reqs = [dataclasses.replace(r, priority=0) for r in reqs]
    sim = Simulator(node, cfg.routing, WORKERS, Policy.kv_aware, seed=seed, scheduler=scheduler)
    return sim.run(reqs, 1.0)


def calibrate(n: int, seed: int) -> tuple[float, float]:
    """The fleet's capacity in requests/s (its completion rate when flooded), and 90 % of it."""
    flood = run(workload(n, 1000.0, seed), None, False, seed)
    capacity = flood.result.throughput_rps
    return TARGET_UTILIZATION * capacity, capacity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rate, capacity = calibrate(args.requests, args.seed)
    reqs = workload(args.requests, rate, args.seed)
    sched = SchedulerConfig(enabled=True, max_wait_s=MAX_WAIT_S, max_queued=1_000_000, max_queued_per_key=1_000_000)
    arms = {
        "fcfs": run(reqs, None, False, args.seed),
        "engine only": run(reqs, None, True, args.seed),
        "scheduler": run(reqs, sched, True, args.seed),
    }
    rows = []
    per = {}
    for name, out in arms.items():
        tiers = per[name] = _tiers(out, reqs)
        extra = out.result.extra
        wait = extra.get("queue_wait_ms", {}).get("max", 0.0)
        rows.append((name, f"{tiers[1].p99:,.0f}", f"{tiers[1].mean:,.0f}", f"{tiers[0].mean:,.0f}",
                     f"{tiers[0].p99:,.0f}", f"{out.result.ttft_ms.mean:,.0f}", f"{wait / 1e3:,.1f}",
                     out.result.requests))
    print(f"{args.requests} requests at {rate:.2f} req/s on {WORKERS} workers: 90 % of their capacity "
          f"({capacity:.2f} req/s, measured flooded)")
    print_table("TTFT ms by priority (high = 1, low = 0)",
                ("arm", "high p99", "high mean", "low mean", "low p99", "all mean", "max held s", "done"),
                rows)
    f, s = per["fcfs"], per["scheduler"]
    print(f"high-priority p99 TTFT: {f[1].p99 / s[1].p99:.2f}x better than FCFS (target >= 1.5x)")
    print(f"low-priority mean TTFT: {s[0].mean / f[0].mean:.2f}x of FCFS (target <= 1.25x)")
    held = arms["scheduler"].result.extra["queue_wait_ms"]["max"] / 1e3
    print(f"longest hold in the scheduler: {held:.1f} s (max_wait_s {MAX_WAIT_S:g}: "
          f"{'met' if held <= MAX_WAIT_S else 'MISSED'})")


def _tiers(out, reqs: list) -> dict[int, Dist]:
    """TTFT per priority of the *original* requests (the FCFS arm ran them with priorities stripped)."""
    tiers: dict[int, list[float]] = {}
    for r in reqs:
        t = out.ttft_by_id.get(r.request_id)
        if t is not None:
            tiers.setdefault(r.priority, []).append(t)
    return {k: Dist.of(v) for k, v in tiers.items()}


if __name__ == "__main__":
    main()
