"""The holding queue against Dynamo's kv_router queue, on Mooncake-format conversation traces (issue 9).

Per trace, on 8 simulated workers (16,384 blocks of 64 tokens), the same requests through:
- **ours**: kv_aware with the holding queue (the config's ``scheduler:`` section, default: the shipped
  defaults), in our simulator;
- **Dynamo kv_router** at its defaults, and with its router queue on (``router_queue_threshold`` 2,
  ``wspt``), in Dynamo's mocker replay (``ai-dynamo-runtime``, the ``compare`` extra).

Traces (``--traces``): ``full`` (``../shared`` Mooncake conversation trace, x8), ``half2`` (its second
half, requests 6,001-12,031, at x10: another slice and speed), ``chat`` (3,000 requests of the simulator's
``multi_turn_chat`` generator, 600 five-turn conversations with a shared 1,024-token system prompt, written
as Mooncake JSONL with 512-token blocks, x4). Prints TTFT mean / p99 and reuse, and our ratios to both
Dynamo arms (targets: mean <= 0.5x Dynamo's defaults and <= 0.8x its queue; p99 <= Dynamo's defaults).

``--route-keys N`` spreads our requests over N route keys (Dynamo's router has no such notion).

Run: ``python bench/mooncake_queue.py [--traces full,half2,chat] [--config configs/x.yaml] [--route-keys N]``: about 5
minutes for ``full`` on a quiet core, 2-3 for each other trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from _common import print_table, ratio

from thunderagent.config import Config, Policy, load_config
from thunderagent.sim.driver import Simulator
from thunderagent.sim.dynamo import run_dynamo
from thunderagent.sim.generators import multi_turn_chat
from thunderagent.sim.traces import load_traces

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
WORKERS, KV_BLOCKS, BLOCK = 8, 16384, 64


def _slice(src: Path, dst: Path, first: int, last: int) -> Path:
    lines = src.read_text().splitlines()[first - 1:last]
    dst.write_text("\n".join(lines) + "\n")
    return dst


def _chat(dst: Path) -> Path:
    reqs = multi_turn_chat(600, 5, conversation_rate=4.0, system_tokens=1024, user_tokens=(1024, 6144),
                           output_tokens=(128, 640), think_time_s=30.0, seed=7, block_size=512)
    with dst.open("w") as f:
        for r in sorted(reqs, key=lambda r: r.arrival_s):
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": r.block_ids}) + "\n")
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="full,half2,chat")
    ap.add_argument("--config", type=Path, default=None, help="YAML config whose scheduler: section ours uses")
    ap.add_argument("--route-keys", type=int, default=0, metavar="N",
                    help="spread our requests round robin over N route keys (tenants / users, as the body's `user` "
                    "would), so the holding queue's deficit round robin and cache affinity work across keys; 0: one key")
    args = ap.parse_args()
    cfg = load_config(args.config) if args.config else Config()
    sched = cfg.scheduler.model_copy(update={"enabled": True, "max_queued": 1_000_000,
                                             "max_queued_per_key": 1_000_000})
    node = next(n for n in cfg.execution_group.nodes if n.role.value != "prefill").model_copy(
        update={"kv_blocks": KV_BLOCKS, "block_size": BLOCK})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make = {"full": lambda: (MOONCAKE, 8.0),
                "half2": lambda: (_slice(MOONCAKE, Path(tmp) / "half2.jsonl", 6001, 12031), 10.0),
                "chat": lambda: (_chat(Path(tmp) / "chat.jsonl"), 4.0)}
        for name in args.traces.split(","):
            path, speed = make[name]()
            reqs = sorted(load_traces([path]), key=lambda r: r.arrival_s)
            if args.route_keys > 0:  # (an open-loop replay's session is only its route key)
                reqs = [dataclasses.replace(r, session=f"user-{i % args.route_keys}") for i, r in enumerate(reqs)]
            ours = Simulator(node, cfg.routing, WORKERS, Policy.kv_aware, seed=0, scheduler=sched).run(
                reqs, speed).result
            dyn = run_dynamo(path, workers=WORKERS, kv_blocks=KV_BLOCKS, block_size=BLOCK, speedup=speed,
                             router_mode="kv_router")
            dynq = run_dynamo(path, workers=WORKERS, kv_blocks=KV_BLOCKS, block_size=BLOCK, speedup=speed,
                              router_mode="kv_router", queue_threshold=2.0, queue_policy="wspt")
            for label, r in (("ours", ours), ("dynamo", dyn), ("dynamo+queue", dynq)):
                rows.append([f"{name} x{speed:g}", label, round(r.ttft_ms.mean), round(r.ttft_ms.p99),
                             f"{100 * r.prefix_reuse:.1f} %", f"{ratio(r.ttft_ms.mean, dyn.ttft_ms.mean):.2f}",
                             f"{ratio(r.ttft_ms.mean, dynq.ttft_ms.mean):.2f}",
                             f"{ratio(r.ttft_ms.p99, dyn.ttft_ms.p99):.2f}"])
            print_table("TTFT (ms)", ["trace", "arm", "mean", "p99", "reuse", "mean/dyn", "mean/dynq", "p99/dyn"],
                        rows)


if __name__ == "__main__":
    main()
