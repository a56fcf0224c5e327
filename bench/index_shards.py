"""What a sharded index (``nats.index: sharded``) costs a routed request, against the replica (the default).

Processes (127.0.0.1): one nats-server, ``--workers`` ``thunderagent worker`` processes (simulated engines
at ``--speedup``) and two ``thunderagent frontend`` processes, started once per mode with the same config but
``nats.index``. The client sends ``--requests`` sequential 1-token completions through frontend A, each a
conversation's next turn (its history is a previous request's prompt, routed through frontend B first, so
the holder is known only from the index: in sharded mode from B's answer when A does not own the holder),
and measures per mode:

- end-to-end latency of A's requests (median, p99) and how many went to the worker holding their history;
- A's and B's CPU per request it routed (``/proc``: user + system; one each per conversation), answering
  the other's lookups included;
- A's lookups (asked, answered, late) from ``/health``.

Sharded, each decision waits one round trip to the other frontend (the asks go out together); in return
each frontend applies only its workers' KV events (``bench/nats_events.py --index sharded``). Modes run in
turn, ``--rounds`` times, so a noisy machine hits both alike.

Run: ``python bench/index_shards.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_seconds, median, print_table, start_nats_server  # noqa: E402

CONFIG = """\
control_plane: {{heartbeat_interval: 0.25, heartbeat_misses: 4}}
simulation: {{speedup: {speedup}}}
routing: {{seed: 7}}
scheduler: {{enabled: false}}
nats: {{index: {index}}}
execution_group:
  nodes: [{{count: 1, kv_blocks: 8192, block_size: 64}}]
"""
TEXT = ("The router keeps a map of which worker holds which block of every prompt it has seen, and it sends "
        "each new request where the longest prefix already sits, unless that worker is drowning. ") * 12


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, prompt: str) -> tuple[float, str]:
    body = json.dumps({"model": "thunderagent-sim", "prompt": prompt, "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
        return time.perf_counter() - t0, r.headers["x-thunderagent-worker"]


def _health(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 until a worker is healthy
        return json.loads(e.read())


def run_mode(index: str, a: argparse.Namespace, tmp: Path) -> dict[str, float]:
    exe = shutil.which("thunderagent", path=str(Path(sys.executable).parent)) or "thunderagent"
    cfg = tmp / f"{index}.yaml"
    cfg.write_text(CONFIG.format(speedup=a.speedup, index=index))
    procs: list[subprocess.Popen[bytes]] = []
    log = open(tmp / f"{index}.log", "ab")  # noqa: SIM115 - closed below
    try:
        nats, url = start_nats_server(log)
        procs.append(nats)
        workers = {f"w{i}" for i in range(a.workers)}
        for w in sorted(workers):
            procs.append(subprocess.Popen([exe, "worker", "--nats", url, "--id", w, "--config", str(cfg)],
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        ports = {f: _port() for f in ("a", "b")}
        fronts = {}
        for f in ("a", "b"):
            fronts[f] = subprocess.Popen([exe, "frontend", "--nats", url, "--port", str(ports[f]), "--config",
                                          str(cfg)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            procs.append(fronts[f])
            time.sleep(0.3)  # a is the older
        deadline = time.monotonic() + 60
        while True:
            try:
                h = {f: _health(ports[f]) for f in ports}
                ok = all({w["id"] for w in h[f]["workers"] if w["health"] == "healthy"} == workers for f in h)
                if ok and index == "sharded":
                    ok = all(len(h[f]["frontend"]["index"]["frontends"]) == 2 for f in h)
                if ok:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{index}: the deployment did not come up (log: {tmp / f'{index}.log'})")
            time.sleep(0.2)
        # each conversation's first turn through b, its next turn (timed) through a
        lat, home = [], 0
        cpu0 = {f: cpu_seconds(fronts[f].pid) for f in fronts}
        for i in range(a.requests):
            first = f"conversation {i} {index} " + TEXT
            _, w1 = _post(ports["b"], first)
            time.sleep(a.gap)  # the holder's KV events reach its owner
            dt, w2 = _post(ports["a"], first + " and the next turn of it")
            lat.append(dt)
            home += w1 == w2
        cpu = {f: (cpu_seconds(fronts[f].pid) - cpu0[f]) / a.requests for f in fronts}
        stats = _health(ports["a"])["frontend"]["index"]
        return {"p50_ms": median(lat) * 1e3, "p99_ms": sorted(lat)[int(0.99 * (len(lat) - 1))] * 1e3,
                "home": home / a.requests, "cpu_a_us": cpu["a"] * 1e6, "cpu_b_us": cpu["b"] * 1e6,
                "late": float(stats.get("late", 0)), "asked": float(stats.get("asked", 0))}
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait(10)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--speedup", type=float, default=20.0)
    ap.add_argument("--gap", type=float, default=0.01, help="seconds between a first turn and its next")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="60 requests, one round")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.rounds = 60, 1
    print(f"{a.workers} simulated workers (x{a.speedup:g}), 2 frontends, {a.requests} conversations per mode and "
          f"round, {a.rounds} rounds, {os.cpu_count()} CPUs")
    rows: dict[str, list[dict[str, float]]] = {"replica": [], "sharded": []}
    with tempfile.TemporaryDirectory(prefix="ta-index-shards-") as tmp:
        for _ in range(a.rounds):
            for mode in rows:
                rows[mode].append(run_mode(mode, a, Path(tmp)))
    table = []
    for mode, rs in rows.items():
        m = {k: median([r[k] for r in rs]) for k in rs[0]}
        table.append([mode, f"{m['p50_ms']:.2f}", f"{m['p99_ms']:.2f}", f"{m['home']:.0%}", f"{m['cpu_a_us']:,.0f}",
                      f"{m['cpu_b_us']:,.0f}", f"{m['late']:.0f} of {m['asked']:.0f}" if mode == "sharded" else "-"])
    print_table("A's requests (each a conversation's next turn; its first turn went through B)",
                ["index", "next turn p50 ms", "p99 ms", "to its holder", "A CPU us/request", "B CPU us/request",
                 "late answers"], table)
    r, s = ({k: median([x[k] for x in rows[m]]) for k in rows[m][0]} for m in ("replica", "sharded"))
    print(f"sharded / replica: p50 {s['p50_ms'] / r['p50_ms']:.2f}x (+{s['p50_ms'] - r['p50_ms']:.2f} ms), "
          f"p99 {s['p99_ms'] / r['p99_ms']:.2f}x; frontends' CPU per routed request (A's and B's, both turns) "
          f"{(s['cpu_a_us'] + s['cpu_b_us']) / (r['cpu_a_us'] + r['cpu_b_us']):.2f}x")


if __name__ == "__main__":
    main()
