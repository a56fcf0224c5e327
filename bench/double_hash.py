"""Cost of the double-hash guard (``routing.double_hash``, ``kv.check``): guard on vs off, same run.

Workload: ``route_decision.py``'s (64-token blocks, 16-block sequences in prefix families, 8 workers,
~100 k (block, worker) entries fed as ``BlockStored`` events; queries 1/3 hits, 1/3 partial, 1/3
misses). Two indexes get the same events; the guarded one also gets the blocks' check hashes
(as every producer sends them with the guard on: the simulated engine, the vLLM / SGLang translator,
the NATS wire) and a router over it gets the requests' check hashes.

Reported:
- memory: bytes traced (tracemalloc) while ingesting all events, per distinct indexed hash and per
  (block, worker) entry, off vs on (the check ints are fresh objects, as they would be off the wire);
- ingest: blocks/s through ``apply_event``: two fresh indexes (off, on) fed the same events
  interleaved event by event (alternating which goes first), timed per chunk of 64 events, repeated
  ``reps`` times; medians over all chunks of each arm's rate and of the per-chunk ratio (timing each
  arm whole swung from 0.36x to 1.07x between runs on this shared machine);
- wire: bytes per stored block of the events as NATS ``KvBatch`` messages (``bus.wire_kv``);
- per decision: hashing the prompt (``block_hashes`` vs ``block_hash_pairs``), the index match alone,
  and a full decision (hash + ``KvRouter.route``, which also predicts).

Run: ``python bench/double_hash.py [--quick]``. Ratio = on / off (> 1: the guard costs that much).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, print_table, ratio  # noqa: E402
from route_decision import BLOCK, _tokens, _worker_states, make_queries, make_workload  # noqa: E402

from thunderagent.bus.wire_kv import KvBatch, events_to_wire  # noqa: E402
from thunderagent.bus.wire import encode  # noqa: E402
from thunderagent.config import RoutingConfig  # noqa: E402
from thunderagent.kv.hashing import block_hash_pairs, block_hashes  # noqa: E402
from thunderagent.kv.index import KvIndex  # noqa: E402
from thunderagent.router.router import KvRouter  # noqa: E402
from thunderagent.types import BlockStored, RouteRequest  # noqa: E402


def _fresh(x: int) -> int:
    return int.from_bytes(x.to_bytes(8, "little"), "little")  # a new int object, as decoded off the wire


def _fresh_index(guard: bool, n_workers: int) -> KvIndex:
    idx = KvIndex(prediction_ttl=5.0, double_hash=guard)
    for i in range(n_workers):
        idx.add_worker(f"w{i}")
    return idx


def _events(events: list, checks_of: dict[int, int] | None) -> list[BlockStored]:
    """``BlockStored`` events with fresh int objects (primaries fresh in both arms too: the index
    owns its keys' ints, as in serving)."""
    seqs: dict[int, int] = {}
    out = []
    for w, new, parent, _ in events:
        checks = None if checks_of is None else tuple(_fresh(checks_of[h]) for h in new)
        seq = seqs[w] = seqs.get(w, -1) + 1
        out.append(BlockStored(f"w{w}", seq, tuple(_fresh(h) for h in new), parent, checks))
    return out


def _memory(events: list, checks_of: dict[int, int] | None, n_workers: int) -> int:
    """Bytes traced (tracemalloc) while a fresh index ingests all events (their ints built inside
    the traced window too: the index keeps them)."""
    idx = _fresh_index(checks_of is not None, n_workers)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for ev in _events(events, checks_of):
        idx.apply_event(ev, 0.0)
    # the events list is gone again; what stays allocated is the index's
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used


def _ingest_pair(events: list, checks_of: dict[int, int], n_workers: int,
                 chunk: int = 64) -> tuple[KvIndex, KvIndex, list[tuple[int, float, float]]]:
    """Two fresh indexes (guard off, on) fed the same events, interleaved event by event
    (alternating which arm goes first): (off, on, per-chunk (blocks, seconds off, seconds on)).
    Interleaving this finely makes both arms share whatever load the machine has at that moment."""
    off, on = _fresh_index(False, n_workers), _fresh_index(True, n_workers)
    ev_off, ev_on = _events(events, None), _events(events, checks_of)
    perf = time.perf_counter
    out: list[tuple[int, float, float]] = []
    gc.collect()
    gc.disable()  # a cyclic-GC pass over the growing indexes would land in one arm at random
    try:
        blocks, s_off, s_on = 0, 0.0, 0.0
        for i, (a, b) in enumerate(zip(ev_off, ev_on)):
            if i % 2:
                t0 = perf()
                on.apply_event(b, 0.0)
                t1 = perf()
                off.apply_event(a, 0.0)
                t2 = perf()
                s_on += t1 - t0
                s_off += t2 - t1
            else:
                t0 = perf()
                off.apply_event(a, 0.0)
                t1 = perf()
                on.apply_event(b, 0.0)
                t2 = perf()
                s_off += t1 - t0
                s_on += t2 - t1
            blocks += len(a.block_hashes)
            if (i + 1) % chunk == 0:
                out.append((blocks, s_off, s_on))
                blocks, s_off, s_on = 0, 0.0, 0.0
    finally:
        gc.enable()
    return off, on, out


def _wire_bytes(events: list, checks_of: dict[int, int] | None) -> int:
    """Encoded ``KvBatch`` bytes of all stored events, 64 events per message."""
    evs = [BlockStored("w", i, tuple(new), parent, None if checks_of is None else tuple(checks_of[h] for h in new))
           for i, (_, new, parent, _) in enumerate(events)]
    return sum(len(encode(KvBatch("i", events_to_wire(evs[i:i + 64])))) for i in range(0, len(evs), 64))


def run(n_blocks: int = 100_000, n_workers: int = 8, n_queries: int = 3000, seed: int = 0,
        reps: int = 7) -> dict[str, float]:
    wl = make_workload(n_blocks, n_workers, seed)
    checks_of: dict[int, int] = {}
    for seq in wl.sequences:
        hs, cs = block_hash_pairs(_tokens(seq), BLOCK)
        checks_of.update(zip(hs, cs))
    n_blocks_in = sum(len(new) for _, new, _, _ in wl.events)
    mem_off = _memory(wl.events, None, n_workers)
    mem_on = _memory(wl.events, checks_of, n_workers)
    rates_on, rates_off, ratios, rep_ratios = [], [], [], []
    for _ in range(reps):
        off, on, chunks = _ingest_pair(wl.events, checks_of, n_workers)
        rates_off += [b / s for b, s, _ in chunks]
        rates_on += [b / s for b, _, s in chunks]
        ratios += [s_off / s_on for _, s_off, s_on in chunks]
        rep_ratios.append(sum(c[1] for c in chunks) / sum(c[2] for c in chunks))
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
        ingest_off=median(rates_off), ingest_on=median(rates_on), ingest_ratio=median(ratios),
        rep_ratio_min=min(rep_ratios), rep_ratio_max=max(rep_ratios), reps=reps,
        wire_off=_wire_bytes(wl.events, None) / n_blocks_in, wire_on=_wire_bytes(wl.events, checks_of) / n_blocks_in,
        distinct=distinct, entries=entries, agree=agree / n_queries,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="20 k entries, 600 queries, 3 ingest repetitions")
    ap.add_argument("--reps", type=int, default=None, help="ingest repetitions (default 7, --quick 3)")
    a = ap.parse_args()
    r = run(20_000, n_queries=600, reps=a.reps or 3) if a.quick else run(reps=a.reps or 7)
    f = lambda k: round(r[k], 2)  # noqa: E731
    rows = [
        ["bytes / indexed hash", round(r["mem_off_per_hash"]), round(r["mem_on_per_hash"]),
         ratio(r["mem_on_per_hash"], r["mem_off_per_hash"])],
        ["bytes / (block, worker) entry", round(r["mem_off_per_entry"]), round(r["mem_on_per_entry"]),
         ratio(r["mem_on_per_entry"], r["mem_off_per_entry"])],
        [f"ingest, k blocks/s ({int(r['reps'])} reps)", round(r["ingest_off"] / 1000),
         round(r["ingest_on"] / 1000), r["ingest_ratio"]],
        ["wire bytes / stored block (KvBatch)", r["wire_off"], r["wire_on"], ratio(r["wire_on"], r["wire_off"])],
        ["hash 16 blocks, µs", f("hash_off"), f("hash_on"), ratio(r["hash_on"], r["hash_off"])],
        ["index match, µs", f("match_off"), f("match_on"), ratio(r["match_on"], r["match_off"])],
        ["full decision (hash + route), µs", f("full_off"), f("full_on"), ratio(r["full_on"], r["full_off"])],
    ]
    print(f"{int(r['distinct'])} distinct hashes, {int(r['entries'])} entries; "
          f"identical matches on/off: {r['agree']:.0%}; ingest ratio over each whole repetition "
          f"{r['rep_ratio_min']:.2f}..{r['rep_ratio_max']:.2f}")
    print_table("double-hash guard: off vs on (medians; ratio = on / off)", ["", "off", "on", "ratio"], rows)


if __name__ == "__main__":
    main()
