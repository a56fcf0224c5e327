"""The simulator at 8, 64, 256 and 1,000 workers (issue 12's scale runs): traffic scaled to the fleet,
then per fleet size the routing decision time, the index's size and bytes per entry, the simulator's
wall time, and the KV-event load a frontend replica must ingest, against what one core ingests.

Traffic: ``thunderagent sim --generate chat`` (``sim.generators.fleet_traffic``): 5-turn conversations
sharing a 1,024-token system prompt, the same requests per worker and arrivals per worker per second
at every size. Workers: the default simulated node with ``--kv-blocks`` blocks (default 2,048, so the
caches fill and evict: the event stream holds removals as well as stores, as a full fleet's does).

Per size, one replay (``Simulator.run``, kv_aware):
- **decision**: wall time of each routing decision as the simulator's driver times it (prompt
  hashing, admission, the router: index match, scoring, choice, prediction), p50 and p99;
- **index**: (block, worker) entries at the end of the run, and their bytes (a walk of the index's
  maps, sets and the int objects they hold, each object counted once), per entry;
- **replay**: wall seconds of ``Simulator.run`` and per request;
- **KV events**: blocks named by the events the index took (stored + removed), per virtual second,
  per worker and for the fleet. One frontend replica ingests all of them (``thunderagent frontend``
  over NATS: every frontend hears every worker). The capacity it is compared with is measured in the
  same run: ``KvIndex.apply_event`` of stored blocks in one process (``bench/index_ingest.py``'s
  workload), the bound for one core; over NATS a frontend reached 0.22-0.24x of it on this machine
  (``bench/nats_events.py``, README "Many processes over NATS").

Run: ``python bench/sim_scale.py`` (~6 minutes: most of it the 1,000-worker replay, ~2.3 GB of memory),
``--sizes 8 64`` for a quick look, ``--plot FILE`` for a PNG (matplotlib, the ``plots`` extra).
Target (issue 12): decision time at 1,000 workers <= 3x the time at 8 (p50 and p99).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table  # noqa: E402
from index_ingest import run as ingest_run  # noqa: E402

from thunderagent.config import NodeConfig, Policy, RoutingConfig  # noqa: E402
from thunderagent.engine.timing import make_timing  # noqa: E402
from thunderagent.kv.index import KvIndex  # noqa: E402
from thunderagent.sim.driver import Simulator  # noqa: E402
from thunderagent.sim.generators import fleet_traffic  # noqa: E402

SIZES = (8, 64, 256, 1000)


def index_bytes(index: KvIndex) -> tuple[int, int]:
    """(entries, bytes) of ``index``: (block, worker) entries, and the memory of its maps, sets and the
    objects they hold (each object once: a hash held in several maps is one int). Reads the index's
    internals: this is a measurement, not an API."""
    seen: set[int] = set()
    total = 0

    def add(o: object) -> None:
        nonlocal total
        if id(o) not in seen:
            seen.add(id(o))
            total += sys.getsizeof(o)

    for m in (index._confirmed, index._predicted):
        add(m)
        for k, v in m.items():
            add(k)
            add(v)
    add(index._workers)
    entries = 0
    for w in index._workers.values():
        add(w)
        add(w.blocks)
        entries += len(w.blocks)
        for h in w.blocks:
            add(h)
    add(index._expiry_queue)
    for item in index._expiry_queue:
        add(item)
    return entries, total


def replay(workers: int, per_worker: int, rate: float, kv_blocks: int, seed: int) -> dict[str, float]:
    reqs = fleet_traffic("chat", workers, per_worker, rate, seed=seed)
    sim = Simulator(NodeConfig(kv_blocks=kv_blocks), RoutingConfig(), workers, Policy.kv_aware, seed=seed)
    gc.collect()
    t0 = time.perf_counter()
    out = sim.run(reqs, 1.0)
    wall = time.perf_counter() - t0
    r = out.result
    assert r.decision_us is not None
    entries, nbytes = index_bytes(sim.index)
    duration = float(r.extra["duration_s"])  # type: ignore[arg-type]
    events = float(r.extra["kv_event_blocks"]) / duration  # type: ignore[arg-type]
    return {"workers": workers, "requests": r.requests, "p50": r.decision_us.p50, "p99": r.decision_us.p99,
            "entries": entries, "bytes_per_entry": nbytes / entries if entries else float("nan"),
            "index_mb": nbytes / 2**20, "wall": wall, "wall_ms_per_req": wall / r.requests * 1e3,
            "events_per_s": events, "events_per_worker_s": events / workers, "ttft_p50": r.ttft_ms.p50,
            "reuse": r.prefix_reuse}


def saturated_blocks_per_s(node: NodeConfig) -> float:
    """KV-event blocks per second of one worker that prefills flat out (full ``max_num_batched_tokens``
    passes, the timing model's time) with a full cache: every stored block evicts one (x2)."""
    m = node.max_num_batched_tokens
    return 2 * m / make_timing(node.timing).pass_time(m, 0, 1, False) / node.block_size


def plot(rows: list[dict[str, float]], ingest: float, saturated: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = [r["workers"] for r in rows]
    fig, ax = plt.subplots(1, 4, figsize=(19, 4.2))
    ax[0].plot(w, [r["p50"] for r in rows], "o-", label="p50")
    ax[0].plot(w, [r["p99"] for r in rows], "s-", label="p99")
    ax[0].set(xscale="log", ylim=(0, None), xlabel="workers", ylabel="µs", title="routing decision (hash + route)")
    ax[0].legend()
    ax[1].plot(w, [r["wall_ms_per_req"] for r in rows], "o-")
    ax[1].set(xscale="log", ylim=(0, None), xlabel="workers", ylabel="ms", title="replay wall time per request")
    ax[2].plot(w, [r["bytes_per_entry"] for r in rows], "s-", color="C1")
    ax[2].set(xscale="log", ylim=(0, None), xlabel="workers", ylabel="bytes", title="index bytes per (block, worker) entry")
    ax[3].plot(w, [r["events_per_s"] for r in rows], "o-", label="KV-event blocks/s (this traffic)")
    ax[3].plot(w, [saturated * n for n in w], "k-.", label="every worker prefilling flat out")
    ax[3].axhline(ingest, color="g", ls="--", label="one core ingests (in process)")
    ax[3].axhline(0.23 * ingest, color="r", ls=":", label="over NATS (0.23x, measured)")
    ax[3].set(xscale="log", yscale="log", xlabel="workers", title="what one frontend replica must ingest")
    ax[3].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--requests-per-worker", type=int, default=60)
    ap.add_argument("--rate-per-worker", type=float, default=1.0, help="arrivals per worker per second")
    ap.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per worker (64 tokens each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    a = ap.parse_args()
    ingest = ingest_run(2000, 8, 3, a.seed, with_peer=False)["ours_bps"]
    rows = [replay(n, a.requests_per_worker, a.rate_per_worker, a.kv_blocks, a.seed) for n in a.sizes]
    base = rows[0]
    print(f"chat traffic, {a.requests_per_worker} requests per worker at {a.rate_per_worker:g}/s per worker, "
          f"{a.kv_blocks} KV blocks per worker; kv_aware")
    print_table("per fleet size", ["workers", "requests", "decision p50 µs", "p99 µs", "p50 / first", "p99 / first",
                                   "index entries", "bytes / entry", "index MB", "replay s", "ms / request",
                                   "KV blocks/s", "per worker", "TTFT p50 ms", "reuse"],
                [[int(r["workers"]), int(r["requests"]), f"{r['p50']:.0f}", f"{r['p99']:.0f}",
                  f"{r['p50'] / base['p50']:.2f}", f"{r['p99'] / base['p99']:.2f}", f"{int(r['entries']):,}",
                  f"{r['bytes_per_entry']:.0f}", f"{r['index_mb']:.1f}", f"{r['wall']:.1f}",
                  f"{r['wall_ms_per_req']:.2f}", f"{r['events_per_s']:,.0f}", f"{r['events_per_worker_s']:.1f}",
                  f"{r['ttft_p50']:.0f}", f"{100 * r['reuse']:.1f} %"] for r in rows])
    sat = saturated_blocks_per_s(NodeConfig(kv_blocks=a.kv_blocks))
    print(f"\none core ingests {ingest:,.0f} blocks/s in process (KvIndex.apply_event), ~{0.23 * ingest:,.0f} over "
          "NATS (0.23x, README). A full index replica per frontend takes that core at:")
    for label, per_worker in (("this traffic", max(r["events_per_worker_s"] for r in rows)),
                              ("every worker prefilling flat out, cache full", sat)):
        print(f"  {label} ({per_worker:,.0f} blocks/s per worker): ~{ingest / per_worker:,.0f} workers in process, "
              f"~{0.23 * ingest / per_worker:,.0f} over NATS")
    last = rows[-1]
    print(f"decision time at {int(last['workers'])} vs {int(base['workers'])} workers: p50 {last['p50'] / base['p50']:.2f}x, "
          f"p99 {last['p99'] / base['p99']:.2f}x (target <= 3x)")
    if a.plot is not None:
        plot(rows, ingest, sat, a.plot)


if __name__ == "__main__":
    main()
