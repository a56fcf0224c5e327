"""What ``control_plane.tracing`` costs a request: CPU and latency per request with tracing off, on with every span
recorded, and on with the client's ``traceparent`` saying "not sampled", interleaved in one run.

One process runs ThunderAgent (``engine: openai``, holding queue off) in front of ``bench/fake_backend.py``'s server
(instant answers) and a sequential client; the collector is a separate process (``python -m http.server``: it
refuses the POST, so the exporter does all its work, protobuf and HTTP, and the run stays small). CPU is this
process's (frontend, backend and client together), so read the differences between arms, not the levels.

    .venv/bin/python bench/tracing_cost.py                 # 3 rounds x 1,500 requests per arm, ~30 s
    .venv/bin/python bench/tracing_cost.py --requests 500 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table  # noqa: E402
from fake_backend import MODEL, create_backend  # noqa: E402

from thunderagent.config import parse_config  # noqa: E402
from thunderagent.frontend.app import FLEET_KEY, create_app  # noqa: E402
from thunderagent.frontend.server import FrontendRunner  # noqa: E402

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-"
ARMS = {"off": (False, "01"), "on, sampled": (True, "01"), "on, not sampled": (True, "00")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _site(app: web.Application, runner_cls: type = web.AppRunner) -> tuple[web.BaseRunner, str]:
    runner = runner_cls(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def _arm(backend_url: str, collector: str, tracing: bool, flags: str, n: int) -> tuple[float, float]:
    cp: dict[str, object] = {"heartbeat_interval": 0.5, "heartbeat_misses": 5}
    if tracing:
        cp["tracing"] = {"otlp_endpoint": collector}
    cfg = parse_config({"model_name": MODEL, "control_plane": cp, "scheduler": {"enabled": False},
                        "execution_group": {"nodes": [{"engine": "openai", "block_size": 16,
                                                       "endpoints": [{"url": backend_url}]}]}}, "bench")
    app = create_app(cfg)
    runner, base = await _site(app, FrontendRunner)
    try:
        fleet = app[FLEET_KEY]
        while not fleet.routable():
            await asyncio.sleep(0.05)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        headers = {"traceparent": PARENT + flags}
        async with aiohttp.ClientSession() as s:
            for _ in range(100):  # warm up
                async with s.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                async with s.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
            return (time.process_time() - c0) / n * 1e6, (time.perf_counter() - w0) / n * 1e6
    finally:
        await runner.cleanup()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    logging.disable(logging.ERROR)  # (the collector's refusals)
    port = _free_port()
    collector = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    backend, backend_url = await _site(create_backend())
    try:
        time.sleep(0.5)
        got: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
        for _ in range(a.rounds):
            for arm, (tracing, flags) in ARMS.items():
                got[arm].append(await _arm(backend_url, f"http://127.0.0.1:{port}/v1/traces", tracing, flags,
                                           a.requests))
    finally:
        collector.kill()
        await backend.cleanup()
    base = median([c for c, _ in got["off"]])
    rows = [[arm, f"{median([c for c, _ in v]):.0f}", f"{median([c for c, _ in v]) - base:+.0f}",
             f"{median([w for _, w in v]):.0f}"] for arm, v in got.items()]
    print_table(f"Per request, medians of {a.rounds} rounds x {a.requests:,} sequential requests "
                "(CPU: this process, client and fake backend included)",
                ["arm", "CPU µs", "vs off", "latency µs"], rows)


if __name__ == "__main__":
    asyncio.run(main())
