"""A frontend killed (SIGKILL) and restarted in the middle of a 100-stream load over NATS.

nats-server, 3 ``thunderagent worker`` processes and 2 ``thunderagent frontend`` replicas; 100
clients stream one completion each, half through each frontend. When most streams are under way,
frontend A is killed with SIGKILL. What must hold:

- nothing hangs: every attempt ends within its client timeout;
- a stream on B completes; a stream on A ends at once with a clear error (its connection is cut),
  and the client's retry on B completes: every client finishes;
- the workers abort A's requests within one request lease (no engine keeps generating for a dead
  frontend), as their logs show;
- A restarted rebuilds its index from the workers' dumps in <= 2 s, and a repeated prompt through
  it goes to the worker holding it, with a cache hit.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime

import pytest

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")
aiohttp = pytest.importorskip("aiohttp")

from nats_cluster import Cluster, wait_until  # noqa: E402  (tests/integration is on sys.path)

pytestmark = [pytest.mark.nats, pytest.mark.integration, pytest.mark.reliability]

MODEL = "thunderagent-sim"
WORKER = "x-thunderagent-worker"
STREAMS = 100
HB, MISSES = 0.2, 3  # the lease: 0.6 s
TEXT = ("A frontend may die at any moment; its workers must notice, its clients must not wait forever, "
        "and its replacement must know the fleet's caches before it serves. ") * 3


@dataclass(slots=True)
class Attempt:
    frontend: str
    acked: float | None = None  # monotonic time of the first streamed chunk
    ended: float | None = None
    worker: str = ""
    finish: str | None = None  # the stream's finish_reason, if one came
    error: str = ""  # a cut connection or an HTTP error


def prompt(i: int) -> str:
    return f"Client {i}. " + TEXT


async def stream_once(session: aiohttp.ClientSession, port: int, name: str, i: int, log: list[Attempt]) -> Attempt:
    a = Attempt(name)
    log.append(a)
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": 160, "stream": True}
    try:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            if resp.status != 200:
                a.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return a
            a.worker = resp.headers.get(WORKER, "")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if a.acked is None:
                    a.acked = time.monotonic()
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    a.finish = choice.get("finish_reason") or a.finish
    except asyncio.TimeoutError:
        a.error = "hang"  # the client timeout ran out: what must never happen
    except aiohttp.ClientError as exc:
        a.error = f"{type(exc).__name__}: {exc}"
    finally:
        a.ended = time.monotonic()
    return a


async def client(session: aiohttp.ClientSession, ports: dict[str, int], i: int, log: list[Attempt]) -> list[Attempt]:
    """One stream through its frontend; on a cut connection or an error, one retry on the other."""
    order = ["fa", "fb"] if i % 2 == 0 else ["fb", "fa"]
    attempts = [await stream_once(session, ports[order[0]], order[0], i, log)]
    first = attempts[0]
    if first.error or first.finish not in ("length", "stop"):
        attempts.append(await stream_once(session, ports[order[1]], order[1], i, log))
    return attempts


def abort_lines(cluster: Cluster, frontend_id: str) -> list[tuple[float, int]]:
    """(wall time, requests) of every worker log line saying it aborted ``frontend_id``'s requests."""
    pat = re.compile(r"^(\S+ \S+) WARNING .*frontend\(s\) (\S+) silent for \S+: (\d+) requests aborted")
    out = []
    for w in ("w0", "w1", "w2"):
        for line in (cluster.tmp / f"{w}.log").read_text(errors="replace").splitlines():
            m = pat.match(line)
            if m and frontend_id in m.group(2).split(", "):
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((t, int(m.group(3))))
    return out


def test_frontend_killed_and_restarted_under_100_streams(tmp_path):
    cluster = Cluster(tmp_path, heartbeat_interval=HB, misses=MISSES)
    try:
        asyncio.run(_scenario(cluster))
    finally:
        cluster.close()
        print(cluster.logs())  # captured: pytest shows it only when the test failed


async def _scenario(cluster: Cluster) -> None:
    cluster.start_nats()
    workers = {"w0", "w1", "w2"}
    for w in sorted(workers):
        cluster.start_worker(w, "--speedup", "0.2")  # 5x slower than real time: a stream lasts seconds
    ports = {f: cluster.start_frontend(f) for f in ("fa", "fb")}
    for f in ports:
        wait_until(lambda f=f: cluster.workers(f) == workers, 30, f"{f} to discover 3 workers")
    fa_id = cluster.health("fa")["frontend"]["id"]
    lease = HB * MISSES

    timeout = aiohttp.ClientTimeout(total=40, sock_read=12)  # > the 8 s stall rule: a hang, not a slow worker
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        log: list[Attempt] = []
        tasks = [asyncio.create_task(client(session, ports, i, log)) for i in range(STREAMS)]

        def streaming(name: str) -> int:  # acknowledged (a chunk streamed), not ended
            return sum(1 for a in log if a.frontend == name and a.acked is not None and a.ended is None)

        # kill A when most of its streams are under way
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while loop.time() < deadline and streaming("fa") < STREAMS // 2 * 3 // 5:
            await asyncio.sleep(0.05)
        in_flight = streaming("fa")
        assert in_flight and streaming("fb"), f"the load never got under way: {log[:3]} ({len(log)} attempts)"
        t_kill_wall, t_kill = time.time(), time.monotonic()
        cluster.kill("fa")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 90)

    # nothing hung, every client finished its completion (on B after A died)
    hung = [(i, a) for i, r in enumerate(results) for a in r if a.error == "hang"]
    assert not hung, f"attempts that hung: {hung[:5]}"
    unfinished = [(i, r) for i, r in enumerate(results) if r[-1].finish not in ("length", "stop")]
    assert not unfinished, f"{len(unfinished)} clients did not complete: {unfinished[:3]}"
    # streams on B were never disturbed
    on_b = [r[0] for r in results if r[0].frontend == "fb"]
    assert all(a.finish in ("length", "stop") and not a.error for a in on_b), [a for a in on_b if a.error][:3]
    # streams on A that were still running at the kill ended at once with a clear error
    cut = [r[0] for r in results if r[0].frontend == "fa" and r[0].ended is not None and r[0].ended >= t_kill]
    assert len(cut) >= in_flight - 2, f"{in_flight} streams of A in flight at the kill, {len(cut)} cut"
    assert cut, f"no stream of A was in flight at the kill ({in_flight} clients were)"
    assert all(a.error and a.ended - t_kill < 2.0 for a in cut), [(a.error, a.ended - t_kill) for a in cut[:3]]

    # the workers aborted A's requests within one lease of its death (plus scheduling slack)
    lines = wait_until(lambda: abort_lines(cluster, fa_id), 5, "workers to abort the dead frontend's requests")
    late = [(t - t_kill_wall, n) for t, n in lines if t - t_kill_wall > lease + 0.5]
    assert not late, f"aborted after {late} s (lease {lease} s)"
    aborted = sum(n for _, n in lines)
    # every stream of A a worker was serving (at least those acknowledged at the kill, less a few
    # that may have finished on their own in the lease) was aborted by its worker
    assert aborted >= in_flight * 4 // 5, f"{aborted} requests aborted, {in_flight} of A's streams were running"

    # restart A: its index is rebuilt from dumps in <= 2 s, and it routes repeated prompts to their holders
    cluster.start_frontend("fa")
    health = wait_until(lambda: cluster.health("fa"), 30, "restarted fa to answer /health")
    rebuild_s = health["frontend"]["index_rebuild_s"]
    assert rebuild_s <= 2.0, f"index rebuilt in {rebuild_s}s"
    wait_until(lambda: cluster.indexed("fa") == cluster.indexed("fb"), 5, "the restarted index to match B's")
    ca = cluster.client("fa")
    checked = 0
    # a cut stream was prefilled on one worker and retried on another: both hold it; check the others
    held_once = [(i, r[-1].worker) for i, r in enumerate(results) if len({a.worker for a in r}) == 1][:20]
    assert len(held_once) == 20
    for i, holder in held_once:
        raw = ca.completions.with_raw_response.create(model=MODEL, prompt=prompt(i), max_tokens=4)
        body = raw.parse()
        assert raw.headers[WORKER] == holder, f"client {i}: held by {holder}, routed to {raw.headers[WORKER]}"
        assert body.usage.prompt_tokens_details.cached_tokens >= 64 * 4
        checked += 1
    print(f"\n{len(cut)} streams of A cut at the kill (retried on B); workers aborted {aborted} requests "
          f"{max(t for t, _ in lines) - t_kill_wall:.2f}s after the kill (lease {lease}s); "
          f"restarted A rebuilt its index in {rebuild_s:.3f}s; {checked} repeats routed to their holders")

