"""Deterministic cost of the full routing decision: instructions counted by valgrind, not wall time.

On a shared machine, wall-time medians of a ~100 µs decision move by ±30 % between runs (other jobs,
frequency), which hides a 10-20 % change. This script runs ``route_decision.py``'s workload (8
workers, a 5,000-entry index) and then N full decisions (``block_hashes`` + ``KvRouter.route`` over a
fleet view, explanation not built, clock +1 ms per decision). Run it under callgrind twice, with N = 0
and N = 400: the difference of the two instruction counts over 400 is the instructions per decision
(setup, imports and interpreter start cancel out). Compare two versions of the code by running both
pairs (e.g. ``PYTHONPATH=<other checkout>/src``).

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python bench/route_count.py 0
    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python bench/route_count.py 400

(about a minute each). Without valgrind it just runs the decisions (a smoke test).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import route_decision as rd  # noqa: E402

from thunderagent.config import RoutingConfig  # noqa: E402
from thunderagent.kv.hashing import block_hashes  # noqa: E402
from thunderagent.kv.index import KvIndex  # noqa: E402
from thunderagent.router.candidates import FleetView  # noqa: E402
from thunderagent.router.router import KvRouter  # noqa: E402
from thunderagent.types import BlockStored, RouteRequest  # noqa: E402


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    wl = rd.make_workload(5_000, 8, 0)
    index = KvIndex(prediction_ttl=5.0)
    for i in range(8):
        index.add_worker(f"w{i}")
    seqs = [0] * 8
    for w, new, parent, _local in wl.events:
        index.apply_event(BlockStored(f"w{w}", seqs[w], tuple(new), parent), 0.0)
        seqs[w] += 1
    router = KvRouter(RoutingConfig(seed=0), index, random.Random(0))
    view = FleetView(router.cfg, rd._worker_states(8))
    prompts = [rd._tokens(blocks) for _kind, blocks in rd.make_queries(wl, 400, 0)]
    now = 1.0
    for i in range(n):
        toks = prompts[i % len(prompts)]
        now += 0.001
        router.route(RouteRequest(f"r{i}", len(toks), block_hashes(toks, rd.BLOCK)), view, now)


if __name__ == "__main__":
    main()
