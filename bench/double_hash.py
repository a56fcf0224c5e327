"""Cost of the double-hash guard (``routing.double_hash``, ``kv.check``): guard on vs off, same run.

Workload: ``route_decision.py``'s (64-token blocks, 16-block sequences in prefix families, 8 workers,
~100 k (block, worker) entries fed as ``BlockStored`` events; queries 1/3 hits, 1/3 partial, 1/3
misses). Two indexes get the same events; the guarded one also gets the blocks' check hashes
(as the vLLM / SGLang translator sends them) and a router over it gets the requests' check hashes.

Reported:
- memory: bytes traced (tracemalloc) while ingesting all events, per distinct indexed hash and per
  (block, worker) entry, off vs on (the check ints are fresh objects, as they would be off the wire);
- ingest: blocks/s through ``apply_event``;
- per decision: hashing the prompt (``block_hashes`` vs ``block_hash_pairs``), the index match alone,
  and a full decision (hash + ``KvRouter.route``, which also predicts).

Run: ``python bench/double_hash.py [--quick]``. Ratio = on / off (> 1: the guard costs that much).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, print_table, ratio  # noqa: E402
from route_decision import BLOCK, _tokens, _worker_states, make_queries, make_workload  # noqa: E402

from thunderagent.config import RoutingConfig  # noqa: E402
from thunderagent.kv.hashing import block_hash_pairs, block_hashes  # noqa: E402
from thunderagent.kv.index import KvIndex  # noqa: E402
from thunderagent.router.router import KvRouter  # noqa: E402
from thunderagent.types import BlockStored, RouteRequest  # noqa: E402


def _fresh(x: int) -> int:
    return int.from_bytes(x.to_bytes(8, "little"), "little")  # a new int object, as decoded off the wire


def _ingest(events: list, checks_of: dict[int, int] | None, n_workers: int,
            trace: bool) -> tuple[KvIndex, int, float]:
    """A fresh index fed all events: (index, traced bytes it allocated, seconds in apply_event).
    Memory is traced in one pass, time taken in another (tracing slows every allocation)."""
    idx = KvIndex(prediction_ttl=5.0, double_hash=checks_of is not None)
    for i in range(n_workers):
        idx.add_worker(f"w{i}")
    seqs = [0] * n_workers
    if trace:
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    spent = 0.0
    for w, new, parent, _ in events:
        # primaries fresh in both arms too: the index owns its keys' int objects, as in serving
        checks = None if checks_of is None else tuple(_fresh(checks_of[h]) for h in new)
        ev = BlockStored(f"w{w}", seqs[w], tuple(_fresh(h) for h in new), parent, checks)
        t0 = time.perf_counter()
        idx.apply_event(ev, 0.0)
        spent += time.perf_counter() - t0
        seqs[w] += 1
    del ev, checks
    used = tracemalloc.get_traced_memory()[0] - base
    if trace:
        tracemalloc.stop()
    return idx, used, spent


def run(n_blocks: int = 100_000, n_workers: int = 8, n_queries: int = 3000, seed: int = 0) -> dict[str, float]:
    wl = make_workload(n_blocks, n_workers, seed)
    checks_of: dict[int, int] = {}
    for seq in wl.sequences:
        hs, cs = block_hash_pairs(_tokens(seq), BLOCK)
        checks_of.update(zip(hs, cs))
    n_blocks_in = sum(len(new) for _, new, _, _ in wl.events)
    mem_off = _ingest(wl.events, None, n_workers, True)[1]
    mem_on = _ingest(wl.events, checks_of, n_workers, True)[1]
    on, _, t_on = _ingest(wl.events, checks_of, n_workers, False)
    off, _, t_off = _ingest(wl.events, None, n_workers, False)
    distinct = len(checks_of) if on.checks is None else len(on.checks)
    entries = on.num_blocks()
    r_off = KvRouter(RoutingConfig(seed=seed, double_hash=False), off, random.Random(seed))
    r_on = KvRouter(RoutingConfig(seed=seed), on, random.Random(seed))
    states = _worker_states(n_workers)
    perf = time.perf_counter_ns
    t = {k: [] for k in ("hash_off", "hash_on", "match_off", "match_on", "full_off", "full_on")}
    agree = 0
    for i, (_, blocks) in enumerate(make_queries(wl, n_queries, seed)):
        toks = _tokens(blocks)
        t0 = perf()
        h = block_hashes(toks, BLOCK)
        t1 = perf()
        hp, cp = block_hash_pairs(toks, BLOCK)
        t2 = perf()
        m_off = off.find_matches(h, 1.0)
        t3 = perf()
        m_on = on.find_matches(hp, 1.0, cp)
        t4 = perf()
        agree += m_off == m_on
        t["hash_off"].append(t1 - t0)
        t["hash_on"].append(t2 - t1)
        t["match_off"].append(t3 - t2)
        t["match_on"].append(t4 - t3)
        first = i % 2  # alternate which arm goes first
        for arm in ((0, 1) if first else (1, 0)):
            s = perf()
            if arm:
                hp, cp = block_hash_pairs(toks, BLOCK)
                r_on.route(RouteRequest(f"q{i}", len(toks), hp, 0, cp), states, 1.0)
            else:
                r_off.route(RouteRequest(f"q{i}", len(toks), block_hashes(toks, BLOCK)), states, 1.0)
            t["full_on" if arm else "full_off"].append(perf() - s)
    out = {k: median(v) / 1000 for k, v in t.items()}
    out.update(
        mem_off_per_hash=mem_off / distinct, mem_on_per_hash=mem_on / distinct,
        mem_off_per_entry=mem_off / entries, mem_on_per_entry=mem_on / entries,
        ingest_off=n_blocks_in / t_off, ingest_on=n_blocks_in / t_on,
        distinct=distinct, entries=entries, agree=agree / n_queries,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="20 k entries, 600 queries")
    a = ap.parse_args()
    r = run(20_000, n_queries=600) if a.quick else run()
    f = lambda k: round(r[k], 2)  # noqa: E731
    rows = [
        ["bytes / indexed hash", round(r["mem_off_per_hash"]), round(r["mem_on_per_hash"]),
         ratio(r["mem_on_per_hash"], r["mem_off_per_hash"])],
        ["bytes / (block, worker) entry", round(r["mem_off_per_entry"]), round(r["mem_on_per_entry"]),
         ratio(r["mem_on_per_entry"], r["mem_off_per_entry"])],
        ["ingest, k blocks/s", round(r["ingest_off"] / 1000), round(r["ingest_on"] / 1000),
         ratio(r["ingest_on"], r["ingest_off"])],
        ["hash 16 blocks, µs", f("hash_off"), f("hash_on"), ratio(r["hash_on"], r["hash_off"])],
        ["index match, µs", f("match_off"), f("match_on"), ratio(r["match_on"], r["match_off"])],
        ["full decision (hash + route), µs", f("full_off"), f("full_on"), ratio(r["full_on"], r["full_off"])],
    ]
    print(f"{int(r['distinct'])} distinct hashes, {int(r['entries'])} entries; "
          f"identical matches on/off: {r['agree']:.0%}")
    print_table("double-hash guard: off vs on (medians; ratio = on / off)", ["", "off", "on", "ratio"], rows)


if __name__ == "__main__":
    main()
