"""What the scheduler adds to a request: enqueue + dispatch with 1,000 requests held, 16 workers,
1,000 programs (issue 9 target: <= 1 ms p99), against routing at once in the same run.

Setup: an index holding 1,000 programs' contexts (2,048-token prompts sharing a 512-token system
prompt, each on one of 16 workers), the holding queue kept at 1,000 requests over 50 route keys and 3
priority tiers. Each timed step is one new request: ``Dispatcher.prepare`` (hash) + ``submit``
(queued: it finds the queue non-empty) + one ``pump`` (pick by tier / DRR / short-first, route, take)
with workers that can start one. The baseline is the same request through ``prepare`` + ``dispatch``
(routing at once, no scheduler). Medians and p99 in microseconds, and the ratio.

A third row runs the held path with program pacing on (``scheduler.pacing``): every request names
one of the 1,000 programs, and the pacing tick (every second of the virtual clock, which advances 1 ms
per request) is timed on its own: it walks every program's blocks.

``--clock cpu`` times with the thread's CPU clock instead of the wall clock: on a shared machine the
wall clock's tail is other processes' time slices, not ours.

A fourth row pumps with half the workers unable to start a request (their engines report a queue):
there the dispatch re-ranks the next ``scheduler.affinity_candidates`` requests of the chosen route key by
their uncached tokens on the free workers (``scheduler/affinity.py``), one index match each.

The garbage collector: the first two paths run first under CPython's default collector (the last two
rows), then again under the policy the serving processes apply after start-up
(``thunderagent.gc_policy.tune_gc``: start-up frozen, young threshold 20,000); the targets are judged on
the latter, as ``serve`` runs. The default's full collections over the growing heap were most of the p99.

Run: ``python bench/scheduler_overhead.py [--quick] [--clock cpu]``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from _common import median, print_table

from thunderagent.config import PacingConfig, RoutingConfig, SchedulerConfig
from thunderagent.gc_policy import tune_gc
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.types import BlockStored, LoadReport, WorkerState

WORKERS = 16
PROGRAMS = 1000
HELD = 1000
BLOCK = 64


def prompt(program: int, turn: int) -> list[int]:
    system = list(range(512))
    return system + [100_000 + program * 10 + (i % 7) for i in range(1536 + 64 * turn)]


def build(scheduler: bool, pacing: bool = False) -> tuple[Dispatcher, list[WorkerState]]:
    index = KvIndex(prediction_ttl=120.0)
    workers = []
    for w in range(WORKERS):
        wid = f"w{w}"
        index.add_worker(wid)
        workers.append(WorkerState(wid, BLOCK, 8192, 64, LoadReport(wid, 0.0, 4, 0, 0, 20_000, 500, 5000, 16384)))
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), BLOCK,
                   SchedulerConfig(enabled=scheduler, max_queued=10 * HELD, max_queued_per_key=10 * HELD,
                                   pacing=PacingConfig(enabled=pacing)))
    seqs = [0] * WORKERS
    for p in range(PROGRAMS):  # each program's context is cached on its home worker
        w = p % WORKERS
        index.apply_event(BlockStored(f"w{w}", seqs[w], tuple(d.prepare("x", prompt(p, 0), 1).block_hashes)), 0.0)
        seqs[w] += 1
    return d, workers


def percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * (len(ys) - 1) + 0.5))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter; cpu: this thread's CPU time (excludes other processes' slices)")
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    steps = 500 if args.quick else 5000
    # CPython's default collector first, then the policy `serve`, `frontend` and `worker` apply after start-up
    # (thunderagent.gc_policy): the targets are judged as those processes run
    default_ours, _ = held_path(steps, pacing=False, clock=clock)
    default_paced, _ = held_path(steps, pacing=True, clock=clock)
    tune_gc()
    ours, ticks = held_path(steps, pacing=False, clock=clock)
    paced, ticks = held_path(steps, pacing=True, clock=clock)
    affine, _ = held_path(steps, pacing=False, clock=clock, half_full=True)
    rng = random.Random(7)
    plain_d, workers = build(False)
    base = []
    now = 1.0
    for k in range(steps):
        p = rng.randrange(PROGRAMS)
        toks = prompt(p, 1 + k % 3)
        now += 0.001
        t1 = clock()
        req2 = plain_d.prepare(f"n{k}", toks, 16, priority=rng.randrange(3))
        plain_d.dispatch(req2, workers, now)
        base.append((clock() - t1) * 1e6)
    rows = [("held: prepare + submit + pump", f"{median(ours):.1f}", f"{percentile(ours, 0.99):.1f}"),
            ("held, programs paced: same", f"{median(paced):.1f}", f"{percentile(paced, 0.99):.1f}"),
            ("held, half the fleet full (cache affinity)", f"{median(affine):.1f}", f"{percentile(affine, 0.99):.1f}"),
            ("at once: prepare + dispatch", f"{median(base):.1f}", f"{percentile(base, 0.99):.1f}"),
            ("held, CPython's default GC", f"{median(default_ours):.1f}", f"{percentile(default_ours, 0.99):.1f}"),
            ("paced, CPython's default GC", f"{median(default_paced):.1f}", f"{percentile(default_paced, 0.99):.1f}")]
    print_table(f"{steps} requests, {HELD} held, {WORKERS} workers, {PROGRAMS} programs (µs, {args.clock} clock)",
                ("path", "median", "p99"), rows)
    for name, xs in (("scheduler", ours), ("scheduler + pacing", paced), ("scheduler, cache affinity", affine)):
        p99 = percentile(xs, 0.99)
        print(f"{name} path p99 {p99 / 1e3:.3f} ms (target <= 1 ms: {'met' if p99 <= 1000 else 'MISSED'}); "
              f"median {median(xs) / median(base):.2f}x routing at once")
    print(f"pacing tick over {PROGRAMS} programs: median {median(ticks) / 1e3:.1f} ms, max {max(ticks) / 1e3:.1f} ms "
          f"({len(ticks)} ticks; once per tick_s, not per request)")


def held_path(steps: int, *, pacing: bool, clock: Callable[[], float] = time.perf_counter,
              half_full: bool = False) -> tuple[list[float], list[float]]:
    """Per request: prepare + submit + pump with the queue held at HELD; with ``pacing`` each request
    names a program and the pacing ticks (run inside submit when due) are timed apart. ``half_full``: the
    pump sees half the workers unable to start a request, so the cache-affinity pick re-ranks its
    ``affinity_candidates`` (``scheduler/affinity.py``: one index match each) at every dispatch."""
    rng = random.Random(7)
    held_d, workers = build(True, pacing)
    busy = [WorkerState(w.worker_id, BLOCK, 8192, 64, LoadReport(w.worker_id, 0.0, 4, 2, 9000, 0, 0, 0, 16384))
            for w in workers]
    for k in range(HELD):  # fill the queue while no worker can start anything
        p = rng.randrange(PROGRAMS)
        req = held_d.prepare(f"h{k}", prompt(p, 1), 16, priority=rng.randrange(3))
        held_d.submit(req, f"key{k % 50}", busy, 0.0, program=f"p{p}" if pacing else None)
    held_d.tick(workers, 0.0)
    mixed = workers[: WORKERS // 2] + busy[WORKERS // 2:]
    out, ticks = [], []
    now = 1.0
    for k in range(steps):
        p = rng.randrange(PROGRAMS)
        toks = prompt(p, 1 + k % 3)
        pr = rng.randrange(3)
        now += 0.001
        if pacing and now >= held_d.pacer.next_tick:  # type: ignore[union-attr]
            t = clock()
            held_d.tick(workers, now)
            ticks.append((clock() - t) * 1e6)
        t0 = clock()
        req = held_d.prepare(f"n{k}", toks, 16, priority=pr)
        held_d.submit(req, f"key{k % 50}", workers, now, program=f"p{p}" if pacing else None)
        d = held_d.pump(mixed if half_full else workers, now)
        out.append((clock() - t0) * 1e6)
        assert d is not None and len(held_d.queue) == HELD
    return out, ticks


if __name__ == "__main__":
    main()
