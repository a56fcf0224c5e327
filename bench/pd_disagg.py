"""Prefill/decode disaggregation on the Mooncake conversation trace, in the simulator.

Baseline, measured in the same run: aggregated kv_aware on 8 workers. Against it, for each
prefill:decode split of the same 8 workers (same node: 16,384 blocks x 64 tokens, 8,192-token passes)
and each mode (``always``, ``conditional``): TTFT and ITL percentiles. Ratios: "ITL p99 gain" =
baseline ITL p99 / this run's (above 1: better), "TTFT p50 ratio" = this run's TTFT p50 / baseline's
(below 1: better). The transfer plane: ``--bandwidth-gbps`` per link (default 400, one RDMA NIC),
1 ms latency, 128 KiB of KV per token (Llama-3-8B fp16), the plane's other defaults.

Target (issue 10): conditional ITL p99 >= 1.3x better than aggregated with TTFT p50 at most 10 % worse,
and a better TTFT p50 than always-disaggregate (best split of each mode).

Run: ``cd bench && python pd_disagg.py [--speedup 4] [--splits 1:7 2:6 3:5 4:4] [--modes always conditional]
[--bandwidth-gbps 400] [--limit N]`` (one row ~40-60 s on the full trace on a 2-core machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table  # noqa: E402

from thunderagent.config import DisaggConfig, KvTransferConfig, NodeConfig, Policy, RoutingConfig  # noqa: E402
from thunderagent.sim.driver import PdSetup, SimOutcome, Simulator  # noqa: E402
from thunderagent.sim.traces import load_trace  # noqa: E402

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
WORKERS = 8


def run(reqs: list, speedup: float, pd: PdSetup | None) -> SimOutcome:
    node = NodeConfig(kv_blocks=16384, block_size=64)
    sim = Simulator(node, RoutingConfig(seed=0), WORKERS, Policy.kv_aware, seed=0, pd=pd)
    return sim.run(reqs, speedup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--speedup", type=float, default=4.0)
    ap.add_argument("--splits", nargs="+", default=["1:7", "2:6", "3:5", "4:4"])
    ap.add_argument("--modes", nargs="+", default=["always", "conditional"], choices=["always", "conditional", "never"])
    ap.add_argument("--bandwidth-gbps", type=float, default=400.0)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only (quick looks)")
    args = ap.parse_args()
    reqs = sorted(load_trace(args.trace), key=lambda r: r.arrival_s)
    if args.limit:
        reqs = reqs[: args.limit]
    transfer = KvTransferConfig(enabled=True, bandwidth_gbps=args.bandwidth_gbps)
    rows = []
    t0 = time.perf_counter()
    base = run(reqs, args.speedup, None).result
    print(f"aggregated kv_aware x{WORKERS}: {time.perf_counter() - t0:.0f} s", flush=True)

    def row(label: str, r, pd: dict | None) -> list[object]:
        fb = sum(pd["plane"]["fallbacks"].values()) if pd else 0
        return [label, r.requests, r.ttft_ms.p50, r.ttft_ms.p99, r.itl_ms.p50, r.itl_ms.p99,
                base.itl_ms.p99 / r.itl_ms.p99, r.ttft_ms.p50 / base.ttft_ms.p50,
                pd["remote_prefills"] if pd else 0, fb, r.wall_s]

    rows.append(row("aggregated kv_aware 8", base, None))
    for mode in args.modes:
        for split in args.splits:
            p, d = (int(x) for x in split.split(":"))
            setup = PdSetup(p, d, DisaggConfig(mode=mode), transfer)
            r = run(reqs, args.speedup, setup).result
            rows.append(row(f"{mode} {p}:{d}", r, r.extra["pd"]))  # type: ignore[arg-type]
            print("  ".join(str(c) for c in rows[-1]), r.extra["pd"]["decisions"], flush=True)  # type: ignore[index]
    print_table(f"Mooncake conversation trace, {len(reqs):,} requests, x{args.speedup}, {args.bandwidth_gbps:g} Gbps "
                "links", ["run", "done", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL p99 gain",
                         "TTFT p50 ratio", "remote", "fallbacks", "wall s"], rows)


if __name__ == "__main__":
    main()
