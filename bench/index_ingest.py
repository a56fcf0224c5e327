"""KV-event ingest throughput: ``KvIndex.apply_event`` vs Dynamo's ``RadixTree.apply_event``.

Workload: stored events of 64 blocks each, spread over 8 workers; half start a new sequence
(``parent_hash`` None), half continue the worker's previous sequence (``parent_hash`` = its last
block), as an engine's prefix cache would report them. Hashes are random 64-bit ints (ingest does
not hash tokens). Each round ingests the same events into a fresh index of each kind, alternating
which goes first; we report the median over rounds.

What is timed:
- ours: ``KvIndex.apply_event(BlockStored(...), now)`` with the event objects built beforehand
  (decoding the engine's msgpack into ``BlockStored`` is not counted; building the dataclass is
  reported on its own line).
- peer: ``RadixTree.apply_event(worker_id, json_bytes)``, which includes Dynamo's JSON decode of the
  event. Producing the JSON bytes (``json.dumps(...).encode()``) is EXCLUDED from the peer figure and
  reported on its own line.

Run: ``python bench/index_ingest.py [--quick]``. Higher blocks/s is better. Target: ours >= 1 M
blocks/s.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import dynamo_version, load_dynamo, median, print_table, ratio  # noqa: E402

from thunderagent.kv.index import KvIndex  # noqa: E402
from thunderagent.types import BlockStored  # noqa: E402

BLOCKS_PER_EVENT = 64


def make_events(n_events: int, n_workers: int, seed: int) -> list[tuple[int, int, list[int], list[int], int | None]]:
    """``(worker, seq, block_hashes, tokens_hashes, parent)`` per event."""
    rng = random.Random(seed)
    last: list[int | None] = [None] * n_workers
    seqs = [0] * n_workers
    out = []
    for _ in range(n_events):
        w = rng.randrange(n_workers)
        parent = last[w] if last[w] is not None and rng.random() < 0.5 else None
        hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
        local = [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
        out.append((w, seqs[w], hashes, local, parent))
        seqs[w] += 1
        last[w] = hashes[-1]
    return out


def run(n_events: int = 2000, n_workers: int = 8, rounds: int = 5, seed: int = 0,
        with_peer: bool = True) -> dict[str, float]:
    """Returns median blocks/s per contender (and the side costs), over ``rounds`` rounds."""
    dyn = load_dynamo()[0] if with_peer else None
    events = make_events(n_events, n_workers, seed)
    n_blocks = n_events * BLOCKS_PER_EVENT
    wids = [f"w{i}" for i in range(n_workers)]
    perf = time.perf_counter

    def build_ours() -> list[BlockStored]:
        return [BlockStored(wids[w], s, tuple(h), p) for w, s, h, _l, p in events]

    def encode_peer() -> list[tuple[int, bytes]]:
        return [
            (w, json.dumps({"event_id": s, "data": {"stored": {
                "parent_hash": p, "blocks": [{"block_hash": b, "tokens_hash": t} for b, t in zip(h, lo)]}}},
                separators=(",", ":")).encode())
            for w, s, h, lo, p in events
        ]

    ours_bps, build_bps, peer_bps, enc_bps = [], [], [], []
    ours_entries = peer_ok = 0
    for r in range(rounds):
        t0 = perf()
        objs = build_ours()
        build_bps.append(n_blocks / (perf() - t0))
        wire = None
        if dyn is not None:
            t0 = perf()
            wire = encode_peer()
            enc_bps.append(n_blocks / (perf() - t0))

        def ours() -> None:
            nonlocal ours_entries
            idx = KvIndex(prediction_ttl=5.0)
            for wid in wids:
                idx.add_worker(wid)
            apply = idx.apply_event
            t = perf()
            for ev in objs:
                apply(ev, 0.0)
            ours_bps.append(n_blocks / (perf() - t))
            ours_entries = idx.num_blocks()

        def peer() -> None:
            nonlocal peer_ok
            tree = dyn.RadixTree()
            apply = tree.apply_event
            t = perf()
            for w, body in wire:
                apply(w, body)
            peer_bps.append(n_blocks / (perf() - t))
            # sanity: the first event (a root) is found whole on its worker
            w, _s, _h, lo, _p = events[0]
            peer_ok = int(tree.find_matches(lo).scores.get((w, 0), 0) == len(lo))

        order = (ours, peer) if r % 2 == 0 else (peer, ours)
        for f in order:
            if f is peer and dyn is None:
                continue
            f()
    res = {
        "blocks": float(n_blocks),
        "events": float(n_events),
        "ours_bps": median(ours_bps),
        "ours_build_bps": median(build_bps),
        "ours_entries": float(ours_entries),
    }
    if dyn is not None:
        res.update({"peer_bps": median(peer_bps), "peer_encode_bps": median(enc_bps), "peer_check": float(peer_ok)})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description="KV event ingest throughput vs Dynamo")
    ap.add_argument("--quick", action="store_true", help="fewer events and rounds (a few seconds)")
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n_events = args.events or (500 if args.quick else 4000)
    rounds = args.rounds or (3 if args.quick else 5)
    dyn, why = load_dynamo()
    t0 = time.perf_counter()
    r = run(n_events, 8, rounds, args.seed, with_peer=dyn is not None)
    elapsed = time.perf_counter() - t0
    print(f"index ingest: {int(r['events']):,} stored events x {BLOCKS_PER_EVENT} blocks "
          f"= {int(r['blocks']):,} blocks per round, 8 workers, {rounds} rounds (fresh index each)")
    print(f"peer: ai-dynamo-runtime {dynamo_version()}" if dyn else f"peer: skipped: {why}")
    p = (lambda k: r.get(k, float("nan")))
    print_table("median blocks/s (higher is better; ratio > 1 = ours faster)",
                ["contender", "blocks/s", "ours/dynamo"], [
                    ["ours  KvIndex.apply_event(BlockStored)", p("ours_bps"), ratio(p("ours_bps"), p("peer_bps"))],
                    ["dynamo RadixTree.apply_event(json bytes)", p("peer_bps"), ""],
                ])
    print_table("side costs, NOT in the figures above (blocks/s)", ["step", "blocks/s"], [
        ["ours: build BlockStored objects", p("ours_build_bps")],
        ["dynamo: json.dumps(...).encode() of its events", p("peer_encode_bps")],
    ])
    checks = f"ours holds {int(p('ours_entries')):,} entries (expected {int(r['blocks']):,})"
    if dyn:
        checks += f"; dynamo finds the first event whole: {'yes' if p('peer_check') == 1.0 else 'NO'}"
    print(checks)
    print("dynamo's figure includes its own JSON decode (inside apply_event); ours starts from a built event.")
    ok = p("ours_bps") >= 1e6
    print(f"target ours >= 1 M blocks/s: {'MET' if ok else 'NOT MET'} ({p('ours_bps') / 1e6:.2f} M)")
    print(f"elapsed {elapsed:.1f} s")


if __name__ == "__main__":
    main()
