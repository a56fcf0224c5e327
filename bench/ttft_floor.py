"""Physical floor of TTFT on a Mooncake trace: every request alone on an idle engine.

Each request's own prefill, chunked at the engine's token budget (8192) and timed with the mocker's
polynomial, with (a) no cache and (b) an infinite cache (the longest prefix of trace blocks seen
before, capped like the engine at floor((len-1)/64) blocks). No queueing, no batching with others:
no router can beat these percentiles, which puts the TTFT targets in perspective.

Run: ``python bench/ttft_floor.py [TRACE]`` (default: ../shared/traces/mooncake/conversation_trace.jsonl).
"""

from __future__ import annotations

import sys
from pathlib import Path

from thunderagent.engine.timing import PolynomialTiming
from thunderagent.sim.results import Dist
from thunderagent.sim.traces import load_trace

BUDGET = 8192
BLOCK = 64


def prefill_ms(tokens: int, pf) -> float:
    t = 0.0
    while tokens > 0:
        chunk = min(BUDGET, tokens)
        t += pf(chunk)
        tokens -= chunk
    return t


def main() -> None:
    default = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    pf = PolynomialTiming().prefill_ms
    seen: set[int] = set()
    alone, cached = [], []
    for r in load_trace(path):
        hit = 0
        for b in r.block_ids:
            if b not in seen:
                break
            hit += 1
        seen.update(r.block_ids)
        reuse = min(hit * r.trace_block_size, (r.input_length - 1) // BLOCK * BLOCK)
        alone.append(prefill_ms(r.input_length, pf))
        cached.append(prefill_ms(r.input_length - reuse, pf))
    for name, xs in (("no cache", alone), ("infinite cache", cached)):
        d = Dist.of(xs)
        print(f"TTFT floor, {name:>14}: mean {d.mean:8.1f} ms  p50 {d.p50:8.1f}  p90 {d.p90:8.1f}  p99 {d.p99:8.1f}")


if __name__ == "__main__":
    main()
