"""A load test for ``planner.service_rate_per_worker``: one simulated worker fed more than it can serve
(Poisson arrivals at ``--rate``, the ``ramp`` generator held flat) for ``--seconds``; prints the
requests it served per second once its queue formed (first tokens from the first quarter of the run to
the end, over that time).

    .venv/bin/python bench/worker_capacity.py                      # bench/planner_ramp.py's workload
    .venv/bin/python bench/worker_capacity.py --groups 32 --prefix-tokens 4096 --suffix-tokens 512
"""

from __future__ import annotations

import argparse

from thunderagent.config import NodeConfig, Policy, RoutingConfig, TimingConfig
from thunderagent.sim.generators import ramp
from thunderagent.sim.scaling import ScalingSim


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=96)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=2048)
    ap.add_argument("--engine-speed", type=float, default=0.05)
    ap.add_argument("--rate", type=float, default=2.0, help="offered req/s (above the worker's capacity)")
    ap.add_argument("--seconds", type=float, default=400.0)
    a = ap.parse_args(argv)
    node = NodeConfig(kv_blocks=a.kv_blocks, timing=TimingConfig(speedup=a.engine_speed))
    reqs = ramp(a.groups, a.prefix_tokens, a.suffix_tokens, a.rate, base_rate=a.rate, ramp_up_s=1.0,
                hold_s=a.seconds, ramp_down_s=1.0, output_tokens=a.output_tokens, block_size=node.block_size)
    sim = ScalingSim(node, RoutingConfig(), Policy.kv_aware, mode="fixed", initial=1, max_workers=1)
    out = sim.replay(reqs, 0.0).outcome
    assert out is not None
    start = a.seconds / 4
    firsts = sorted(out.times_by_id[rid][0] + ms / 1000.0 for rid, ms in out.ttft_by_id.items())
    last = max(firsts)
    served = sum(1 for f in firsts if f >= start)
    print(f"{len(reqs)} requests offered at {a.rate:g} req/s; one worker served {served / (last - start):.3f} req/s "
          f"from {start:.0f} s to its last first token at {last:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
