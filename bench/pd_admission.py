"""Disaggregation ``always`` under overload, in the simulator: where the excess waits, and what priorities get.

With every request prefilled on the prefill tier, the decode workers prefill nothing and always look free.
The scheduler therefore also waits for a prefill worker with a backlog under ``engine_backlog_passes`` passes
(requests of priority <= 0; higher ones go on the decode tier's room, and the prefill engine's priority queue
lets them overtake there). This bench shows, on the same requests:

- **no scheduler**: every request goes at once, and the overload queues in the prefill engine;
- **scheduler, N passes**: the holding queue on, with the prefill tier's gate at N passes. What it holds is
  what its bounds (``max_queued``, ``max_queue_delay_s``: 429 with Retry-After, live) and ``max_wait_s`` act on.

The last table sends every request at priority 1: the gate then holds them behind the high-priority work
it sent the prefill worker (``scheduler/prefill_gate.py``), where a flood of them used to pass.

Workload (seeded): Poisson arrivals of 1,024-6,144-token prompts with no shared prefix (50-300 output
tokens), 20 % at priority 1; 1 prefill + 3 decode simulated workers (16,384 blocks of 64 tokens), KV moved
over a 400 Gb/s link. Rates of 12 and 16 requests/s: the prefill worker's capacity is about 12.

Run: ``python bench/pd_admission.py [--requests N] [--seed S]`` (about 15 s).
"""

from __future__ import annotations

import argparse
import random
import statistics

from _common import print_table

from thunderagent.config import DisaggConfig, KvTransferConfig, NodeConfig, Policy, RoutingConfig, SchedulerConfig
from thunderagent.sim.driver import PdSetup, Simulator
from thunderagent.sim.traces import TraceRequest

BLOCK = 64
HASH_BLOCK = 512  # a hash per 512 tokens of the trace format (Mooncake's)


def requests(n: int, rate: float, seed: int, high: float = 0.2) -> list[TraceRequest]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for k in range(n):
        t += rng.expovariate(rate)
        tokens = rng.randint(1024, 6144)
        hashes = [rng.getrandbits(30) for _ in range(tokens // HASH_BLOCK)]  # unique: nothing shared
        out.append(TraceRequest(f"r{k}", t, tokens, rng.randint(50, 300), hashes, HASH_BLOCK,
                                priority=1 if rng.random() < high else 0))
    return out


def p99(xs: list[float]) -> float:
    return xs[int(0.99 * (len(xs) - 1))]


def run(reqs: list[TraceRequest], sched: SchedulerConfig | None) -> list[object]:
    sim = Simulator(NodeConfig(kv_blocks=16384, block_size=BLOCK), RoutingConfig(seed=0), 4, Policy.kv_aware,
                    seed=0, scheduler=sched,
                    pd=PdSetup(1, 3, DisaggConfig(mode="always"), KvTransferConfig(enabled=True, bandwidth_gbps=400)))
    out = sim.run(reqs, 1.0)
    prio = {q.request_id: q.priority for q in reqs}
    hi = sorted(v for k, v in out.ttft_by_id.items() if prio[k] > 0) or [float("nan")]
    lo = sorted(v for k, v in out.ttft_by_id.items() if prio[k] <= 0) or [float("nan")]
    waited = out.result.extra.get("queue_wait_ms") or {"mean": 0.0, "max": 0.0}
    assert len(out.ttft_by_id) == len(reqs) and not out.result.extra["incomplete_requests"]  # nothing lost
    return [statistics.mean(hi), p99(hi), statistics.mean(lo), p99(lo), waited["mean"], waited["max"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for rate, high in ((12.0, 0.2), (16.0, 0.2), (16.0, 1.0)):
        reqs = requests(args.requests, rate, args.seed, high)
        rows = [["no scheduler", *run(reqs, None)]]
        for passes in (1.0, 2.0):
            rows.append([f"scheduler, {passes:g} pass(es)",
                         *run(reqs, SchedulerConfig(enabled=True, engine_backlog_passes=passes))])
        print_table(f"{args.requests} requests at {rate:g}/s ({high:.0%} at priority 1), 1 prefill + 3 decode "
                    "workers, mode always (TTFT and wait in ms)",
                    ["arm", "hi mean", "hi p99", "lo mean", "lo p99", "held: wait mean", "wait max"], rows)
        base = rows[0]
        names = ("hi mean", "hi p99", "lo mean", "lo p99")
        for r in rows[1:]:
            parts = [f"{name} {r[k] / base[k]:.2f}x" for k, name in enumerate(names, 1) if base[k] == base[k]]
            print(f"  {r[0]} / no scheduler: " + ", ".join(parts))  # (a tier with no request is left out)
        print()


if __name__ == "__main__":
    main()
