"""Tenant isolation: one tenant floods a small fleet, another sends a request now and then; what the
quiet tenant's TTFT is with and without a per-tenant limit on the noisy one
(``control_plane.tenant_limits``).

`thunderagent serve` in its own process (2 simulated workers with few sequence slots, slowed down so
that this machine drives them to saturation), API keys on, two tenants:

- **noisy**: ``--noisy-clients`` closed-loop clients, each streaming long completions back to back
  (on a 429 it waits ``Retry-After``-ms, at most 0.2 s, and sends again);
- **quiet**: one short streamed completion every ``--quiet-every`` seconds (open loop).

Arms, each on a fresh server, interleaved and repeated (``--repeat``): ``off`` (no tenant limit: the
holding queue's fairness across tenants is all there is), ``on`` (``noisy: {max_in_flight: N}``,
N = ``--cap``, below the fleet's sequence slots) and ``tokens`` (``noisy: {tokens_per_min: T,
token_burst: B}``, ``--noisy-tpm`` / ``--noisy-token-burst``). Reported per arm, medians over the
repeats: the quiet tenant's TTFT p50 / p99, the noisy tenant's completions per second and tokens per
minute (prompt + completion, from the server's ``thunderagent_tenant_tokens_total``), and the 429s
each got. Ratios are against ``off``, measured in the same run; for ``tokens``, the noisy tenant's
tokens per minute against what its bucket allows over the arm (the burst plus the rate).

Run: ``.venv/bin/python bench/tenant_isolation.py`` (about 2 minutes; ``--seconds 8 --repeat 1`` for a
quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, pct, print_table  # noqa: E402
from overload import ServeProcess  # noqa: E402

MODEL = "thunderagent-sim"
NOISY, QUIET, ADMIN = (secrets.token_urlsafe(24) for _ in range(3))
CONFIG = """\
control_plane:
  api_keys: {{"{noisy}": noisy, "{quiet}": quiet}}
  admin_keys: ["{admin}"]
{limits}
execution_group:
  nodes:
    - count: 2
      max_batch_size: {slots}
      timing: {{speedup: {speed}}}
routing: {{seed: 1}}
"""


@dataclass
class Arm:
    quiet_ttft: list[float] = field(default_factory=list)
    quiet_429: int = 0
    quiet_failed: int = 0
    noisy_done: int = 0
    noisy_429: int = 0
    noisy_tokens: int = 0  # prompt + completion, as the server counted them
    seconds: float = 0.0


def _prompt(tag: str, i: int, tokens: int) -> str:
    """About ``tokens`` tokens (the byte tokenizer: one per byte), a distinct first block per request
    (no cache reuse between requests)."""
    return (f"{tag} {i:08d}: " + "summarise the change and list the risks. " * (tokens // 41 + 1))[:tokens]


async def _stream(session: aiohttp.ClientSession, base: str, key: str, prompt: str,
                  max_tokens: int) -> tuple[int, float | None, float]:
    """(status, TTFT or None, Retry-After seconds) of one streamed completion."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with session.post(base + "/v1/completions", json=body,
                            headers={"Authorization": "Bearer " + key}) as r:
        if r.status != 200:
            await r.read()
            return r.status, None, float(r.headers.get("retry-after-ms", "100")) / 1000
        ttft = None
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = loop.time() - t0
        return 200, ttft, 0.0


async def run_arm(limits: str, seconds: float, noisy_clients: int, quiet_every: float, slots: int,
                  speed: float, tokens: int) -> Arm:
    cfg = CONFIG.format(noisy=NOISY, quiet=QUIET, admin=ADMIN, limits=limits, slots=slots, speed=speed)
    srv = ServeProcess(cfg, Path(tempfile.gettempdir()) / "tenant-isolation-serve.log")
    arm = Arm()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            await srv.ready(session)
            for i in range(4):  # warm up
                await _stream(session, srv.base, QUIET, _prompt("warm", i, tokens), 4)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            end = t0 + seconds

            async def noisy(c: int) -> None:
                i = 0
                while loop.time() < end:
                    i += 1
                    status, _, wait = await _stream(session, srv.base, NOISY, _prompt(f"noisy{c}", i, tokens), 64)
                    if status == 200:
                        arm.noisy_done += 1
                    else:
                        arm.noisy_429 += status == 429
                        await asyncio.sleep(min(wait, 0.2))

            async def quiet_one(i: int) -> None:
                status, ttft, _ = await _stream(session, srv.base, QUIET, _prompt("quiet", i, tokens), 8)
                if status == 200 and ttft is not None:
                    arm.quiet_ttft.append(ttft)
                elif status == 429:
                    arm.quiet_429 += 1
                else:
                    arm.quiet_failed += 1

            flood = [asyncio.create_task(noisy(c)) for c in range(noisy_clients)]
            await asyncio.sleep(min(1.0, seconds / 4))  # the flood fills the fleet first
            shots, k = [], 0
            while loop.time() < end:
                shots.append(asyncio.create_task(quiet_one(k)))
                k += 1
                await asyncio.sleep(quiet_every)
            await asyncio.gather(*flood, *shots)
            arm.seconds = loop.time() - t0
            async with session.get(srv.base + "/metrics", headers={"Authorization": "Bearer " + ADMIN}) as r:
                text = await r.text()
            arm.noisy_tokens = sum(int(float(v)) for v in re.findall(
                r'thunderagent_tenant_tokens_total\{kind="\w+",tenant="noisy"\} (\S+)', text))
    finally:
        srv.stop()
    return arm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each arm's load")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--noisy-clients", type=int, default=32)
    ap.add_argument("--quiet-every", type=float, default=0.25)
    ap.add_argument("--slots", type=int, default=4, help="sequence slots per worker (2 workers)")
    ap.add_argument("--cap", type=int, default=4, help="the noisy tenant's max_in_flight in arm on")
    ap.add_argument("--speed", type=float, default=0.25, help="simulated engine speed (timing.speedup)")
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="prompt length of every request")
    ap.add_argument("--noisy-tpm", type=int, default=60_000, help="the noisy tenant's tokens_per_min in arm tokens")
    ap.add_argument("--noisy-token-burst", type=int, default=10_000, help="its token_burst in arm tokens")
    a = ap.parse_args()
    arms = {"off": "", "on": f"  tenant_limits: {{noisy: {{max_in_flight: {a.cap}}}}}",
            "tokens": f"  tenant_limits: {{noisy: {{tokens_per_min: {a.noisy_tpm}, "
                      f"token_burst: {a.noisy_token_burst}}}}}"}
    results: dict[str, list[Arm]] = {name: [] for name in arms}
    for _ in range(a.repeat):
        for name, limits in arms.items():
            results[name].append(asyncio.run(run_arm(limits, a.seconds, a.noisy_clients, a.quiet_every, a.slots,
                                                     a.speed, a.prompt_tokens)))
    rows, summary = [], {}
    for name, runs in results.items():
        p50 = median([pct(r.quiet_ttft, 0.5) for r in runs]) * 1e3
        p99 = median([pct(r.quiet_ttft, 0.99) for r in runs]) * 1e3
        rate = median([r.noisy_done / r.seconds for r in runs])
        tpm = median([r.noisy_tokens / r.seconds * 60 for r in runs])
        allowed = median([(a.noisy_token_burst + a.noisy_tpm / 60 * r.seconds) / r.seconds * 60 for r in runs])
        summary[name] = (p50, p99, rate, tpm, allowed)
        rows.append([name, f"{p50:.0f}", f"{p99:.0f}", f"{rate:.1f}", f"{tpm:,.0f}", sum(r.noisy_429 for r in runs),
                     sum(r.quiet_429 for r in runs), sum(r.quiet_failed for r in runs),
                     sum(len(r.quiet_ttft) for r in runs)])
    print(f"2 workers x {a.slots} slots (engine speed {a.speed}), prompts of {a.prompt_tokens} tokens; noisy: "
          f"{a.noisy_clients} closed-loop clients (64 tokens each), quiet: one request / {a.quiet_every} s "
          f"(8 tokens); {a.seconds:.0f} s per arm, "
          f"{a.repeat} repeat(s), medians; arm on: noisy max_in_flight {a.cap}; arm tokens: noisy tokens_per_min "
          f"{a.noisy_tpm:,}, token_burst {a.noisy_token_burst:,}")
    print_table("quiet tenant's TTFT and the noisy tenant's throughput",
                ["arm", "quiet TTFT p50 ms", "quiet TTFT p99 ms", "noisy completions/s", "noisy tokens/min",
                 "noisy 429s", "quiet 429s", "quiet failed", "quiet served"], rows)
    off = summary["off"]
    for name in ("on", "tokens"):
        arm = summary[name]
        print(f"{name} / off: quiet TTFT p50 {arm[0] / off[0]:.2f}x, p99 {arm[1] / off[1]:.2f}x; "
              f"noisy completions/s {arm[2] / off[2]:.2f}x")
    tok = summary["tokens"]
    print(f"tokens: the noisy tenant took {tok[3]:,.0f} tokens/min, {tok[3] / tok[4]:.2f}x what its bucket allows "
          f"over the arm ({tok[4]:,.0f}: token_burst {a.noisy_token_burst:,} + {a.noisy_tpm:,}/min)")


if __name__ == "__main__":
    main()
