"""A burst of siblings on an idle fleet: prefix grouping and coalescing against plain kv_aware routing.

Workload: ``--requests`` (32) requests sharing a ``--prefix`` (4,096)-token prefix, each with its own
``--suffix``-token tail, arriving uniformly at random within ``--spread-ms`` (50 ms) on an idle fleet
of 4 simulated workers (default engine settings). Arms, same requests: ``off`` (window and coalescing
off: ``scheduler.grouping`` disabled) and ``on`` (``enabled`` and ``coalesce``).

Per arm: workers used, prefill tokens the engines computed (their own count: new prompt tokens per
pass, cache hits excluded), that against ``prefix x workers used + the suffixes`` (target <= 1.1),
TTFT p50 and mean, and the p50 ratio off / on (target >= 1.5).

Run: ``python bench/burst.py [--seeds 1 2] [--suffix 256 1024]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from _common import print_table

from thunderagent.config import GroupingConfig, NodeConfig, Policy, RoutingConfig, SchedulerConfig
from thunderagent.sim.driver import Simulator
from thunderagent.sim.traces import TraceRequest

BLOCK = 64
WORKERS = 4


def burst(seed: int, n: int, prefix: int, suffix: int, spread_s: float) -> list[TraceRequest]:
    """``n`` requests: one shared ``prefix`` (whole blocks) + a unique ``suffix`` each, arrivals uniform
    within ``spread_s``."""
    rng = random.Random(seed)
    shared = list(range(-(-prefix // BLOCK)))
    per = -(-suffix // BLOCK)
    reqs = []
    for i in range(n):
        tail = list(range(10_000 + i * per, 10_000 + (i + 1) * per))
        reqs.append(TraceRequest(f"burst-{i}", rng.uniform(0.0, spread_s), prefix + suffix, 64, shared + tail, BLOCK))
    reqs.sort(key=lambda r: r.arrival_s)
    base = reqs[0].arrival_s
    for r in reqs:
        r.arrival_s -= base
    return reqs


def run(reqs: list[TraceRequest], on: bool, seed: int) -> dict[str, float]:
    grouping = GroupingConfig(enabled=on, coalesce=on)
    sim = Simulator(NodeConfig(), RoutingConfig(seed=seed), WORKERS, Policy.kv_aware, seed=seed,
                    scheduler=SchedulerConfig(enabled=False, grouping=grouping))
    out = sim.run(reqs)
    extra = out.result.extra
    return {"used": sum(1 for c in out.requests_per_worker if c), "computed": float(extra["computed_prefill_tokens"]),
            "p50": statistics.median(out.ttft_ms), "mean": statistics.fmean(out.ttft_ms),
            "done": out.result.requests}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--suffix", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--spread-ms", type=float, default=50.0)
    args = ap.parse_args(argv)
    rows = []
    ok = True
    for suffix in args.suffix:
        for seed in args.seeds:
            reqs = burst(seed, args.requests, args.prefix, suffix, args.spread_ms / 1e3)
            res = {arm: run(reqs, arm == "on", seed) for arm in ("off", "on")}
            for arm, r in res.items():
                bound = args.prefix * r["used"] + args.requests * suffix
                speedup = res["off"]["p50"] / r["p50"]
                ok &= r["done"] == args.requests
                rows.append([f"{suffix}/{seed}", arm, r["used"], int(r["computed"]), bound, r["computed"] / bound,
                             r["p50"], r["mean"], speedup])
    print_table(f"burst: {args.requests} requests, {args.prefix}-token shared prefix, within {args.spread_ms:g} ms, "
                f"{WORKERS} idle workers (targets: computed/bound <= 1.1, p50 off/on >= 1.5)",
                ["suffix/seed", "arm", "workers", "prefill computed", "bound", "computed/bound", "TTFT p50 ms",
                 "TTFT mean ms", "p50 off/on"], rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
