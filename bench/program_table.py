"""Agent programs at scale: what a program's request and a health tick cost with N programs known, and
what a server's memory does when clients keep sending new program ids.

Program ids come from clients (a header or a body field), so a server can come to know any number of
them. Two parts, both before vs after in one run when ``--base-src DIR`` names another checkout:

1. **In process** (``scheduler/programs.py`` alone): N programs idle in the table (N = 1,000, 10,000,
   100,000), then program steps as the fleet runs them (``request_started``, the state counts it
   exports, ``request_finished``, the counts again) and the health tick's TTL sweep with nothing due.
   Medians of per-call times, microseconds.
2. **Live** (``--live``): ``thunderagent serve`` (simulated workers) receiving ``--requests`` 1-token
   completions, each from a new program id, 32 at a time: the server's CPU per request (``/proc``,
   over the second half, when the table is fullest), its resident memory at the end, and the
   programs it still tracks (the default ``scheduler.max_programs`` bounds them from this change on).

Part 1b: a full table (10,000 idle programs spread over 1, 100 or 5,000 tenants), then one tenant's new
program ids, each evicting one (max-min fair across tenants): what a new program and a sweep cost as the
tenants grow.

Run: ``python bench/program_table.py [--base-src DIR] [--live] [--requests N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table  # noqa: E402
SIZES = (1_000, 10_000, 100_000)
TENANTS = (1, 100, 5_000)  # a full table's programs spread over this many tenants (part 1b)


def measure(sizes: tuple[int, ...] = SIZES, steps: int = 2_000) -> dict[str, dict[str, float]]:
    """Part 1 on whatever ``thunderagent`` this interpreter imports."""
    from thunderagent.scheduler.programs import ProgramTable  # noqa: PLC0415

    out: dict[str, dict[str, float]] = {}
    perf = time.perf_counter_ns
    for n in sizes:
        t = ProgramTable(600.0)
        now = 0.0
        for i in range(n):
            t.request_started(f"idle-{i}", now, prompt_tokens=100)
            t.request_finished(f"idle-{i}", 110, now, completed=True)
            now += 1e-4
        step_ns: list[int] = []
        for i in range(steps):  # one active program's steps among the idle ones (none reaches its TTL)
            now += 1e-3
            a = perf()
            t.request_started("active", now, prompt_tokens=100)
            t.by_state()  # the fleet exports the counts on a program request's start...
            t.request_finished("active", 110, now, completed=True)
            t.by_state()  # ...and on its end
            step_ns.append(perf() - a)
        tick_ns: list[int] = []
        for _ in range(200):
            a = perf()
            gone = t.expire(now)
            tick_ns.append(perf() - a)
            assert not gone
        out[str(n)] = {"step_us": statistics.median(step_ns) / 1e3, "tick_us": statistics.median(tick_ns) / 1e3}
    for tenants in TENANTS:
        out[f"tenants-{tenants}"] = _flood(tenants, steps)
    return out


def _flood(tenants: int, steps: int, full: int = 10_000) -> dict[str, float]:
    """A full table (``full`` idle programs over ``tenants`` tenants, keys ``tenant/id``), then one
    tenant's new program ids, each evicting one: median cost of a new program (start, end), and of a
    TTL sweep with nothing due. Before tenants existed, the keys are plain ids (one global order)."""
    from thunderagent.scheduler.programs import ProgramTable  # noqa: PLC0415

    t = ProgramTable(600.0, max_programs=full)
    # the code before tenants takes no tenant: the same keys, one global order
    tenanted = "tenant" in inspect.signature(ProgramTable.request_started).parameters

    def start(key: str, tenant: str, now: float) -> None:
        if tenanted:
            t.request_started(key, now, prompt_tokens=100, tenant=tenant)
        else:
            t.request_started(key, now, prompt_tokens=100)

    now = 0.0
    for i in range(full):
        tenant = f"t{i % tenants}"
        start(f"{tenant}/idle-{i}", tenant, now)
        t.request_finished(f"{tenant}/idle-{i}", 110, now, completed=True)
        now += 1e-4
    perf = time.perf_counter_ns
    new_ns: list[int] = []
    for i in range(steps):
        now += 1e-3
        a = perf()
        start(f"t0/new-{i}", "t0", now)
        t.request_finished(f"t0/new-{i}", 110, now, completed=True)
        new_ns.append(perf() - a)
    assert len(t) == full
    if tenanted and tenants > 1:  # the flood evicted t0's own programs only
        assert sum(t.by_state("t1").values()) == len(range(1, full, tenants))
    tick_ns: list[int] = []
    for _ in range(200):
        a = perf()
        assert not t.expire(now)
        tick_ns.append(perf() - a)
    return {"new_us": statistics.median(new_ns) / 1e3, "tick_us": statistics.median(tick_ns) / 1e3}


def _measure_in(src: str | None) -> dict[str, dict[str, float]]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(Path(src) / "src")
    proc = subprocess.run([sys.executable, str(Path(__file__)), "--measure-only"], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- part 2: a live server ----------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _drive(url: str, pid: int, n: int) -> dict[str, float]:
    import aiohttp  # noqa: PLC0415

    sem = asyncio.Semaphore(32)
    statuses: dict[int, int] = {}
    marks: dict[str, float] = {}

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        async with sem:
            if i == n // 2:
                marks["cpu_half"] = _cpu_s(pid)
            body = {"model": "thunderagent-sim", "prompt": f"tool result {i}: ok", "max_tokens": 1}
            async with s.post(url + "/v1/completions", json=body,
                              headers={"x-thunderagent-program-id": f"agent-{i}"}) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1

    async with aiohttp.ClientSession() as s:
        base_rss = _rss_mb(pid)
        await asyncio.gather(*(one(s, i) for i in range(n)))
        cpu = _cpu_s(pid) - marks["cpu_half"]
        async with s.get(url + "/v1/programs") as r:
            listed = await r.json()
            known = listed.get("total", len(listed["data"]))  # older servers list every program, with no total
    return {"cpu_us_per_request": cpu / (n - n // 2) * 1e6, "rss_start_mb": base_rss, "rss_end_mb": _rss_mb(pid),
            "programs": known, "ok": statuses.get(200, 0)}


def live(src: str | None, n: int, port: int) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(Path(src) / "src")
    launch = "from thunderagent.cli import main; main()"  # the `thunderagent` command, of whichever src is on the path
    proc = subprocess.Popen([sys.executable, "-c", launch, "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request  # noqa: PLC0415

        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"server from {src or 'this checkout'} did not start") from None
                time.sleep(0.3)
        return asyncio.run(_drive(url, proc.pid, n))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-src", help="another checkout: the same measurements on its code, in the same run")
    ap.add_argument("--live", action="store_true", help="also part 2, a live server (a few minutes per arm)")
    ap.add_argument("--requests", type=int, default=20_000, help="part 2: requests, each from a new program")
    ap.add_argument("--port", type=int, default=18765)
    ap.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_only:
        print(json.dumps(measure()))
        return
    arms = [("this checkout", None)] + ([("base", args.base_src)] if args.base_src else [])
    pure = {name: _measure_in(src) for name, src in arms}
    rows = []
    for n in SIZES:
        row: list[object] = [f"{n:,}"]
        for name, _ in arms:
            row += [f"{pure[name][str(n)]['step_us']:.2f}", f"{pure[name][str(n)]['tick_us']:.2f}"]
        if args.base_src:
            row += [f"{pure['base'][str(n)]['step_us'] / pure['this checkout'][str(n)]['step_us']:.1f}x"]
        rows.append(row)
    header = ["programs known"]
    for name, _ in arms:
        header += [f"{name}: step us", f"{name}: tick us"]
    if args.base_src:
        header.append("step: base / this")
    print_table("in process: one program step (start, counts, end, counts) and one TTL sweep, medians", header, rows)
    rows = []
    for tenants in TENANTS:
        row = [f"{tenants:,}"]
        for name, _ in arms:
            got = pure[name].get(f"tenants-{tenants}")
            row += [f"{got['new_us']:.2f}", f"{got['tick_us']:.2f}"] if got else ["-", "-"]
        rows.append(row)
    header = ["tenants"]
    for name, _ in arms:
        header += [f"{name}: new program us", f"{name}: tick us"]
    print_table("in process: a full table (10,000 idle programs over N tenants), one tenant's new programs, each "
                "evicting one (before tenants: keys are plain ids, one global order), medians", header, rows)
    if not args.live:
        return
    rows = []
    for name, src in arms:
        r = live(src, args.requests, args.port)
        rows.append((name, f"{r['cpu_us_per_request']:,.0f}", f"{r['rss_start_mb']:.0f}", f"{r['rss_end_mb']:.0f}",
                     f"{r['programs']:,}", f"{r['ok']:,}"))
    print_table(f"live: {args.requests:,} requests, each from a new program id, 32 at a time",
                ("server", "CPU us / request (2nd half)", "RSS start MB", "RSS end MB", "programs tracked", "200s"),
                rows)


if __name__ == "__main__":
    main()
