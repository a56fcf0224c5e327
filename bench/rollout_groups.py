"""RL rollout groups under KV pressure: program pacing against plain kv_aware routing (issue 9, item 3b).

Workload (``rollout_groups`` generator, seeded): ``--groups`` groups arrive as a Poisson process; the
``--size`` programs of a group start together on one prompt (a 1,024-token system prompt shared by all +
the group's 4,096-token task), then run ``--steps`` agent steps each (128-512 output tokens, a 128-1,024-token
tool result, a log-normal tool pause with a 2 s median), in a closed loop: a program's next step is sent
its tool pause after its previous response. A training step waits for its whole group, so what counts is
the group's **makespan** (its arrival to its last program's last response) and how long its last program
waited for a first response.

Fleet: 8 simulated workers; ``--load RATE:BLOCKS`` sets the groups' arrival rate (groups/s) and the KV
blocks per worker (64 tokens each), one table per load. Arms, same requests: plain ``kv_aware``; ``pacing ours``
(``scheduler.pacing`` at its defaults: a shared prefix counted once, a resumed program placed where its
blocks are); ``pacing paper`` (the ThunderAgent paper's accounting and placement, no work conservation).

Per arm: group makespan mean / p90 / max (s), the last program's first response after its group arrived
(mean / max, s), program steps per minute over the run's busy span (first arrival to last response),
prefix reuse, recomputed prompt tokens (and their ratio to kv_aware's), pause cycles per program per 10
minutes (mean / max) and the simulator's wall time.

Run: ``python bench/rollout_groups.py [--groups N] [--size N] [--steps N] [--load 0.05:384 --load 0.1:256]``
(about a minute per load here).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict

from _common import print_table
from agentic_pacing import arm  # the arms of the kv-cache-tester bench

from thunderagent.config import Config, Policy, SchedulerConfig
from thunderagent.sim.driver import Simulator
from thunderagent.sim.generators import rollout_groups
from thunderagent.sim.traces import TraceRequest

WORKERS = 8
BLOCK = 64
HORIZON_S = 7200.0  # virtual seconds: every load below finishes well before


def group_of(session: str) -> str:
    return session.rsplit("-", 1)[0]  # rollout-<g>-<m> -> rollout-<g>


def run(reqs: list[TraceRequest], kv_blocks: int, sched: SchedulerConfig) -> dict[str, float]:
    cfg = Config()
    node = cfg.execution_group.nodes[0].model_copy(update={"kv_blocks": kv_blocks, "block_size": BLOCK})
    out = Simulator(node, cfg.routing, WORKERS, Policy.kv_aware, scheduler=sched).run(
        reqs, 1.0, closed_loop=True, horizon_s=HORIZON_S)
    arrival: dict[str, float] = {}
    last: dict[str, float] = defaultdict(float)
    first_of: dict[str, float] = {}  # a program's first response
    done = total = 0
    for r in reqs:
        assert r.session is not None
        g = group_of(r.session)
        f = out.times_by_id.get(r.request_id, (math.nan, -1.0))[1]
        total += 1
        if r.think_s is None:  # a program's first step: sent at its group's arrival
            arrival[g] = r.arrival_s
            if f >= 0:
                first_of[r.session] = f
        if f >= 0:
            done += 1
            last[g] = max(last[g], f)
    if done != total:
        raise SystemExit(f"{total - done} of {total} requests unfinished by {HORIZON_S:g} s: lower the load")
    makespan = sorted(last[g] - arrival[g] for g in arrival)
    waited: dict[str, float] = defaultdict(float)  # the group's last first response
    for s, f in first_of.items():
        g = group_of(s)
        waited[g] = max(waited[g], f - arrival[g])
    x = out.result.extra
    pc = x.get("pacing", {}).get("pause_cycles_per_program_per_10min", {"max": 0.0, "mean": 0.0})
    span = max(last.values()) - min(arrival.values())
    return {
        "mk_mean": statistics.fmean(makespan), "mk_p90": makespan[int(0.9 * (len(makespan) - 1))],
        "mk_max": makespan[-1], "first_mean": statistics.fmean(waited.values()), "first_max": max(waited.values()),
        "steps_min": done / span * 60.0, "reuse": out.result.prefix_reuse,
        "recomputed": float(x.get("recomputed_prompt_tokens", math.nan)),
        "pause_mean": float(pc["mean"]), "pause_max": float(pc["max"]), "wall_s": out.result.wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=48)
    ap.add_argument("--size", type=int, default=8, help="programs per group")
    ap.add_argument("--steps", type=int, default=6, help="steps per program")
    ap.add_argument("--load", action="append", metavar="RATE:BLOCKS",
                    help="groups/s and KV blocks per worker (repeatable; default 0.05:384 and 0.1:256)")
    ap.add_argument("--arms", nargs="+", default=["kv_aware", "pacing ours", "pacing paper"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for load in args.load or ["0.05:384", "0.1:256"]:
        rate_s, _, blocks_s = load.partition(":")
        try:
            rate, blocks = float(rate_s), int(blocks_s)
        except ValueError:
            raise SystemExit(f"--load wants RATE:BLOCKS (e.g. 0.05:384), got {load!r}") from None
        reqs = rollout_groups(args.groups, args.size, args.steps, group_rate=rate, seed=args.seed, block_size=BLOCK)
        res = {name: run(reqs, blocks, arm(name)) for name in args.arms}
        base = res[args.arms[0]]
        rows = [(name, f"{r['mk_mean']:.0f}", f"{r['mk_p90']:.0f}", f"{r['mk_max']:.0f}",
                 f"{r['mk_mean'] / base['mk_mean']:.2f}", f"{r['first_mean']:.1f}", f"{r['first_max']:.1f}",
                 f"{r['steps_min']:.1f}", f"{r['reuse']:.1%}", f"{r['recomputed'] / 1e6:.1f} M",
                 f"{r['recomputed'] / base['recomputed']:.2f}" if base["recomputed"] else "-",
                 f"{r['pause_mean']:.1f}", f"{r['pause_max']:.1f}", f"{r['wall_s']:.0f}")
                for name, r in res.items()]
        print_table(f"{args.groups} groups of {args.size} programs x {args.steps} steps at {rate:g} groups/s, "
                    f"{blocks:,} KV blocks x {BLOCK} tokens per worker, {WORKERS} workers",
                    ("arm", "makespan mean s", "p90", "max", "vs kv_aware", "last 1st resp. mean s", "max",
                     "steps/min", "reuse", "recomputed", "vs kv_aware", "pauses/prog/10min", "max", "wall s"),
                    rows)


if __name__ == "__main__":
    main()
