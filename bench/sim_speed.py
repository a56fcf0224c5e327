"""Simulator speed: `thunderagent sim`'s replay against NVIDIA Dynamo's mocker replay (Rust, the
``ai-dynamo-runtime`` wheel of the ``compare`` extra) on the same trace and settings, in one run.

For every arrival speedup and policy (ours ``round_robin`` / ``kv_aware`` beside Dynamo's
``round_robin`` / ``kv_router``) it prints both wall times and CPU times (``time.process_time``: all
threads of this process, so it counts Dynamo's Rust threads too, and it moves less than wall time
on a shared machine) and their ratios, plus TTFT and ITL of both to show the results the speed was
bought with. Our time is the replay (``Simulator.run``); the trace is parsed once before (printed
apart); Dynamo's time includes its own parsing of the file. Repeats: ``--repeat N`` runs each pair
N times interleaved and quotes medians.

    .venv/bin/python bench/sim_speed.py                       # full Mooncake conversation trace, x4 and x8
    .venv/bin/python bench/sim_speed.py --speedup 4 --limit 2000 --repeat 1   # quick look
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, ratio  # noqa: E402

from thunderagent.config import Config, Policy  # noqa: E402
from thunderagent.sim.driver import Simulator  # noqa: E402
from thunderagent.sim.traces import load_traces  # noqa: E402

TRACE = Path(__file__).resolve().parents[1] / "../shared/traces/mooncake/conversation_trace.jsonl"
DYNAMO_MODE = {"round_robin": "round_robin", "kv_aware": "kv_router"}


def _ours(requests: list, policy: str, speedup: float,  # type: ignore[no-untyped-def]
          workers: int, kv_blocks: int, block_size: int):
    cfg = Config()
    node = cfg.execution_group.nodes[0].model_copy(update={"kv_blocks": kv_blocks, "block_size": block_size})
    sim = Simulator(node, cfg.routing, workers, Policy(policy), seed=0)
    w, c = time.perf_counter(), time.process_time()
    res = sim.run(requests, speedup).result
    return time.perf_counter() - w, time.process_time() - c, res


def _dynamo(trace: Path, policy: str, speedup: float,  # type: ignore[no-untyped-def]
            workers: int, kv_blocks: int, block_size: int):
    from thunderagent.sim.dynamo import run_dynamo  # noqa: PLC0415

    w, c = time.perf_counter(), time.process_time()
    res = run_dynamo(trace, workers=workers, kv_blocks=kv_blocks, block_size=block_size, speedup=speedup,
                     router_mode=DYNAMO_MODE[policy])
    return time.perf_counter() - w, time.process_time() - c, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--speedup", type=float, action="append")
    ap.add_argument("--policy", choices=sorted(DYNAMO_MODE), action="append")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--limit", type=int, help="first N requests (ours only: Dynamo is skipped, it reads the file)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-dynamo", action="store_true")
    a = ap.parse_args()
    speedups, policies = a.speedup or [4.0, 8.0], a.policy or ["round_robin", "kv_aware"]
    t0 = time.perf_counter()
    requests = load_traces([a.trace])
    if a.limit:
        requests = sorted(requests, key=lambda r: r.arrival_s)[: a.limit]
    print(f"{len(requests):,} requests from {a.trace.name}, parsed in {time.perf_counter() - t0:.2f} s; "
          f"{a.workers} workers x {a.kv_blocks} blocks x {a.block_size} tokens")
    dyn_ok = not (a.no_dynamo or a.limit)
    if dyn_ok:
        from thunderagent.sim.dynamo import dynamo_available  # noqa: PLC0415

        dyn_ok = dynamo_available()
        if not dyn_ok:
            print("Dynamo's replay is not installed (pip install -e '.[compare]'): ours only")
    speed_rows, result_rows = [], []
    for sp in speedups:
        for pol in policies:
            ow, oc, dw, dc = [], [], [], []
            ours = dyn = None
            for _ in range(a.repeat):
                w, c, ours = _ours(requests, pol, sp, a.workers, a.kv_blocks, a.block_size)
                ow.append(w)
                oc.append(c)
                if dyn_ok:
                    w, c, dyn = _dynamo(a.trace, pol, sp, a.workers, a.kv_blocks, a.block_size)
                    dw.append(w)
                    dc.append(c)
            mw, mc, dmw, dmc = median(ow), median(oc), median(dw), median(dc)
            speed_rows.append([f"x{sp:g} {pol}", mw, dmw, ratio(mw, dmw), mc, dmc, ratio(mc, dmc)])
            print(f"  x{sp:g} {pol}: ours {mw:.1f} s wall / {mc:.1f} s cpu, dynamo {dmw:.1f} s / {dmc:.1f} s",
                  flush=True)
            for name, r in (("ours " + pol, ours), ("dynamo " + DYNAMO_MODE[pol], dyn)):
                if r is not None:
                    result_rows.append([f"x{sp:g} {name}", f"{r.ttft_ms.mean:.1f}", f"{r.ttft_ms.p50:.1f}",
                                        f"{r.ttft_ms.p99:.1f}", f"{r.itl_ms.mean:.2f}", f"{r.prefix_reuse:.2%}"])
    print_table(f"Simulator wall and CPU seconds (median of {a.repeat}; target ours <= 1.0x Dynamo's wall at x4)",
                ["run", "ours wall s", "dynamo wall s", "ratio", "ours cpu s", "dynamo cpu s", "cpu ratio"],
                speed_rows)
    print_table("Results (ms)", ["run", "TTFT mean", "p50", "p99", "ITL mean", "reuse"], result_rows)


if __name__ == "__main__":
    main()
