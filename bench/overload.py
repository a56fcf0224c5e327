"""Overload: `thunderagent serve` with 2 simulated workers, driven at 3x what they sustain.

One run, in this order, against one server process (its own config, defaults otherwise):

1. **idle**: requests one at a time for a few seconds (every request finds an idle engine);
2. **capacity**: a closed loop with far more clients than the workers have sequence slots: the
   completions per second the fleet sustains (429s are not counted; a refused client backs off);
3. **unloaded**: an open loop at a quarter of that capacity: the TTFT baseline (a lightly loaded
   fleet: a request may land while an engine is mid-pass, which an idle engine never makes it wait);
4. **overload**: an open loop at ``--factor`` x that capacity for ``--duration`` seconds: statuses,
   ``Retry-After`` on the 429s, admitted requests' TTFT, the server's RSS (``/proc``) every 0.5 s;
5. **after**: the server's RSS once the load is gone, its ``/health``, its liveness counters
   (``thunderagent_worker_lease_expired``, ``thunderagent_index_purged_entries``) and a request served.

Ratios are against the unloaded run measured in the same run, so they hold on a busy shared machine.

Run: ``.venv/bin/python bench/overload.py`` (60 s at 3x; ``--duration 15`` for a quick look).
``tests/integration/test_overload.py`` runs the same code for a few seconds and asserts on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

MODEL = "thunderagent-sim"

#: the workers' shape: few sequence slots, so two simulated workers saturate at a request rate a
#: 2-core machine can drive and serve (tens per second), not at the frontend's own limit
CONFIG = """\
execution_group:
  nodes:
    - count: 2
      max_batch_size: {slots}
      timing: {{speedup: {engine_speed}}}
routing: {{seed: 1}}
"""


@dataclass(slots=True)
class Shot:
    status: int
    sent: float  # loop time the request left
    ttft: float | None = None  # seconds to the first token (200s only)
    retry_after: str | None = None


@dataclass
class Phase:
    name: str
    shots: list[Shot] = field(default_factory=list)
    seconds: float = 0.0

    def ok(self) -> list[Shot]:
        return [s for s in self.shots if s.status == 200]

    def count(self, status: int) -> int:
        return sum(1 for s in self.shots if s.status == status)

    def ttft_p(self, q: float) -> float:
        xs = sorted(s.ttft for s in self.ok() if s.ttft is not None)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]


def _prompt(i: int) -> str:
    # a distinct first block per request: no cache reuse, every request prefills its whole prompt
    return f"{i:08d} request about file {i * 7919 % 10007}: " + "summarise the change and list the risks. " * 6


async def shoot(session: aiohttp.ClientSession, base: str, i: int, max_tokens: int) -> Shot:
    """One streaming completion; TTFT is the first event with text."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    body = {"model": MODEL, "prompt": _prompt(i), "max_tokens": max_tokens, "stream": True}
    try:
        async with session.post(base + "/v1/completions", json=body) as r:
            shot = Shot(r.status, t0, retry_after=r.headers.get("Retry-After"))
            if r.status != 200:
                await r.read()
                return shot
            async for line in r.content:
                if shot.ttft is None and line.startswith(b"data: {"):
                    shot.ttft = loop.time() - t0
            return shot
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Shot(-1, t0)


async def unloaded(session: aiohttp.ClientSession, base: str, seconds: float, max_tokens: int) -> Phase:
    """Requests one after another: the TTFT an idle fleet gives."""
    ph = Phase("unloaded")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    i = 0
    while loop.time() - t0 < seconds or len(ph.shots) < 20:
        ph.shots.append(await shoot(session, base, 1_000_000 + i, max_tokens))
        i += 1
    ph.seconds = loop.time() - t0
    return ph


async def capacity(session: aiohttp.ClientSession, base: str, seconds: float, clients: int,
                   max_tokens: int) -> tuple[float, Phase]:
    """Completions per second with ``clients`` back-to-back clients (the fleet saturated). The
    first third of the window warms up and is not counted."""
    ph = Phase("capacity")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    end = t0 + seconds
    counted_from = t0 + seconds / 3
    ids = iter(range(2_000_000, 3_000_000))

    async def client() -> None:
        while loop.time() < end:
            shot = await shoot(session, base, next(ids), max_tokens)
            ph.shots.append(shot)
            if shot.status != 200:
                # refused: try again soon (a client honouring Retry-After would leave the workers
                # idle between its tries, and this phase measures what they can do when kept busy)
                await asyncio.sleep(0.1)

    await asyncio.gather(*(client() for _ in range(clients)))
    ph.seconds = loop.time() - t0
    done = sum(1 for s in ph.shots if s.status == 200 and s.sent >= counted_from)
    return done / (end - counted_from), ph


async def open_loop(session: aiohttp.ClientSession, base: str, rate: float, seconds: float, max_tokens: int,
                    sample: callable, first_id: int = 3_000_000) -> Phase:  # type: ignore[valid-type]
    """Requests sent at ``rate`` per second whatever happens to them (open loop), for ``seconds``;
    ``sample()`` is called every 0.5 s meanwhile."""
    ph = Phase("overload")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tasks: list[asyncio.Task[Shot]] = []
    n = int(rate * seconds)
    next_sample = t0
    for k in range(n):
        due = t0 + k / rate
        while True:
            now = loop.time()
            if now >= next_sample:
                sample()
                next_sample += 0.5
            if now >= due:
                break
            await asyncio.sleep(min(due, next_sample) - now)
        tasks.append(asyncio.create_task(shoot(session, base, first_id + k, max_tokens)))
    while not all(t.done() for t in tasks):
        sample()
        await asyncio.wait(tasks, timeout=0.5)
    ph.shots = [t.result() for t in tasks]
    ph.seconds = loop.time() - t0
    return ph


class ServeProcess:
    """``thunderagent serve`` in its own process on a free 127.0.0.1 port."""

    def __init__(self, config_text: str, log_path: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="overload-"))
        cfg = self.dir / "config.yaml"
        cfg.write_text(config_text)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        exe = shutil.which("thunderagent", path=str(Path(sys.executable).parent))
        cmd = [exe] if exe else [sys.executable, "-m", "thunderagent.cli"]
        self.log = log_path.open("w")
        self.proc = subprocess.Popen([*cmd, "serve", "--config", str(cfg), "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server process has used."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def ready(self, session: aiohttp.ClientSession, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}; see {self.log.name}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(self.base + "/health") as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve not ready after {timeout} s; see {self.log.name}")
            await asyncio.sleep(0.1)

    async def health(self, session: aiohttp.ClientSession) -> tuple[int, dict]:
        async with session.get(self.base + "/health") as r:
            return r.status, json.loads(await r.read())

    async def counters(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """Sums of the liveness counters over their labels (0 when never incremented)."""
        async with session.get(self.base + "/metrics") as r:
            text = await r.text()
        out = {"lease_expired": 0.0, "index_purged": 0.0, "loop_lag_max": 0.0, "held_s": 0.0, "held_n": 0.0}
        for name, key in (("thunderagent_worker_lease_expired_total", "lease_expired"),
                          ("thunderagent_index_purged_entries_total", "index_purged"),
                          ("thunderagent_scheduler_queue_wait_seconds_sum", "held_s"),
                          ("thunderagent_scheduler_queue_wait_seconds_count", "held_n")):
            for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M):
                out[key] += float(m.group(1))
        m = re.search(r"^thunderagent_loop_lag_max_seconds (\S+)$", text, re.M)
        if m:
            out["loop_lag_max"] = float(m.group(1))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Report:
    capacity_rps: float
    rate_rps: float
    idle: Phase
    unloaded: Phase
    overload: Phase
    rss_base_mb: float
    rss_peak_mb: float
    rss_after_mb: float
    health_after: tuple[int, dict]
    counters: dict[str, float]
    served_after: int  # status of a request sent right after the load
    unhealthy_seen: int  # /health samples during the load that showed a worker not healthy
    #: requests that waited in the scheduler's holding queue during the overload, and their seconds there
    held: tuple[float, float] = (0.0, 0.0)
    #: the server's CPU seconds during the overload, and the machine's 1-minute load average after it
    cpu_s: float = 0.0
    loadavg: float = 0.0

    @property
    def ttft_ratio_p99(self) -> float:
        return self.ttft_ratio(0.99)

    def ttft_ratio(self, q: float) -> float:
        """Admitted requests' TTFT quantile ``q`` over the unloaded run's."""
        return self.overload.ttft_p(q) / self.unloaded.ttft_p(q)

    def lines(self) -> list[str]:
        ov, un, idle = self.overload, self.unloaded, self.idle
        ra = sorted({s.retry_after for s in ov.shots if s.status == 429 and s.retry_after})
        other = {s.status for s in ov.shots} - {200, 429}
        return [
            f"capacity (closed loop): {self.capacity_rps:.1f} completions/s; offered {self.rate_rps:.1f} req/s "
            f"for {ov.seconds:.0f} s ({self.rate_rps / self.capacity_rps:.1f}x)",
            f"idle TTFT (one at a time): p50 {idle.ttft_p(0.5) * 1e3:.0f} ms  p99 {idle.ttft_p(0.99) * 1e3:.0f} ms",
            f"unloaded TTFT (0.25x capacity): p50 {un.ttft_p(0.5) * 1e3:.0f} ms  p90 {un.ttft_p(0.9) * 1e3:.0f} ms  "
            f"p99 {un.ttft_p(0.99) * 1e3:.0f} ms "
            f"({len(un.ok())} requests)",
            f"overload: {len(ov.shots)} sent, {ov.count(200)} x 200, {ov.count(429)} x 429 "
            f"(Retry-After {', '.join(ra) or '-'}), {ov.count(503)} x 503, other {sorted(other) or '-'}",
            f"admitted TTFT: p50 {ov.ttft_p(0.5) * 1e3:.0f} ms  p90 {ov.ttft_p(0.9) * 1e3:.0f} ms  "
            f"p99 {ov.ttft_p(0.99) * 1e3:.0f} ms  (ratios to unloaded: p50 {self.ttft_ratio(0.5):.2f}x  "
            f"p90 {self.ttft_ratio(0.9):.2f}x)  p99 "
            f"= {self.ttft_ratio_p99:.2f}x unloaded p99 ({ov.ttft_p(0.99) / idle.ttft_p(0.99):.2f}x idle p99); "
            f"{self.held[0]:.0f} of them held in the scheduler first (mean "
            f"{self.held[1] / max(1.0, self.held[0]) * 1e3:.0f} ms)",
            f"server RSS: {self.rss_base_mb:.0f} MB before, {self.rss_peak_mb:.0f} MB peak, "
            f"{self.rss_after_mb:.0f} MB after ({self.rss_after_mb / self.rss_base_mb:.2f}x baseline); server CPU "
            f"{self.cpu_s / ov.seconds * 100:.0f} % of a core during the overload; machine load average "
            f"{self.loadavg:.1f} ({os.cpu_count()} CPUs)",
            f"liveness: {self.counters['lease_expired']:.0f} leases expired, {self.counters['index_purged']:.0f} "
            f"index entries purged, {self.unhealthy_seen} /health samples with a worker down; "
            f"loop lag max {self.counters['loop_lag_max'] * 1e3:.0f} ms",
            f"right after: /health {self.health_after[0]} ({self.health_after[1].get('healthy_workers')} healthy), "
            f"a request -> {self.served_after}",
        ]


async def run(duration: float = 60.0, factor: float = 3.0, *, slots: int = 4, engine_speed: float = 0.25,
              max_tokens: int = 16, unloaded_s: float = 4.0, capacity_s: float = 6.0, settle_s: float = 3.0,
              log_path: Path | None = None, extra_config: str = "") -> Report:
    srv = ServeProcess(CONFIG.format(slots=slots, engine_speed=engine_speed) + extra_config,
                       log_path or Path(tempfile.gettempdir()) / "overload-serve.log")
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            await srv.ready(session)
            base = srv.base
            # warm up (first requests pay imports and allocations), then the baseline RSS
            for i in range(10):
                await shoot(session, base, 900_000 + i, max_tokens)
            idle = await unloaded(session, base, unloaded_s, max_tokens)
            cap, _ = await capacity(session, base, capacity_s, clients=4 * slots * 2, max_tokens=max_tokens)
            await asyncio.sleep(settle_s)
            # the baseline's p99 needs samples: at least 2 x unloaded_s, a third of the overload's length
            un = await open_loop(session, base, cap / 4, max(unloaded_s * 2, duration / 3), max_tokens, lambda: None,
                                 first_id=5_000_000)
            rss_base = srv.rss_mb()
            rate = factor * cap
            peak = [rss_base]
            unhealthy = [0]
            polls: set[asyncio.Task[None]] = set()

            async def poll_health() -> None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    _, h = await srv.health(session)
                    if any(w["health"] != "healthy" for w in h.get("workers", [])):
                        unhealthy[0] += 1

            def sample() -> None:
                peak[0] = max(peak[0], srv.rss_mb())
                t = asyncio.create_task(poll_health())
                polls.add(t)
                t.add_done_callback(polls.discard)

            before, cpu0 = await srv.counters(session), srv.cpu_s()
            ov = await open_loop(session, base, rate, duration, max_tokens, sample)
            during, cpu = await srv.counters(session), srv.cpu_s() - cpu0
            loadavg = os.getloadavg()[0]
            health_after = await srv.health(session)
            served_after = (await shoot(session, base, 4_000_000, max_tokens)).status
            await asyncio.sleep(settle_s)
            rss_after = srv.rss_mb()
            counters = await srv.counters(session)
            return Report(cap, rate, idle, un, ov, rss_base, peak[0], rss_after, health_after, counters, served_after,
                          unhealthy[0], (during["held_n"] - before["held_n"], during["held_s"] - before["held_s"]), cpu,
                          loadavg)
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of overload (default 60)")
    ap.add_argument("--factor", type=float, default=3.0, help="offered load / measured capacity (default 3)")
    ap.add_argument("--log", type=Path, default=None, help="server log file (default: $TMPDIR/overload-serve.log)")
    ap.add_argument("--config", default="", help="YAML appended to the server's config, e.g. "
                    "'scheduler: {admit_ttft_factor: null}' to see the run without the admission bound")
    args = ap.parse_args()
    rep = asyncio.run(run(args.duration, args.factor, log_path=args.log, extra_config=args.config))
    print("\n".join(rep.lines()))


if __name__ == "__main__":
    main()
