"""Strict prefill/decode disaggregation (``routing.fallback_to_local: false``) against the default local
fallback, live: what a decode worker's streams gain when it never prefills, and what the wait for the
prefill pool costs in time to first token.

`thunderagent serve` in its own process, simulated workers: one ``role: prefill`` worker whose transfer
plane takes ``--cap`` transfers at once, and two ``role: decode`` workers, ``disaggregation.mode:
always``. One open-loop client streams requests with distinct ``--prompt-tokens``-token prompts (no
cache reuse) and ``--output-tokens`` tokens at ``--rate`` requests/s (Poisson, seeded) for ``--seconds``.
With the fallback a plan that finds the plane at its cap prefills on its decode worker (whose decoders
then wait for that prefill's pass); strict, it waits for a slot.

Arms, each on a fresh server, alternated and repeated (``--repeat``): ``fallback`` (the default, true)
and ``strict``. Reported per arm, medians over the repeats: TTFT p50 / p99, the inter-token gap p50 /
p99 over every stream (what a decode worker's prefills stall), completions, errors, and the server's
``thunderagent_pd_*`` counters (remote prefills started, local fallbacks, requests routed again).
Ratios are strict / fallback, measured in the same run.

Run: ``.venv/bin/python bench/pd_strict.py`` (about 2 minutes; ``--seconds 8 --repeat 1`` for a quick
look).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import counter, median, pct, print_table  # noqa: E402
from overload import ServeProcess  # noqa: E402

MODEL = "thunderagent-sim"
CONFIG = """\
execution_group:
  nodes:
    - role: prefill
      count: 1
      timing: {{speedup: {speed}}}
      kv_cache_transfer: {{enabled: true, max_inflight: {cap}, sim_block_bytes: 4096}}
    - role: decode
      count: 2
      timing: {{speedup: {speed}}}
routing:
  seed: 1
  fallback_to_local: {fallback}
  disaggregation: {{mode: always}}
"""


@dataclass
class Arm:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # inter-token gaps of every stream
    done: int = 0
    errors: int = 0
    started: float = 0.0  # remote prefills started (server's counter)
    fallbacks: float = 0.0
    rerouted: float = 0.0


def _prompt(i: int, tokens: int) -> str:
    """About ``tokens`` tokens (the byte tokenizer: one per byte), a distinct first block per request."""
    return (f"req {i:08d}: " + "explain the design and list its risks. " * (tokens // 38 + 1))[:tokens]


async def _one(session: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int, arm: Arm) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            arm.errors += 1
            return
        last = None
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = loop.time()
            if last is None:
                arm.ttft.append(now - t0)
            else:
                arm.gaps.append(now - last)
            last = now
        arm.done += 1


async def run_arm(fallback: bool, a: argparse.Namespace, seed: int) -> Arm:
    cfg = CONFIG.format(speed=a.speed, cap=a.cap, fallback=str(fallback).lower())
    srv = ServeProcess(cfg, Path(tempfile.gettempdir()) / "pd-strict-serve.log")
    arm = Arm()
    rng = random.Random(seed)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300)) as session:
            await srv.ready(session)
            loop = asyncio.get_running_loop()
            end = loop.time() + a.seconds
            tasks, i = [], 0
            while loop.time() < end:
                tasks.append(asyncio.create_task(_one(session, srv.base, _prompt(i, a.prompt_tokens),
                                                      a.output_tokens, arm)))
                i += 1
                await asyncio.sleep(rng.expovariate(a.rate))
            await asyncio.gather(*tasks)
            async with session.get(srv.base + "/metrics") as r:
                text = await r.text()
            arm.started = counter(text, "thunderagent_pd_transfers_started_total")
            arm.fallbacks = counter(text, "thunderagent_pd_fallbacks_total")
            arm.rerouted = counter(text, "thunderagent_pd_rerouted_total")
    finally:
        srv.stop()
    return arm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each arm's load")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    ap.add_argument("--cap", type=int, default=1, help="the plane's max_inflight")
    ap.add_argument("--speed", type=float, default=1.0, help="simulated engine speed (timing.speedup)")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--output-tokens", type=int, default=64)
    a = ap.parse_args()
    results: dict[str, list[Arm]] = {"fallback": [], "strict": []}
    for k in range(a.repeat):
        for name in results:
            results[name].append(asyncio.run(run_arm(name == "fallback", a, seed=k)))
    rows, summary = [], {}
    for name, runs in results.items():
        vals = (median([pct(r.ttft, 0.5) for r in runs]) * 1e3, median([pct(r.ttft, 0.99) for r in runs]) * 1e3,
                median([pct(r.gaps, 0.5) for r in runs]) * 1e3, median([pct(r.gaps, 0.99) for r in runs]) * 1e3)
        summary[name] = vals
        rows.append([name, *(f"{v:.0f}" for v in vals), sum(r.done for r in runs), sum(r.errors for r in runs),
                     f"{sum(r.started for r in runs):.0f}", f"{sum(r.fallbacks for r in runs):.0f}",
                     f"{sum(r.rerouted for r in runs):.0f}"])
    print(f"1 prefill + 2 decode simulated workers (speed {a.speed}), plane cap {a.cap}, mode always; "
          f"{a.rate:g} req/s of {a.prompt_tokens}-token prompts, {a.output_tokens} tokens streamed; "
          f"{a.seconds:.0f} s per arm, {a.repeat} repeat(s), medians (counts summed)")
    print_table("strict disaggregation against the local fallback",
                ["arm", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "completed", "errors",
                 "remote prefills", "local fallbacks", "routed again"], rows)
    f, s = summary["fallback"], summary["strict"]
    print(f"strict / fallback: TTFT p50 {s[0] / f[0]:.2f}x, p99 {s[1] / f[1]:.2f}x; "
          f"ITL p50 {s[2] / f[2]:.2f}x, p99 {s[3] / f[3]:.2f}x (below 1: strict better)")


if __name__ == "__main__":
    main()
