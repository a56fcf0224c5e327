"""Added proxy latency and streaming throughput: sglang-router vs ThunderAgent, same run.

Backends are our own fake OpenAI servers (``bench/fake_backend.py``: answer at once, no model).
Targets, all on 127.0.0.1, all started by this script and killed at the end:

- ``direct``: a fake backend, no proxy (the floor).
- ``sglang-router rr`` / ``sglang-router ca``: ``python -m sglang_router.launch_router`` with
  ``--policy round_robin`` / ``cache_aware`` in front of 2 fake backends.
- ``thunderagent*``: ``create_app`` with 2 *in-process simulated* workers at
  ``simulation.speedup = 1e6`` (engine time ~ 0). ThunderAgent cannot proxy to HTTP backends yet,
  so this is "frontend + router + in-process engine": it has NO second HTTP hop and NO backend
  process, but does run its tokenizer, hashing, router, simulated engine and detokenizer. It is NOT
  the same measurement as an HTTP proxy; read its "added" figure as our own per-request overhead.

Measured:
1. latency: N sequential 1-token, non-streaming ``/v1/completions`` per target with one keep-alive
   aiohttp session per target, interleaved across targets request by request (CPU noise hits all
   alike); median and p90; "added" = median(target) - median(direct).
2. streaming throughput: C concurrent clients x R streamed 64-token completions per target (one
   target at a time), tokens/s counted from ``usage.completion_tokens``.

Run: ``python bench/proxy_latency.py [--quick]``. Lower latency / higher tokens/s is better.
This machine's 2 cores are shared by the client, the proxy and the backends: absolute numbers are
pessimistic, ratios measured in the same run are what to read.
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
TA_MODEL = "thunderagent-sim"


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    fh = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=HERE.parent)


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


def sglang_router_version() -> str | None:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("sglang-router")
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# ThunderAgent server (child mode)
# ---------------------------------------------------------------------------------------------
def serve_thunderagent(workers: int) -> None:
    from aiohttp import web  # noqa: PLC0415

    from thunderagent.config import parse_config  # noqa: PLC0415
    from thunderagent.frontend.app import create_app  # noqa: PLC0415

    cfg = parse_config({
        "simulation": {"speedup": 1e6},
        "execution_group": {"nodes": [{"count": workers}]},
        "routing": {"seed": 1},
        "model_name": TA_MODEL,
    }, "bench")

    async def main() -> None:
        runner = web.AppRunner(create_app(cfg), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


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
    prompts: list[str] = field(default_factory=list)  # streaming prompts (64 tokens each)


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


async def _pick_prompts(session, t: Target, n: int, tokens: int) -> None:
    """Prompts that really yield ``tokens`` tokens on this target (ThunderAgent's simulated text has
    a per-prompt natural length and may stop earlier; the fake backend always gives max_tokens)."""
    i = 0
    while len(t.prompts) < n and i < 20 * n:
        p = _prompt(100_000 + i)
        i += 1
        out = await _complete(session, t.urls[0], t.model, p, tokens)
        if out["usage"]["completion_tokens"] == tokens:
            t.prompts.append(p)
    if not t.prompts:
        raise RuntimeError(f"{t.name}: no prompt yields {tokens} tokens")


async def latency(targets: list[Target], n: int, warmup: int) -> None:
    import aiohttp  # noqa: PLC0415

    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in targets]
    try:
        for i in range(warmup + n):
            prompt = _prompt(i)
            for k in range(len(targets)):  # rotate who goes first
                j = (i + k) % len(targets)
                t = targets[j]
                t0 = time.perf_counter()
                await _complete(sessions[j], t.urls[0], t.model, prompt, 1)
                dt = (time.perf_counter() - t0) * 1e3
                if i >= warmup:
                    t.lat_ms.append(dt)
    finally:
        for s in sessions:
            await s.close()


async def stream_throughput(t: Target, clients: int, per_client: int, tokens: int) -> dict[str, float]:
    import aiohttp  # noqa: PLC0415

    total_tokens = 0
    streams = 0

    async def client(c: int, session) -> None:
        nonlocal total_tokens, streams
        url = t.urls[c % len(t.urls)]
        for r in range(per_client):
            prompt = t.prompts[(c * per_client + r) % len(t.prompts)] if t.prompts else _prompt(c * 1000 + r)
            body = {"model": t.model, "prompt": prompt, "max_tokens": tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{t.name}: HTTP {resp.status}")
                got = 0
                async for line in resp.content:
                    if line.startswith(b"data: {") and b'"usage"' in line:
                        u = json.loads(line[6:]).get("usage")
                        if u:
                            got = u["completion_tokens"]
                total_tokens += got
                streams += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, session) for c in range(clients)))
        wall = time.perf_counter() - t0
    return {"tokens_per_s": total_tokens / wall, "streams_per_s": streams / wall,
            "tokens": float(total_tokens), "wall_s": wall}


# ---------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------
def run(n_latency: int = 200, clients: int = 32, per_client: int = 10, tokens: int = 64,
        with_sglang: bool = True, logdir: Path | None = None) -> dict[str, object]:
    import tempfile  # noqa: PLC0415

    import aiohttp  # noqa: PLC0415

    logdir = logdir or Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    procs: list[subprocess.Popen] = []
    notes: list[str] = []
    try:
        backends = []
        for k in range(2):
            p = _spawn([sys.executable, str(HERE / "fake_backend.py"), "--port", "0"], logdir / f"backend{k}.log")
            procs.append(p)
            backends.append(f"http://127.0.0.1:{_read_port(p)}")
        ta = _spawn([sys.executable, str(HERE / "proxy_latency.py"), "--serve-thunderagent", "2"],
                    logdir / "thunderagent.log")
        procs.append(ta)
        ta_url = f"http://127.0.0.1:{_read_port(ta)}"

        targets = [Target("direct (fake backend)", backends, FAKE_MODEL)]
        sg_cmds: dict[str, list[str]] = {}
        version = sglang_router_version()
        if with_sglang and version is None:
            notes.append("sglang-router is not installed (pip install sglang-router): only ours is reported")
        elif with_sglang:
            for short, policy in (("rr", "round_robin"), ("ca", "cache_aware")):
                port = _free_port()
                cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *backends,
                       "--policy", policy, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
                       # each router also serves Prometheus metrics (default port 29000: two collide)
                       "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
                sg_cmds[policy] = cmd
                procs.append(_spawn(cmd, logdir / f"sglang-{short}.log"))
                targets.append(Target(f"sglang-router {short}", [f"http://127.0.0.1:{port}"], FAKE_MODEL,
                                      proc=procs[-1]))
        targets.append(Target("thunderagent (in-proc engine)", [ta_url], TA_MODEL,
                              note="frontend+router+in-process engine, no HTTP hop"))

        async def drive() -> dict[str, dict[str, float]]:
            async with aiohttp.ClientSession() as s:
                for t in list(targets):
                    try:
                        await _wait_ready(s, t, 40.0)
                    except RuntimeError as exc:
                        notes.append(f"{t.name} failed to start, skipped: {exc}")
                        targets.remove(t)
                for t in targets:
                    await _pick_prompts(s, t, 64, tokens)
            await latency(targets, n_latency, warmup=max(5, n_latency // 10))
            thr = {}
            for t in targets:
                await stream_throughput(t, min(4, clients), 1, tokens)  # warm connections
                thr[t.name] = await stream_throughput(t, clients, per_client, tokens)
            return thr

        thr = asyncio.run(drive())
    finally:
        for p in reversed(procs):
            _stop(p)
    return {"targets": targets, "throughput": thr, "notes": notes, "sglang_version": version,
            "sglang_cmds": sg_cmds, "logdir": str(logdir)}


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description="added proxy latency and streaming throughput vs sglang-router")
    ap.add_argument("--quick", action="store_true", help="fewer requests (~10 s)")
    ap.add_argument("--requests", type=int, default=None, help="sequential latency requests per target")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=None, help="streamed requests per client")
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--serve-thunderagent", type=int, metavar="WORKERS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_thunderagent:
        serve_thunderagent(args.serve_thunderagent)
        return
    n = args.requests or (60 if args.quick else 200)
    per_client = args.per_client or (3 if args.quick else 20)
    t0 = time.perf_counter()
    r = run(n, args.clients, per_client, 64, with_sglang=not args.no_sglang)
    elapsed = time.perf_counter() - t0
    targets: list[Target] = r["targets"]  # type: ignore[assignment]
    thr: dict[str, dict[str, float]] = r["throughput"]  # type: ignore[assignment]
    print(f"proxy latency / throughput, 127.0.0.1, 2 fake backends; sglang-router "
          f"{r['sglang_version'] or 'not installed'}")
    for policy, cmd in r["sglang_cmds"].items():  # type: ignore[union-attr]
        print(f"  sglang {policy}: {' '.join(Path(c).name if c == sys.executable else c for c in cmd)}")
    for note in r["notes"]:  # type: ignore[union-attr]
        print(f"  NOTE: {note}")
    direct = median(targets[0].lat_ms) if targets else float("nan")
    rows = []
    for t in targets:
        m = median(t.lat_ms)
        rows.append([t.name, m, _p(t.lat_ms, 0.9), (m - direct) * 1e3 if t is not targets[0] else 0.0,
                     m / direct if direct else float("nan")])
    print_table(f"sequential 1-token completions, keep-alive, {n} per target, interleaved (lower is better)",
                ["target", "median ms", "p90 ms", "added µs", "x direct"], rows)
    sg = [t for t in targets if t.name.startswith("sglang-router")]
    ta = [t for t in targets if t.name.startswith("thunderagent")]
    if sg and ta:
        ta_add = median(ta[0].lat_ms) - direct
        for s in sg:
            s_add = median(s.lat_ms) - direct
            print(f"  added latency ours/{s.name}: {ta_add * 1e3:.0f} / {s_add * 1e3:.0f} µs "
                  f"= {ta_add / s_add:.2f}x" if s_add > 0 else f"  {s.name}: added <= 0 (noise)")
    rows = []
    base = thr.get(targets[0].name, {}).get("tokens_per_s", float("nan")) if targets else float("nan")
    for t in targets:
        x = thr.get(t.name)
        if x:
            rows.append([t.name, x["tokens_per_s"], x["streams_per_s"], x["wall_s"], x["tokens_per_s"] / base])
    print_table(f"streaming: {args.clients} concurrent clients x {per_client} streams x 64 tokens "
                "(higher is better)", ["target", "tokens/s", "streams/s", "wall s", "x direct"], rows)
    if sg and ta:
        for s in sg:
            a, b = thr[ta[0].name]["tokens_per_s"], thr[s.name]["tokens_per_s"]
            print(f"  tokens/s ours/{s.name}: {a / b:.2f}x")
    print("CAVEAT: thunderagent rows are frontend + router + in-process simulated engine (speedup 1e6),")
    print("        not an HTTP proxy: no second hop and no backend process; sglang rows include both.")
    print(f"logs: {r['logdir']}; elapsed {elapsed:.1f} s")


if __name__ == "__main__":
    main()
