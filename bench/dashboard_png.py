"""Render docs/dashboard.png: the Grafana dashboard's seed panels, from real scrapes of a live simulated server.

No Grafana server runs here, so this draws with matplotlib what the panels' PromQL computes: it serves a
3-worker simulated fleet in-process (one worker 20x slower, routed round robin, so it becomes the hot worker),
sends a rising then falling stream of requests sharing a few prefixes, scrapes ``/health`` and ``/metrics``
every second and computes each panel's series over consecutive scrapes with ``thunderagent top``'s code
(rates over the window, histogram quantiles from bucket deltas).

    python bench/dashboard_png.py [--seconds 30] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import aiohttp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from aiohttp import web  # noqa: E402

from thunderagent.cli.top import scrape  # noqa: E402
from thunderagent.cli.top_view import build_frame  # noqa: E402
from thunderagent.config import parse_config  # noqa: E402
from thunderagent.frontend.app import create_app  # noqa: E402
from thunderagent.frontend.server import FrontendRunner  # noqa: E402

CONFIG = {
    "execution_group": {"nodes": [{"count": 2}, {"count": 1, "max_batch_size": 2, "timing": {"speedup": 0.05}}]},
    "routing": {"policy": "round_robin", "seed": 7},
    "scheduler": {"enabled": False},
    "simulation": {"speedup": 20.0},
}
PREFIXES = [f"system prompt of agent {k}: you are a careful assistant. " * 12 for k in range(4)]


async def _traffic(base: str, seconds: float, stop: asyncio.Event) -> None:
    rng = random.Random(0)
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            body = {"model": "thunderagent-sim", "prompt": rng.choice(PREFIXES) + f"task {i}", "max_tokens": 24}
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                await resp.read()
        tasks: set[asyncio.Task[None]] = set()
        i = 0
        while not stop.is_set():
            phase = (time.monotonic() - t0) / seconds
            rate = 5 + 45 * (1 - abs(2 * phase - 1))  # 5 -> 50 -> 5 requests/s
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(seconds: float) -> list[tuple[float, object]]:
    runner = FrontendRunner(create_app(parse_config(CONFIG, "dashboard")))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    stop = asyncio.Event()
    traffic = asyncio.create_task(_traffic(base, seconds, stop))
    frames, prev, t0 = [], None, time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(1.0)
            cur = await asyncio.to_thread(scrape, base, None)
            if prev is not None:
                frames.append((cur.t - t0, build_frame(cur, prev)))
            prev = cur
    finally:
        stop.set()
        await traffic
        await runner.cleanup()
    return frames


def render(frames: list, out: Path) -> None:
    t = [s for s, _ in frames]
    fs = [f for _, f in frames]
    workers = [w.id for w in fs[-1].workers]
    fig, axes = plt.subplots(3, 3, figsize=(12, 7.5), dpi=72)
    panels = [
        ("Cache hit rate (router predicted)", {"predicted hit rate": [f.hit_rate for f in fs]}),
        ("Cache reuse rate (cached ÷ prompt tokens)", {"reuse rate": [f.reuse_rate for f in fs]}),
        ("Prefill recompute rate", {"recompute rate": [f.recompute_rate for f in fs]}),
        ("Hot worker queue depth and skew", {
            "hottest queue": [max((w.waiting for w in f.workers), default=0) for f in fs],
            "skew (max ÷ median)": [f.queue_skew for f in fs]}),
        ("KV memory water level", {w: [next(x.kv_usage for x in f.workers if x.id == w) for f in fs]
                                   for w in workers} | {"max": [max(x.kv_usage for x in f.workers) for f in fs]}),
        ("TTFT (s)", {f"p{int(q * 100)}": [f.ttft.get(q) for f in fs] for q in (0.5, 0.9, 0.99)}),
        ("ITL (s)", {f"p{int(q * 100)}": [f.itl.get(q) for f in fs] for q in (0.5, 0.9, 0.99)}),
        ("Decisions: routed per worker (/s)", {w: [next(x.routed_per_s for x in f.workers if x.id == w) for f in fs]
                                               for w in workers}),
        ("Per worker: queue depth", {w: [next(x.waiting for x in f.workers if x.id == w) for f in fs]
                                     for w in workers}),
    ]
    for ax, (title, series) in zip(axes.flat, panels):
        for label, ys in series.items():
            ax.plot(t, [float("nan") if y is None else y for y in ys], label=label, linewidth=1.4)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    fig.suptitle("ThunderAgent fleet: 3 simulated workers (worker-2 20x slower), round robin; x: seconds",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "dashboard.png")
    args = ap.parse_args()
    frames = asyncio.run(collect(args.seconds))
    render(frames, args.out)
    print(f"{args.out}: {len(frames)} scrapes, {args.out.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
