"""Added proxy latency and streaming throughput: ThunderAgent vs sglang-router (and vllm-router), same run.

Every proxy stands in front of the same two fake OpenAI servers (``bench/fake_backend.py``: answer at
once, no model), one HTTP hop each; all on 127.0.0.1, started by this script and killed at the end:

- ``direct``: a fake backend, no proxy (the floor);
- ``thunderagent``: ``thunderagent serve``'s server (``FrontendRunner``, its connection limits) with
  ``engine: openai`` (``execution/openai.py``): it tokenizes (byte-level stand-in) and hashes the
  prompt, routes on its own predictions, forwards the client's body unchanged and relays the
  server's SSE bytes. The holding queue is off (``--ta-config``, default ``TA_CONFIG``), as the
  routers compared have none; ``--base-src DIR`` adds the same server run from another checkout's
  ``src/`` (before vs after in one run);
- ``sglang-router rr`` / ``ca``: ``python -m sglang_router.launch_router`` with ``--policy
  round_robin`` / ``cache_aware``;
- ``vllm-router``: the ``vllm-router`` binary (``--policy round_robin``) when the package is installed.

Measured, interleaved across targets so CPU noise hits all alike:
1. latency: N sequential 1-token non-streaming ``/v1/completions`` per target (one keep-alive
   connection each), request by request in rotating order; median and p99; "added" = the target's
   figure less the direct one's;
2. streaming throughput at C concurrent clients (32 and 256 by default): R rounds, each round every
   target in rotating order, C clients x S streamed 64-token completions; tokens/s counted from the
   streams' ``usage.completion_tokens``; the median round is reported;
3. each proxy process's CPU per request (per stream), user + system time from ``/proc`` over the
   phase: a busy machine stretches latencies, much less the CPU a request costs.

``--profile FILE`` writes a cProfile (CPU time) of the ThunderAgent process.

Run: ``python bench/proxy_latency.py [--quick]``. Lower latency / higher tokens/s is better. The
client, the proxies and the backends share this machine's cores: read ratios from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import median, print_table  # noqa: E402

SYSTEM = ("You are a careful assistant working on a code base. Read the files you are given, "
          "answer precisely, and say when you are unsure. ") * 3
FAKE_MODEL = "fake-model"
# The routers compared route every request at once into the servers' queues; so does ThunderAgent here
# (the holding queue off): with `serve`'s default queue on, the admission bound (scheduler.
# admit_ttft_factor: a wait over ~1x the measured TTFT, ~1 ms against instant servers) answers 429 to
# part of a 32-client burst, a policy rather than proxy overhead.
TA_CONFIG: dict = {"scheduler": {"enabled": False}}


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    fh = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=HERE.parent, env=env)


def _read_port(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """Servers of ours print ``PORT <n>`` once listening."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        chunk = proc.stdout.read()
        if chunk:
            buf += chunk
            for line in buf.splitlines():
                if line.startswith(b"PORT "):
                    return int(line.split()[1])
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening")
        time.sleep(0.05)
    raise RuntimeError("server did not report its port in time")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: this process and its children
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _cpu_seconds(proc: subprocess.Popen | None) -> float:
    """User + system CPU seconds of a process and everything in its session (a launcher's children)."""
    if proc is None:
        return 0.0
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[3]) == proc.pid:  # session id (the proxies run in sessions of their own)
            total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def sglang_router_version() -> str | None:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("sglang-router")
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# ThunderAgent server (child mode)
# ---------------------------------------------------------------------------------------------
def serve_thunderagent(backends: list[str], overlay: dict | None = None) -> None:
    """``thunderagent serve --engine openai --worker URL ...``, as that command runs it, on a free port;
    ``overlay``: config sections merged over that (``--ta-config``)."""
    from aiohttp import web  # noqa: PLC0415

    from thunderagent.config import parse_config  # noqa: PLC0415
    from thunderagent.frontend.app import create_app  # noqa: PLC0415
    from thunderagent.frontend.server import FrontendRunner  # noqa: PLC0415

    raw: dict = {
        "model_name": FAKE_MODEL,
        "routing": {"seed": 1},
        "execution_group": {"nodes": [{"engine": "openai", "endpoints": [{"url": u} for u in backends]}]},
    }
    for section, value in (overlay or {}).items():
        raw[section] = {**raw[section], **value} if isinstance(value, dict) and section in raw else value
    cfg = parse_config(raw, "bench")

    async def main() -> None:
        runner = FrontendRunner(create_app(cfg))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:  # as `serve` does once started (thunderagent.gc_policy); a --base-src checkout may predate it
            from thunderagent.gc_policy import tune_gc  # noqa: PLC0415

            tune_gc()
        except ImportError:
            pass
        print(f"PORT {runner.addresses[0][1]}", flush=True)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    profile = os.environ.get("PROXY_BENCH_PROFILE")  # a pstats file of this process (--profile)
    prof = None
    if profile:
        import cProfile  # noqa: PLC0415

        prof = cProfile.Profile(time.process_time)  # CPU time: a busy machine's waits are not ours
        prof.enable()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())  # as `thunderagent serve` runs (uvloop measured no better here: not used)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)


# ---------------------------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    urls: list[str]  # base urls; direct streaming spreads clients over them
    model: str
    note: str = ""
    proc: subprocess.Popen | None = None  # the proxy process, if we started one for this target
    lat_ms: list[float] = field(default_factory=list)
    thr: dict[int, list[float]] = field(default_factory=dict)  # clients -> tokens/s of each round
    cpu_us: dict[str, list[float]] = field(default_factory=dict)  # phase -> the proxy's CPU µs per request


def _prompt(i: int) -> str:
    return f"{SYSTEM}\nUser {i}: please summarise file number {i * 7919 % 10007}."


async def _complete(session, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    async with session.post(url + "/v1/completions", json=body) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {data[:200]!r}")
        return json.loads(data)


async def _wait_ready(session, t: Target, timeout: float) -> None:
    """A router may answer /health before it has registered its workers: wait for a completion."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if t.proc is not None and t.proc.poll() is not None:
            raise RuntimeError(f"{t.name} exited with {t.proc.returncode} (see its log)")
        try:
            await _complete(session, t.urls[0], t.model, "ready?", 1)
            return
        except Exception as exc:  # connection refused, 503 no workers yet ...
            last = exc
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{t.name} not ready after {timeout:.0f} s: {last}")


async def latency(targets: list[Target], n: int, warmup: int, backends: list[subprocess.Popen]) -> None:
    """Sequential requests, interleaved; CPU per request of each proxy, and of the fake backends (an
    aiohttp server doing almost nothing: every target's requests reach them once, the direct ones too)."""
    import aiohttp  # noqa: PLC0415

    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in targets]
    try:
        cpu0: list[float] = []
        for i in range(warmup + n):
            if i == warmup:
                cpu0 = [_cpu_seconds(t.proc) for t in targets]
                b0 = sum(_cpu_seconds(p) for p in backends)
            prompt = _prompt(i)
            for k in range(len(targets)):  # rotate who goes first
                j = (i + k) % len(targets)
                t = targets[j]
                t0 = time.perf_counter()
                await _complete(sessions[j], t.urls[0], t.model, prompt, 1)
                dt = (time.perf_counter() - t0) * 1e3
                if i >= warmup:
                    t.lat_ms.append(dt)
        for t, c0 in zip(targets, cpu0):
            if t.proc is not None:
                t.cpu_us["latency"] = [(_cpu_seconds(t.proc) - c0) / n * 1e6]
        backend_cpu = (sum(_cpu_seconds(p) for p in backends) - b0) / (n * len(targets)) * 1e6
        targets[0].cpu_us["latency"] = [backend_cpu]  # the direct row: the backend's own CPU
    finally:
        for s in sessions:
            await s.close()


async def stream_throughput(t: Target, clients: int, per_client: int, tokens: int) -> float:
    """Tokens/s of ``clients`` concurrent clients, each streaming ``per_client`` completions."""
    import aiohttp  # noqa: PLC0415

    total_tokens = 0

    async def client(c: int, session) -> None:
        nonlocal total_tokens
        url = t.urls[c % len(t.urls)]
        for r in range(per_client):
            body = {"model": t.model, "prompt": _prompt(c * 1000 + r), "max_tokens": tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{t.name}: HTTP {resp.status}: {(await resp.read())[:200]!r}")
                got = 0
                async for line in resp.content:
                    if line.startswith(b"data: {") and b'"usage"' in line:
                        u = json.loads(line[6:]).get("usage")
                        if u:
                            got = u["completion_tokens"]
                if got != tokens:
                    raise RuntimeError(f"{t.name}: a stream gave {got} tokens, not {tokens}")
                total_tokens += got

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, session) for c in range(clients)))
        wall = time.perf_counter() - t0
    return total_tokens / wall


# ---------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------
def vllm_router_binary() -> str | None:
    import shutil  # noqa: PLC0415

    exe = Path(sys.executable).parent / "vllm-router"
    return str(exe) if exe.exists() else shutil.which("vllm-router")


def run(n_latency: int = 200, concurrency: tuple[int, ...] = (32, 256), per_client: int = 4, rounds: int = 3,
        tokens: int = 64, with_sglang: bool = True, logdir: Path | None = None, ta_config: dict | None = None,
        base_src: str | None = None, profile: str | None = None) -> dict[str, object]:
    import tempfile  # noqa: PLC0415

    import aiohttp  # noqa: PLC0415

    logdir = logdir or Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    procs: list[subprocess.Popen] = []
    notes: list[str] = []
    cmds: dict[str, list[str]] = {}
    try:
        backends = []
        for k in range(2):
            p = _spawn([sys.executable, str(HERE / "fake_backend.py"), "--port", "0"], logdir / f"backend{k}.log")
            procs.append(p)
            backends.append(f"http://127.0.0.1:{_read_port(p)}")
        targets = [Target("direct (fake backend)", backends, FAKE_MODEL)]
        arms = [("thunderagent (engine openai)", None)]
        if base_src is not None:  # the same server from another checkout's src/ (before vs after, one run)
            arms.append(("thunderagent base", base_src))
        for name, src in arms:
            cmd = [sys.executable, str(HERE / "proxy_latency.py"), "--ta-config", json.dumps(ta_config),
                   "--serve-thunderagent", *backends]
            env = dict(os.environ)
            if src is not None:
                env["PYTHONPATH"] = str(Path(src).resolve() / "src")
            if profile and src is None:
                env["PROXY_BENCH_PROFILE"] = profile
            ta = _spawn(cmd, logdir / f"{name.split()[1] if src else 'thunderagent'}.log", env=env)
            procs.append(ta)
            targets.append(Target(name, [f"http://127.0.0.1:{_read_port(ta)}"], FAKE_MODEL, proc=ta))
        version = sglang_router_version()
        if with_sglang and version is None:
            notes.append("sglang-router is not installed (pip install sglang-router): not measured")
        elif with_sglang:
            for short, policy in (("rr", "round_robin"), ("ca", "cache_aware")):
                port = _free_port()
                cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *backends,
                       "--policy", policy, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
                       # each router also serves Prometheus metrics (default port 29000: two collide)
                       "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
                cmds[f"sglang-router {short}"] = cmd
                procs.append(_spawn(cmd, logdir / f"sglang-{short}.log"))
                targets.append(Target(f"sglang-router {short}", [f"http://127.0.0.1:{port}"], FAKE_MODEL,
                                      proc=procs[-1]))
        vr = vllm_router_binary()
        if vr is None:
            notes.append("vllm-router is not installed (pip install vllm-router): not measured")
        else:
            port = _free_port()
            cmd = [vr, "--worker-urls", *backends, "--policy", "round_robin", "--host", "127.0.0.1",
                   "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
            cmds["vllm-router rr"] = cmd
            procs.append(_spawn(cmd, logdir / "vllm-router.log"))
            targets.append(Target("vllm-router rr", [f"http://127.0.0.1:{port}"], FAKE_MODEL, proc=procs[-1]))

        async def drive() -> None:
            async with aiohttp.ClientSession() as s:
                for t in list(targets):
                    try:
                        await _wait_ready(s, t, 40.0)
                    except RuntimeError as exc:
                        notes.append(f"{t.name} failed to start, skipped: {exc}")
                        targets.remove(t)
            await latency(targets, n_latency, warmup=max(5, n_latency // 10), backends=procs[:2])
            for t in targets:
                await stream_throughput(t, 4, 1, tokens)  # warm connections
            for clients in concurrency:
                for r in range(rounds):
                    for k in range(len(targets)):
                        t = targets[(r + k) % len(targets)]
                        c0 = _cpu_seconds(t.proc)
                        t.thr.setdefault(clients, []).append(await stream_throughput(t, clients, per_client, tokens))
                        cpu = (_cpu_seconds(t.proc) - c0) / (clients * per_client) * 1e6
                        if t.proc is not None:
                            t.cpu_us.setdefault(f"stream{clients}", []).append(cpu)

        asyncio.run(drive())
    finally:
        for p in reversed(procs):
            _stop(p)
    return {"targets": targets, "notes": notes, "sglang_version": version, "cmds": cmds, "logdir": str(logdir)}


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _cpu(t: Target, phase: str) -> str:
    """The proxy process's CPU per request (median of rounds), from /proc: robust to a busy machine."""
    xs = t.cpu_us.get(phase)
    return f"{median(xs):,.0f}" if xs else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description="added proxy latency and streaming throughput vs sglang-router")
    ap.add_argument("--quick", action="store_true", help="fewer requests (~30 s)")
    ap.add_argument("--requests", type=int, default=None, help="sequential latency requests per target")
    ap.add_argument("--clients", type=int, nargs="*", default=[32, 256], help="concurrent streaming clients")
    ap.add_argument("--per-client", type=int, default=None, help="streamed requests per client per round")
    ap.add_argument("--rounds", type=int, default=None, help="throughput rounds per target and concurrency")
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--ta-config", default=json.dumps(TA_CONFIG),
                    help=f"JSON config sections merged over ThunderAgent's (default: {json.dumps(TA_CONFIG)})")
    ap.add_argument("--base-src", metavar="CHECKOUT", default=None,
                    help="also measure ThunderAgent from another checkout's src/ (e.g. a git worktree of the base "
                    "commit), interleaved in the same run")
    ap.add_argument("--profile", metavar="PSTATS", default=None,
                    help="cProfile the ThunderAgent process, written to this file at the end")
    ap.add_argument("--serve-thunderagent", nargs="+", metavar="BACKEND_URL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ta_config = json.loads(args.ta_config)
    if args.serve_thunderagent:
        serve_thunderagent(args.serve_thunderagent, ta_config)
        return
    n = args.requests or (100 if args.quick else 400)
    per_client = args.per_client or (2 if args.quick else 4)
    rounds = args.rounds or (1 if args.quick else 3)
    t0 = time.perf_counter()
    r = run(n, tuple(args.clients), per_client, rounds, 64, with_sglang=not args.no_sglang, ta_config=ta_config,
            base_src=args.base_src, profile=args.profile)
    elapsed = time.perf_counter() - t0
    targets: list[Target] = r["targets"]  # type: ignore[assignment]
    print(f"proxy latency / throughput, 127.0.0.1, 2 fake backends, one HTTP hop per proxy; sglang-router "
          f"{r['sglang_version'] or 'not installed'}; {os.cpu_count()} CPUs")
    for name, cmd in r["cmds"].items():  # type: ignore[union-attr]
        print(f"  {name}: {' '.join(Path(c).name if c == sys.executable else c for c in cmd)}")
    for note in r["notes"]:  # type: ignore[union-attr]
        print(f"  NOTE: {note}")
    if not targets:
        return
    d = targets[0]
    d50, d99 = median(d.lat_ms), _p(d.lat_ms, 0.99)
    rows = []
    for t in targets:
        m, p99 = median(t.lat_ms), _p(t.lat_ms, 0.99)
        rows.append([t.name, m, p99, (m - d50) * 1e3, (p99 - d99) * 1e3, _cpu(t, "latency")])
    print_table(f"sequential 1-token completions, keep-alive, {n} per target, interleaved (lower is better)",
                ["target", "median ms", "p99 ms", "added median µs", "added p99 µs", "proxy CPU µs/req"], rows)
    print("  (the direct row's CPU: the fake backend's, an aiohttp server doing almost nothing, per request it "
          "answers: the server side alone of an aiohttp proxy costs about that)")
    ours = next((t for t in targets if t.name.startswith("thunderagent")), None)
    peers = [t for t in targets if t.name.startswith(("sglang", "vllm-router"))]
    if ours is not None:
        for s in peers:
            a50, b50 = median(ours.lat_ms) - d50, median(s.lat_ms) - d50
            a99, b99 = _p(ours.lat_ms, 0.99) - d99, _p(s.lat_ms, 0.99) - d99
            print(f"  added latency ours / {s.name}: median {a50 * 1e3:.0f} / {b50 * 1e3:.0f} µs = "
                  f"{a50 / b50 if b50 > 0 else float('nan'):.2f}x; p99 {a99 * 1e3:.0f} / {b99 * 1e3:.0f} µs = "
                  f"{a99 / b99 if b99 > 0 else float('nan'):.2f}x (target <= 1.00x)")
    for clients in args.clients:
        base = median(d.thr.get(clients, []))
        rows = [[t.name, median(t.thr.get(clients, [])), median(t.thr.get(clients, [])) / base,
                 _cpu(t, f"stream{clients}")] for t in targets]
        print_table(f"streaming: {clients} concurrent clients x {per_client} streams x 64 tokens, median of "
                    f"{rounds} interleaved rounds (higher is better)",
                    ["target", "tokens/s", "x direct", "proxy CPU µs/stream"], rows)
        if ours is not None:
            for s in peers:
                a, b = median(ours.thr.get(clients, [])), median(s.thr.get(clients, []))
                print(f"  tokens/s ours / {s.name} at {clients} clients: {a / b:.2f}x (target >= 1.00x)")
    print(f"logs: {r['logdir']}; elapsed {elapsed:.1f} s")


if __name__ == "__main__":
    main()
