"""Self-tuning cost weights (``routing.autotune``) in the simulator: default weights, the best of a small
grid, and the tuner starting from the defaults, on the very same requests.

Workload (``shared_prefix`` generator, seeded): Poisson arrivals of requests sharing one of ``--groups``
4,096-token prefixes (few groups: hot prefixes, so how fast the cache credit decays with a worker's
backlog, i.e. hit versus load, matters), a unique 256-1,024-token suffix, 32-128 output tokens, on 8
simulated workers. Two timings: the default (Dynamo mocker's polynomial) and prefill 4x slower (its
coefficients x 4), where the hand-set weights are not the best.

The grid: ``credit_load_scale`` x ``contention``. The tuner's arm runs with ``routing.autotune`` on from
the default weights (knobs ``--window``, ``--switch-every``, ``--z``, ``--step``, ``--min-step``,
``--pool-trials``, ``--settle-requests``; the row shows the weights it kept at the end); a second tuner
arm runs without rests between rounds of trials (``settle_requests`` 0). The gain recovered =
(default - tuner) / (default - best) on mean TTFT.

Run: ``python bench/autotune.py [--requests N] [--rate R] [--window W] [--z Z]`` (a few minutes).
"""

from __future__ import annotations

import argparse
import time

from _common import print_table

from thunderagent.config import Config, Policy
from thunderagent.config.autotune import AutotuneConfig
from thunderagent.sim.driver import Simulator
from thunderagent.sim.generators import shared_prefix

WORKERS = 8
GRID_SCALE = (0.5, 1.0, 2.0, 4.0, 16.0)
GRID_CONTENTION = (0.25, 1.0, 4.0)


def node_with(prefill_x: float):
    node = Config().execution_group.nodes[0]
    a, b, c = node.timing.prefill_coeffs
    return node.model_copy(update={"timing": node.timing.model_copy(update={
        "prefill_coeffs": (a * prefill_x, b * prefill_x, c * prefill_x)})})


def run(reqs: list, prefill_x: float, scale: float, contention: float, tune: AutotuneConfig | None = None):
    routing = Config().routing
    routing = routing.model_copy(update={"weights": routing.weights.model_copy(update={
        "credit_load_scale": scale, "contention": contention})})
    if tune is not None:
        routing = routing.model_validate({**routing.model_dump(), "autotune": tune.model_dump()})
    sim = Simulator(node_with(prefill_x), routing, WORKERS, Policy.kv_aware, seed=0)
    out = sim.run(reqs, 1.0)
    return out.result, sim.tuner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rate", type=float, default=30.0, help="requests per second")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--window", type=int, default=1000, help="routing.autotune.window")
    ap.add_argument("--switch-every", type=int, default=25, help="routing.autotune.switch_every")
    ap.add_argument("--z", type=float, default=2.0, help="routing.autotune.z")
    ap.add_argument("--step", type=float, default=8.0, help="routing.autotune.step (the first, coarse step)")
    ap.add_argument("--min-step", type=float, default=2.0, help="routing.autotune.min_step")
    ap.add_argument("--pool-trials", type=int, default=4, help="routing.autotune.pool_trials")
    ap.add_argument("--settle-requests", type=int, default=1000, help="routing.autotune.settle_requests (the "
                    "tuner also runs once with 0: trials without rests)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="print every revert too, not only the keeps")
    ap.add_argument("--timings", default="4,1", help="prefill slow-down factors to run (comma-separated)")
    args = ap.parse_args()
    reqs = shared_prefix(args.groups, 4096, (256, 1024), args.requests, args.rate, (32, 128), seed=args.seed)
    tune = AutotuneConfig(enabled=True, window=args.window, min_samples=min(50, args.window), z=args.z,
                          switch_every=args.switch_every, step=args.step, min_step=args.min_step,
                          pool_trials=args.pool_trials, settle_requests=args.settle_requests,
                          settle_max_requests=max(32000, args.settle_requests),
                          log_steps=100_000)  # every step, for the summary below (a server keeps the newest 32)
    restless = tune.model_copy(update={"settle_requests": 0})
    summary = []
    for prefill_x in (float(x) for x in args.timings.split(",")):
        t0 = time.perf_counter()
        grid = {(s, c): run(reqs, prefill_x, s, c)[0] for s in GRID_SCALE for c in GRID_CONTENTION}
        default = grid[(4.0, 1.0)]
        best_key = min(grid, key=lambda k: grid[k].ttft_ms.mean)
        best = grid[best_key]
        tuned, tuner = run(reqs, prefill_x, 4.0, 1.0, tune)
        assert tuner is not None
        arms = [("default (4, 1)", default), (f"grid best {best_key}", best),
                (f"tuner -> ({tuner.kept.credit_load_scale:g}, {tuner.kept.contention:g})", tuned)]
        if args.settle_requests:
            plain, plain_tuner = run(reqs, prefill_x, 4.0, 1.0, restless)
            assert plain_tuner is not None
            kept = plain_tuner.kept
            arms.append((f"tuner, no rests -> ({kept.credit_load_scale:g}, {kept.contention:g})", plain))
        rows = []
        for name, r in arms:
            rows.append([name, f"{r.ttft_ms.mean:.1f}", f"{r.ttft_ms.p50:.1f}", f"{r.ttft_ms.p99:.1f}",
                         f"{r.prefix_reuse:.3f}", f"{default.ttft_ms.mean / r.ttft_ms.mean:.3f}"])
        print_table(f"prefill x{prefill_x:g} ({time.perf_counter() - t0:.0f} s)",
                    ["weights (credit_load_scale, contention)", "TTFT mean ms", "p50", "p99", "reuse",
                     "default/this (mean)"], rows)
        gain = default.ttft_ms.mean - best.ttft_ms.mean
        got = default.ttft_ms.mean - tuned.ttft_ms.mean
        acts = [s.action for s in tuner.steps]
        print(f"tuner steps: {len(acts)} (try {acts.count('try')}, keep {acts.count('keep')}, "
              f"revert {acts.count('revert')}, hold {acts.count('hold')})")
        for s in tuner.steps:
            if s.action == "keep" or (s.action == "revert" and args.verbose):
                print(f"  at {s.at:.0f} s: {s.action} {s.param} {s.old:g}->{s.new:g}: {s.reason}")
        plain_got = default.ttft_ms.mean - plain.ttft_ms.mean if args.settle_requests else None
        summary.append((prefill_x, gain, got, plain_got))
    for prefill_x, gain, got, plain_got in summary:
        share = f"{got / gain:.0%} of it" if gain > 0 else "(grid gains nothing)"
        without = "" if plain_got is None else f" (without rests {plain_got:.1f} ms" + (
            f", {plain_got / gain:.0%})" if gain > 0 else ")")
        print(f"prefill x{prefill_x:g}: grid best gains {gain:.1f} ms mean TTFT over default; tuner gains "
              f"{got:.1f} ms, {share}{without}")

if __name__ == "__main__":
    main()
