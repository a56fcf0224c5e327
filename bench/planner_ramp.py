"""Scaling a fleet through a load ramp (issue 13, item 5): fixed fleets of several sizes, add-all-at-once,
and step-wise (the scaling planner, ``control/planner.py``, acting in the simulator, ``sim/scaling.py``).

Workload (``sim.generators.ramp``): shared-prefix requests whose Poisson rate ramps up from ``--base-rate`` to
``--peak-rate``, holds, and ramps down. Workers start cold after ``--planner-startup-s`` and leave drained.

Columns: TTFT p50/p99 (ms), worker-minutes paid (a started worker is paid from the planner's +1, its start-up
included, until it drained or the run ended), the request hit rate (requests that reused cached prompt tokens)
and the token reuse (cached prompt tokens / prompt tokens), both over the requests that arrived during the
scale-up (the ramp up), and the ratios against the best fixed fleet (the lowest TTFT p99) measured in the
same run.

    .venv/bin/python bench/planner_ramp.py            # the README's table (a few minutes)
    .venv/bin/python bench/planner_ramp.py --quick    # seconds
    .venv/bin/python bench/planner_ramp.py --target-util 0.8 --service-rate 0.75   # + forecast sizing rows
    .venv/bin/python bench/planner_ramp.py --fixed 8 --misses 150   # + why requests missed, per 150 s
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table  # noqa: E402

from thunderagent.config import (  # noqa: E402
    NodeConfig,
    PlannerConfig,
    Policy,
    RoutingConfig,
    SchedulerConfig,
    TimingConfig,
)
from thunderagent.sim.generators import ramp  # noqa: E402
from thunderagent.sim.scaling import TICK, ScalingResult, ScalingSim  # noqa: E402
from thunderagent.sim.summary import Track  # noqa: E402


class MissSim(ScalingSim):
    """``--misses``: each request that reused nothing, by cause. ``new``: its prefix's first request anywhere
    (compulsory); ``evicted``: no worker held any of its blocks when it was routed, though an earlier request had
    its prefix (the fleet's cache was too small to keep it); ``spilled``: some worker held part of it, the router
    sent it elsewhere (load outweighed the cache); ``in flight``: sent where its prefix was predicted, which was
    not stored yet."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.first_seen: set[int] = set()
        self.kind: dict[str, str] = {}
        self.predicted: dict[str, int] = {}
        self.by_id: dict[str, Track] = {}

    def _place(self, d, now, tracks):  # type: ignore[no-untyped-def]
        self.predicted[d.request.request_id] = d.predicted_tokens
        return super()._place(d, now, tracks)

    def _dispatch(self, tr, now, tracks):  # type: ignore[no-untyped-def]
        i = super()._dispatch(tr, now, tracks)
        if not tr.request_id.startswith(TICK) and tr.block_ids:
            self.kind[tr.request_id] = "new" if tr.block_ids[0] not in self.first_seen else ""
            self.first_seen.add(tr.block_ids[0])
            self.by_id[tr.request_id] = tracks[tr.request_id]
        return i

    def misses(self, end_s: float, bucket_s: float) -> list[tuple[float, int, dict[str, int]]]:
        """(bucket start, requests, misses by cause) of the requests arriving before ``end_s``."""
        out: dict[int, tuple[int, dict[str, int]]] = {}
        for rid, t in self.by_id.items():
            if not t.done or t.arrival >= end_s:
                continue
            n, causes = out.setdefault(int(t.arrival // bucket_s), (0, {}))
            out[int(t.arrival // bucket_s)] = (n + 1, causes)
            if t.cached == 0:
                cause = self.kind.get(rid) or ("evicted" if t.best_known == 0 else
                                                "in flight" if self.predicted.get(rid, 0) > 0 else "spilled")
                causes[cause] = causes.get(cause, 0) + 1
        return [(k * bucket_s, n, c) for k, (n, c) in sorted(out.items())]


def planner_config(a: argparse.Namespace, forecast: bool) -> PlannerConfig:
    fc: dict[str, float] = {}
    if forecast:
        lead = a.planner_startup_s + a.interval_s if a.lead_s is None else a.lead_s
        fc = {"target_utilization": a.target_util, "forecast_lead_s": lead, "trend_window_s": a.trend_window_s,
              "service_rate_per_worker": a.service_rate}
    return PlannerConfig(enabled=True, interval_s=a.interval_s, window_s=a.window_s, cooldown_s=a.cooldown_s,
                         min_workers=a.min_workers, max_workers=a.max_workers, warm_requests=a.warm_requests,
                         up_ttft_s=a.up_ttft_s, down_ttft_s=a.down_ttft_s, up_kv_usage=a.up_kv,
                         down_kv_usage=a.down_kv, up_queue_per_worker=a.up_queue, ttft_quantile=a.ttft_quantile, **fc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short ramp (the e2e test's size)")
    ap.add_argument("--groups", type=int, default=96)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--base-rate", type=float, default=0.5)
    ap.add_argument("--peak-rate", type=float, default=6.0)
    ap.add_argument("--ramp-up-s", type=float, default=1800.0)
    ap.add_argument("--hold-s", type=float, default=300.0)
    ap.add_argument("--ramp-down-s", type=float, default=1800.0)
    ap.add_argument("--kv-blocks", type=int, default=2048)
    ap.add_argument("--engine-speed", type=float, default=0.05,
                    help="the simulated engine's timing.speedup (0.05: 20x slower passes, a big model: few "
                    "requests fill a worker, so the simulation stays short)")
    ap.add_argument("--fixed", default="4,6,8", help="fixed fleet sizes, comma-separated")
    ap.add_argument("--min-workers", type=int, default=1)
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--planner-startup-s", type=float, default=30.0)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--cooldown-s", type=float, default=60.0)
    ap.add_argument("--warm-requests", type=int, default=20)
    ap.add_argument("--up-ttft-s", type=float, default=1.7)
    ap.add_argument("--down-ttft-s", type=float, default=1.2)
    ap.add_argument("--ttft-quantile", type=float, default=None, help="planner.ttft_quantile (0.9: the TTFT "
                    "thresholds bound the window's p90; default: the mean)")
    ap.add_argument("--up-kv", type=float, default=0.5)
    ap.add_argument("--down-kv", type=float, default=0.3)
    ap.add_argument("--up-queue", type=float, default=1.0)
    ap.add_argument("--target-util", type=float, default=0.0,
                    help="> 0: also run the planner with forecast sizing at this target utilization "
                    "(planner.target_utilization); add-all-at-once then uses it too")
    ap.add_argument("--lead-s", type=float, default=None, help="planner.forecast_lead_s (default: start-up + "
                    "one look interval)")
    ap.add_argument("--trend-window-s", type=float, default=300.0)
    ap.add_argument("--service-rate", type=float, default=None, help="planner.service_rate_per_worker (req/s a "
                    "worker serves at full load, used until measured)")
    ap.add_argument("--no-plain", action="store_true", help="skip the step-wise planner without forecast")
    ap.add_argument("--scheduler", action="store_true", help="every fleet behind the holding queue at its defaults "
                    "(serve's default): requests wait there, not in the engines, and the wait counts in TTFT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reasons", action="store_true", help="print each step's reasons")
    ap.add_argument("--misses", type=float, default=0.0, metavar="S", help="> 0: also print, per S seconds of the "
                    "scale-up, the requests that reused nothing by cause (new prefix, evicted, spilled, in flight)")
    a = ap.parse_args(argv)
    if a.quick:
        a.ramp_up_s, a.hold_s, a.ramp_down_s, a.peak_rate, a.fixed, a.max_workers = 240.0, 60.0, 240.0, 3.0, "2,4", 4
        a.window_s, a.cooldown_s, a.planner_startup_s = 20.0, 30.0, 15.0
    node = NodeConfig(kv_blocks=a.kv_blocks, timing=TimingConfig(speedup=a.engine_speed))
    routing = RoutingConfig()
    reqs = ramp(a.groups, a.prefix_tokens, a.suffix_tokens, a.peak_rate, base_rate=a.base_rate,
                ramp_up_s=a.ramp_up_s, hold_s=a.hold_s, ramp_down_s=a.ramp_down_s, output_tokens=a.output_tokens,
                seed=a.seed, block_size=node.block_size)
    forecast = a.target_util > 0
    pc, fc = planner_config(a, False), planner_config(a, forecast)  # add-all runs with the forecast when it is on
    runs: list[tuple[str, ScalingResult]] = []
    sched = SchedulerConfig(enabled=True) if a.scheduler else None
    t0 = time.perf_counter()
    for n in (int(x) for x in a.fixed.split(",")):
        sim = ScalingSim(node, routing, Policy.kv_aware, mode="fixed", initial=n, max_workers=n, seed=a.seed,
                         scheduler=sched)
        runs.append((f"fixed {n}", sim.replay(reqs, a.ramp_up_s)))
    variants = [("all", "add-all-at-once", fc)]
    if not (forecast and a.no_plain):
        variants.append(("step", "step-wise (planner)", pc))
    if forecast:
        variants.append(("step", "step-wise + forecast", fc))
    missed: list[tuple[str, MissSim]] = []
    for mode, label, cfg in variants:
        sim = MissSim(node, routing, Policy.kv_aware, mode=mode, initial=a.min_workers, max_workers=a.max_workers,
                      planner=cfg, startup_s=a.planner_startup_s, seed=a.seed, scheduler=sched)
        runs.append((label, sim.replay(reqs, a.ramp_up_s)))
        missed.append((label, sim))
    best_label, best = min((r for r in runs if r[0].startswith("fixed")), key=lambda r: r[1].ttft_ms.p99)
    rows = []
    for label, r in runs:
        rows.append([label, f"{r.ttft_ms.p50:.0f}", f"{r.ttft_ms.p99:.0f}", f"{r.worker_minutes:.1f}",
                     f"{r.scale_up_hit_rate:.1%}", f"{r.scale_up_reuse:.1%}",
                     "-" if r.join_hit_rate != r.join_hit_rate else f"{r.join_hit_rate:.1%}", r.peak_workers,
                     f"{r.ttft_ms.p99 / best.ttft_ms.p99:.2f}", f"{r.worker_minutes / best.worker_minutes:.2f}"])
    print(f"{len(reqs)} requests, ramp {a.base_rate:g}->{a.peak_rate:g}->{a.base_rate:g} req/s over "
          f"{a.ramp_up_s:.0f}+{a.hold_s:.0f}+{a.ramp_down_s:.0f} s, start-up {a.planner_startup_s:.0f} s; "
          f"best fixed fleet: {best_label}")
    print_table("Scaling through a ramp (simulated)", ["fleet", "TTFT p50", "TTFT p99", "worker-min",
                "hit (up)", "reuse (up)", "hit (joins)", "peak", "p99/best", "w-min/best"], rows)
    for label, r in runs:
        if r.steps:
            steps = ", ".join(f"({t:.0f}, {d:+d}, {n})" for t, d, n in r.steps)
            print(f"{label} steps (t s, delta, workers up): {steps}")
    if a.reasons:
        for label, r in runs:
            for (t, d, _), why in zip(r.steps, r.reasons):
                print(f"  {label} {t:.0f}s {d:+d}: {'; '.join(why)}")
    if a.misses > 0:
        for label, msim in missed:
            print(f"{label}: requests that reused nothing, by cause, per {a.misses:g} s of the scale-up")
            total: dict[str, int] = {}
            for start, n, causes in msim.misses(a.ramp_up_s, a.misses):
                print(f"  {start:6.0f} s  {n:5d} requests  " + "  ".join(f"{k} {v}" for k, v in sorted(causes.items())))
                for k, v in causes.items():
                    total[k] = total.get(k, 0) + v
            print("  all: " + "  ".join(f"{k} {v}" for k, v in sorted(total.items())))
    print(f"wall {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
