"""A data-parallel vLLM server behind ThunderAgent: one worker per rank against one worker for the whole server.

Server: one vLLM CPU server (the test suite's build, ``.venv-vllm`` or ``THUNDERAGENT_VLLM_PYTHON``) run with
``--data-parallel-size 2`` (two engine cores, two KV caches, one API server), serving a random-weight Llama built
here, KV events on ``tcp://*:P`` (rank r publishes on P + r).

Arms (same server; its prefix cache reset between arms, arms interleaved over ``--rounds``):
- ``whole server``: the server listed once, without ``data_parallel_rank``: ThunderAgent sends every request to
  it and vLLM's API server picks the rank (its own balancing, blind to the caches);
- ``a worker per rank``: the server listed once per rank (``data_parallel_rank``): ThunderAgent routes each
  request to a rank on the KV index fed by that rank's events and names it in ``X-data-parallel-rank``.

Workload: ``--conversations`` multi-turn chats run concurrently, each ``--turns`` turns (a completion of
``--max-tokens``, the answer and ``--grow`` more words appended), all seeded. Reported per arm: prefix hit (vLLM's
own ``cached_tokens`` / prompt tokens over the later turns: the first turn of a conversation has nothing to hit),
request latency p50 / p90 (client side, whole completions) and wall time.

Run: ``THUNDERAGENT_VLLM_PYTHON=.venv-vllm/bin/python python bench/dp_ranks.py [--conversations 16] [--turns 5]
[--rounds 2]`` (the server starts in 1-2 minutes; each arm takes seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]

from _common import print_table
from support.server import running_server
from support.waiting import free_port_pair

from tests.engines.tiny_model import _WORDS, build_tiny_llama
from tests.engines.vllm_env import BLOCK_SIZE, vllm_python
from thunderagent.config import parse_config

RANKS = 2


def start_server(python: Path, model: Path, workdir: Path) -> tuple[subprocess.Popen[bytes], int, int, int]:
    port, events, replay = free_port_pair(), free_port_pair(), free_port_pair()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
          "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
           "--max-model-len", "2048", "--max-num-seqs", "8", "--enable-prompt-tokens-details",
           "--kv-events-config", json.dumps(kv), "--data-parallel-size", str(RANKS)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_SERVER_DEV_MODE": "1"}
    log = (workdir / "vllm-dp.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited: see {workdir / 'vllm-dp.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    print(f"vLLM --data-parallel-size {RANKS} ready in {time.monotonic() - t0:.0f} s")
                    return proc, port, events, replay
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("vLLM did not start in 600 s")


def config(model: Path, port: int, events: int, replay: int, per_rank: bool) -> object:
    url = f"http://127.0.0.1:{port}"
    if per_rank:
        endpoints = [{"url": url, "kv_events": f"tcp://127.0.0.1:{events + r}",
                      "kv_replay": f"tcp://127.0.0.1:{replay + r}", "data_parallel_rank": r} for r in range(RANKS)]
    else:  # (rank 0's events only: with one worker there is nothing to choose between)
        endpoints = [{"url": url, "kv_events": f"tcp://127.0.0.1:{events}", "kv_replay": f"tcp://127.0.0.1:{replay}"}]
    return parse_config({"model": str(model), "routing": {"seed": 7},
                         "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": 10},
                         "execution_group": {"nodes": [{"engine": "vllm", "block_size": BLOCK_SIZE,
                                                        "endpoints": endpoints}]}}, "bench")


async def run_arm(cfg: object, a: argparse.Namespace, port: int) -> dict[str, float]:
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache",
                                                       method="POST"), timeout=30) as r:
        assert r.status == 200
    async with running_server(cfg, timeout=120) as srv:
        t_wait = time.monotonic()
        while len(srv.fleet.routable()) < len(srv.fleet.workers) and time.monotonic() - t_wait < 60:
            await asyncio.sleep(0.2)
        lat: list[float] = []
        prompt = cached = 0

        async def conversation(c: int) -> None:
            nonlocal prompt, cached
            rng = random.Random(a.seed * 1000 + c)
            text = f"conversation {c}: " + " ".join(rng.choice(_WORDS) for _ in range(a.start))
            for turn in range(a.turns):
                t0 = time.perf_counter()
                out = await srv.client.completions.create(model=srv.fleet.model_name, prompt=text,
                                                          max_tokens=a.max_tokens, temperature=0, timeout=120)
                lat.append(time.perf_counter() - t0)
                if turn:
                    prompt += out.usage.prompt_tokens
                    details = out.usage.prompt_tokens_details
                    cached += (details.cached_tokens or 0) if details else 0
                text += out.choices[0].text + " " + " ".join(rng.choice(_WORDS) for _ in range(a.grow))

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(a.conversations)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"hit": cached / max(1, prompt), "p50": statistics.median(lat), "p90": lat[int(0.9 * (len(lat) - 1))],
            "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--start", type=int, default=120, help="words of a conversation's first prompt")
    ap.add_argument("--grow", type=int, default=40, help="words appended each turn")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    model = build_tiny_llama(workdir / "model")
    proc, port, events, replay = start_server(vllm_python(workdir), model, workdir)
    arms = {"whole server (vLLM balances)": False, "a worker per rank": True}
    got: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
    try:
        for _ in range(a.rounds):
            for name, per_rank in arms.items():
                got[name].append(asyncio.run(run_arm(config(model, port, events, replay, per_rank), a, port)))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    rows = []
    for name, runs in got.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append([name, f"{100 * med['hit']:.1f} %", f"{1000 * med['p50']:.0f}", f"{1000 * med['p90']:.0f}",
                     f"{med['wall']:.1f}"])
    print_table(f"vLLM --data-parallel-size {RANKS}, {a.conversations} conversations x {a.turns} turns "
                f"(medians of {a.rounds} rounds)", ["arm", "prefix hit (later turns)", "latency p50 ms",
                                                    "latency p90 ms", "wall s"], rows)


if __name__ == "__main__":
    main()
