"""Routing decision time as the fleet grows: 8, 64, 256 and 1,000 workers, kv_aware over a
maintained fleet view (``router/candidates.py``), index filled in proportion to the fleet
(~10 M (block, worker) entries at 1,000 workers, 80 k at 8).

Fill: conversation-like 16-block sequences (block size 64): one of 64 shared 2-block system prompts,
a family context of 0..6 blocks, a unique tail; each stored on its family's home worker (80 %) or a
random one, as ``BlockStored`` events. Worker loads are random (a few percent busy) and change as
the run goes: the chosen worker's queue grows by the request's uncached tokens, and one random
worker reports a new load after every decision (``FleetView.set_load``, timed apart).

Queries: 1,024-token prompts, one third each exact replay of a stored sequence (hit), a family
prefix plus a new tail (partial) and new blocks (miss); hashes precomputed (the frontend hashes a
prompt once, whatever the fleet size). Timed: ``KvRouter.route`` (index match + scoring of the
selected workers + kv_aware choice + prediction; explanation not built), clock +1 ms per decision.

All sizes are filled in one process, then their decisions are timed interleaved (rotating order) so
CPU noise hits all alike; the filled indexes are moved out of the cyclic GC's reach (``gc.freeze``)
first. Index memory: resident-set growth while filling, per (block, worker) entry (nothing is freed
between fills, so no size reuses another's memory).

``--one-out``: then, at the largest size, decisions with one worker out of routing (unavailable, a
breaker open), on a view of the others (what the registry hands the router) against a plain list of
them (what it handed before: the router then scores every worker), interleaved.

Run: ``python bench/route_scale.py [--quick] [--one-out]`` (quick: 1/10 of the entries). Target: p50 and
p99 at 1,000 workers <= 3x those at 8.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, print_table  # noqa: E402

from thunderagent.config import RoutingConfig  # noqa: E402
from thunderagent.kv.index import KvIndex  # noqa: E402
from thunderagent.native import state as native_state  # noqa: E402
from thunderagent.router.candidates import FleetView  # noqa: E402
from thunderagent.router.router import KvRouter  # noqa: E402
from thunderagent.types import BlockStored, LoadReport, RouteRequest, WorkerState  # noqa: E402

BLOCK = 64
SEQ = 16
SIZES = (8, 64, 256, 1000)
ENTRIES_AT_1000 = 10_000_000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _load(rng: random.Random, wid: str) -> LoadReport:
    busy = rng.random() < 0.03
    return LoadReport(wid, 0.0, running=rng.randrange(16), waiting=64 if busy else rng.randrange(4),
                      queued_prefill_tokens=rng.choice((0, rng.randrange(8192))), decode_tokens=rng.randrange(60_000),
                      kv_active_blocks=rng.randrange(4000, 16_000), kv_cached_blocks=16_000, kv_total_blocks=16_384)


def fill(index: KvIndex, n: int, target: int, rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """Store sequences until ~``target`` new entries; returns samples of sequences and families."""
    bits = rng.getrandbits
    systems = [[bits(64), bits(64)] for _ in range(64)]
    families: list[list[int]] = []
    homes: list[int] = []
    seqs = [0] * n
    sample: list[list[int]] = []
    emitted = 0
    while emitted < target:
        if not families or rng.random() < 0.125:
            families.append(rng.choice(systems) + [bits(64) for _ in range(rng.randrange(7))])
            homes.append(rng.randrange(n))
            fam = len(families) - 1
        else:
            fam = rng.randrange(len(families))
        prefix = families[fam]
        hashes = prefix + [bits(64) for _ in range(SEQ - len(prefix))]
        w = homes[fam] if rng.random() < 0.8 else rng.randrange(n)
        index.apply_event(BlockStored(f"w{w}", seqs[w], tuple(hashes)), 0.0)
        seqs[w] += 1
        emitted += SEQ - len(prefix)
        if len(sample) < 4096:
            sample.append(hashes)
        elif rng.random() < 0.01:
            sample[rng.randrange(4096)] = hashes
    return sample, families[-4096:]


class Fleet:
    """One fleet size: its index (filled), view, router and queries."""

    def __init__(self, n: int, entries: int, queries: int, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        self.n = n
        cfg = RoutingConfig(seed=seed)
        self.index = KvIndex(prediction_ttl=cfg.prediction_ttl, double_hash=False)
        for i in range(n):
            self.index.add_worker(f"w{i}")
        before = _rss()
        t0 = time.perf_counter()
        sample, families = fill(self.index, n, entries, rng)
        self.fill_s = time.perf_counter() - t0
        self.entries = sum(self.index.num_blocks(f"w{i}") for i in range(n))
        self.bytes_per_entry = (_rss() - before) / self.entries
        self.view = FleetView(cfg, [WorkerState(f"w{i}", BLOCK, 8192, 64, _load(rng, f"w{i}")) for i in range(n)])
        self.router = KvRouter(cfg, self.index, random.Random(seed))
        self.queries: list[list[int]] = []
        for q in range(queries):
            kind = q % 3
            if kind == 0:
                self.queries.append(rng.choice(sample))
            elif kind == 1:
                p = rng.choice(families)
                self.queries.append(p + [rng.getrandbits(64) for _ in range(SEQ - len(p))])
            else:
                self.queries.append([rng.getrandbits(64) for _ in range(SEQ)])
        self.times: list[int] = []
        self.updates: list[int] = []

    def decide(self, q: int, now: float) -> None:
        perf = time.perf_counter_ns
        view = self.view
        t = perf()
        d = self.router.route(RouteRequest(f"r{q}", SEQ * BLOCK, self.queries[q]), view, now)
        self.times.append(perf() - t)
        # the driver's side: the winner's queue grows, another worker reports a new load
        i = view.position(d.worker_id)
        assert i is not None
        old = view[i].load
        grown = LoadReport(old.worker_id, now, old.running, old.waiting + 1,
                           old.queued_prefill_tokens + SEQ * BLOCK - d.overlap_blocks * BLOCK, old.decode_tokens,
                           old.kv_active_blocks, old.kv_cached_blocks, old.kv_total_blocks)
        j = self.rng.randrange(self.n)
        fresh = _load(self.rng, f"w{j}")
        t = perf()
        view.set_load(i, grown)
        view.set_load(j, fresh)
        self.updates.append((perf() - t) // 2)

    def row(self) -> dict[str, float]:
        times = sorted(self.times)
        return {"workers": self.n, "entries": self.entries, "bytes_per_entry": self.bytes_per_entry,
                "fill_s": self.fill_s, "p50_us": median(times) / 1e3,
                "p99_us": times[int(0.99 * (len(times) - 1))] / 1e3, "set_load_us": median(self.updates) / 1e3}


def run(at_1000: int, queries: int, seed: int, sizes: tuple[int, ...] = SIZES, keep: bool = False) -> Any:
    """Fill every size (RSS growth of each fill: nothing is freed in between), then time the
    decisions interleaved, rotating the order, so CPU noise on a shared machine hits all alike."""
    fleets = [Fleet(n, at_1000 * n // 1000, queries, seed) for n in sizes]
    # The filled indexes are millions of long-lived objects: without this, each full collection of
    # the cyclic GC (triggered by the decisions' own allocations) walks them all and lands, tens of
    # ms at a time, inside whichever decision is running. A long-running router does the same
    # (gc.freeze after warm-up); the decisions themselves are what is measured here.
    gc.collect()
    gc.freeze()
    now = 1.0
    for q in range(queries):
        now += 0.001
        for k in range(len(fleets)):
            fleets[(q + k) % len(fleets)].decide(q, now)
    gc.unfreeze()
    rows = [f.row() for f in fleets]
    return (rows, fleets) if keep else rows


def one_out(fleet: Fleet, queries: int) -> dict[str, float]:
    """Decisions at one size with one worker out of routing (unavailable, a breaker open): on a view of
    the others, which the registry hands the router now (``WorkerRegistry.routable(excluding)``), against
    a plain list of them, which it handed before (the router then scores every worker), interleaved."""
    rest = [w for w in fleet.view if w.worker_id != "w1"]
    ways = {"view": FleetView(fleet.view.cfg, rest), "list": rest}
    times: dict[str, list[int]] = {k: [] for k in ways}
    perf = time.perf_counter_ns
    gc.collect()
    gc.freeze()
    for q in range(queries):
        for k, ws in ways.items():
            t = perf()
            fleet.router.route(RouteRequest(f"o{q}{k}", SEQ * BLOCK, fleet.queries[q % len(fleet.queries)]), ws,
                               2.0 + q * 1e-3, predict=False)
            times[k].append(perf() - t)
    gc.unfreeze()
    out: dict[str, float] = {}
    for k, v in times.items():
        v.sort()
        out[f"{k}_p50_us"], out[f"{k}_p99_us"] = median(v) / 1e3, v[int(0.99 * (len(v) - 1))] / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="routing decision time vs fleet size")
    ap.add_argument("--quick", action="store_true", help="1/10 of the entries, fewer queries")
    ap.add_argument("--queries", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one-out", action="store_true", help="also: 1,000 workers with one out of routing, a view "
                    "of the rest against a plain list of them")
    args = ap.parse_args()
    queries = args.queries or (1000 if args.quick else 3000)
    at_1000 = ENTRIES_AT_1000 // (10 if args.quick else 1)
    t0 = time.perf_counter()
    rows, fleets = run(at_1000, queries, args.seed, keep=True)
    print(f"routing decision vs fleet size: kv_aware over a fleet view (candidate_limit "
          f"{RoutingConfig().candidate_limit}; fleets of up to {RoutingConfig().whole_scan_max_workers} workers "
          f"scored whole), 1,024-token prompts, {queries} queries per size (1/3 hit, "
          f"1/3 partial, 1/3 miss), explanation not built")
    print_table("KvRouter.route per decision (µs) and index memory", [
        "workers", "entries", "p50 µs", "p99 µs", "set_load µs", "bytes/entry", "fill s"], [
        [int(r["workers"]), f"{int(r['entries']):,}", r["p50_us"], r["p99_us"], r["set_load_us"],
         r["bytes_per_entry"], r["fill_s"]] for r in rows])
    small, big = rows[0], rows[-1]
    p50 = big["p50_us"] / small["p50_us"]
    p99 = big["p99_us"] / small["p99_us"]
    ok = p50 <= 3.0 and p99 <= 3.0
    print(f"ratio {int(big['workers'])} vs {int(small['workers'])} workers: p50 {p50:.2f}x, p99 {p99:.2f}x")
    print(f"target <= 3x (p50 and p99): {'MET' if ok else 'NOT MET'}")
    print(native_state().summary)  # which build was timed
    print(f"index bytes per (block, worker) entry at {int(big['workers'])} workers: {big['bytes_per_entry']:.0f}")
    if args.one_out:
        o = one_out(fleets[-1], min(queries, 1000))
        print(f"one worker out of routing, {int(big['workers'])} workers: a view of the rest p50 {o['view_p50_us']:.0f} "
              f"µs p99 {o['view_p99_us']:.0f} µs; a plain list (before) p50 {o['list_p50_us']:.0f} µs p99 "
              f"{o['list_p99_us']:.0f} µs ({o['list_p50_us'] / o['view_p50_us']:.1f}x the view's p50)")
    print(f"elapsed {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
