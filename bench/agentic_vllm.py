"""Agent programs in a closed loop on real vLLM servers, live: program pacing against plain kv_aware.

Fleet: two vLLM CPU servers (the test suite's build, ``.venv-vllm`` or ``THUNDERAGENT_VLLM_PYTHON``), one
core each, serving a random-weight Llama built here (8 layers, hidden 256: prefill costs enough on a core
that recomputing a context shows in the step rate). Their KV is made small (``--num-gpu-blocks-override``)
so that the programs' live context is ``--oversub`` times the fleet's KV. ThunderAgent (``serve``, in its
own process, ``engine: vllm`` with the servers' KV events) stands in front.

Programs: ``--programs`` agents in a closed loop, each with its own ``x-thunderagent-program-id``. A program
starts from one of ``--groups`` shared system prompts and a task of its own, then loops: a streamed chat
completion (``--max-tokens``), a tool call (sleep ``--tool-s`` seconds, drawn uniformly), the answer and the
tool's output appended to its messages. Once its prompt passes ``--max-context`` tokens it is released
(``POST /v1/programs/{id}/release``) and the same slot starts a new program. Every draw is seeded, so every
arm is offered the same programs; a closed loop still diverges in what it reaches by the end.

Arms (same servers; ThunderAgent restarted and vLLM's prefix cache reset between arms): ``kv_aware`` (serve's
defaults: the holding queue on, pacing off), ``pacing ours`` (``scheduler.pacing`` with its defaults) and
``pacing paper`` (the ThunderAgent paper's accounting and placement, not work-conserving); on request
``pacing ours, idle cached`` (``idle_resume: cached``). Per arm, over
``--duration`` seconds: steps/min (turns finished), prefix hit (vLLM's ``cached_tokens`` / prompt tokens, the
whole run), TTFT p50 / p99 (client side, first content), Jain's fairness of steps per program slot, pauses and
resumes (ThunderAgent's counters), program slots that finished no step.

Targets (issue 9, real vLLM live): prefix hit >= 4x plain kv_aware's, steps/min >= 1.2x, TTFT p99 <= 1.5x
kv_aware's, Jain no more than 0.05 below kv_aware's.

Run: ``THUNDERAGENT_VLLM_PYTHON=.venv-vllm/bin/python python bench/agentic_vllm.py [--duration 180]
[--programs 12] [--oversub 2.5] [--arms kv_aware "pacing ours" "pacing paper"] [--rounds 1]`` (two servers start
in 1-2 minutes; then ``--duration`` + ~20 s per arm).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]

from _common import counter, jain, knob, pct, print_table, read_chat_stream
from agentic_pacing import ARMS, arm
from support.waiting import free_port

from tests.engines.tiny_model import _WORDS, build_tiny_llama
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer, cpu_binding, start_ready, vllm_python


def pacing(name: str, knobs: dict[str, object]) -> dict[str, object]:
    """``scheduler.pacing`` of an arm (``agentic_pacing.arm``'s, the simulator bench's), as serve's
    config file gives it; ``knobs`` (``--pacing``) go into every pacing arm."""
    return arm(name, knobs).pacing.model_dump(mode="json", exclude_unset=True)


# -- the programs -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Stats:
    steps: list[int]
    ttft: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    errors: list[str] = field(default_factory=list)
    contexts: list[int] = field(default_factory=list)  # prompt tokens per step


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


async def program_slot(slot: int, a: argparse.Namespace, url: str, model: str, stats: Stats, end: float) -> None:
    """One slot: programs one after another, each until its context passes ``--max-context``."""
    rng = random.Random(a.seed * 1000 + slot)
    group = slot % a.groups
    system = words(random.Random(a.seed * 7 + group), a.system_words)
    gen = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        while time.monotonic() < end:
            pid = f"s{slot}-p{gen}"
            gen += 1
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": words(rng, rng.randint(*a.task_words))}]
            while time.monotonic() < end:
                t0 = time.monotonic()
                body = {"model": model, "messages": messages, "max_tokens": a.max_tokens, "stream": True,
                        "temperature": 0, "stream_options": {"include_usage": True}}
                try:
                    async with http.post(f"{url}/v1/chat/completions", json=body,
                                         headers={"x-thunderagent-program-id": pid}) as r:
                        if r.status != 200:
                            stats.errors.append(f"{r.status}: {(await r.text())[:200]}")
                            await asyncio.sleep(1.0)
                            continue
                        first, text, usage = await read_chat_stream(r, t0)
                except aiohttp.ClientError as exc:
                    stats.errors.append(repr(exc))
                    await asyncio.sleep(1.0)
                    continue
                if time.monotonic() > end:
                    break  # finished past the window: not counted
                stats.steps[slot] += 1
                if first is not None:
                    stats.ttft.append(first)
                if usage:
                    stats.prompt += usage["prompt_tokens"]
                    stats.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    stats.contexts.append(usage["prompt_tokens"])
                    if usage["prompt_tokens"] > a.max_context:
                        break
                await asyncio.sleep(rng.uniform(*a.tool_s))  # the tool runs
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": words(rng, rng.randint(*a.tool_words))}]
            async with http.post(f"{url}/v1/programs/{pid}/release") as r:
                await r.read()


async def drive(a: argparse.Namespace, url: str, model: str) -> Stats:
    stats = Stats(steps=[0] * a.programs)
    end = time.monotonic() + a.duration
    await asyncio.gather(*(program_slot(i, a, url, model, stats, end) for i in range(a.programs)))
    return stats


# -- servers ------------------------------------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def start_front(cfg: dict, work: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    log = (work / f"{name}.log").open("wb")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "thunderagent"), "serve", "--config", str(path),
                             "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"thunderagent serve exited ({proc.returncode}); see {log.name}")
        try:
            health = json.loads(http_get(f"{url}/health"))
            workers = health.get("workers") or []
            if workers and all(w["health"] == "healthy" and not w["out_of_routing"] for w in workers):
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("thunderagent serve not healthy after 120 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def reset_cache(servers: list[VllmServer]) -> None:
    for s in servers:
        req = urllib.request.Request(f"{s.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=12)
    ap.add_argument("--groups", type=int, default=3, help="shared system prompts")
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--task-words", type=int, nargs=2, default=(150, 400))
    ap.add_argument("--tool-words", type=int, nargs=2, default=(40, 120))
    ap.add_argument("--tool-s", type=float, nargs=2, default=(1.0, 4.0))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=1700, help="release a program past this many prompt tokens")
    ap.add_argument("--oversub", type=float, default=2.5, help="programs' live context / fleet KV")
    ap.add_argument("--live-context", type=int, default=1100,
                    help="a program's mean prompt tokens, for sizing the KV (the run prints the measured one)")
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--arms", nargs="+", default=["kv_aware", "pacing ours", "pacing paper"],
                    help=f"of {', '.join(ARMS)}")
    ap.add_argument("--rounds", type=int, default=1, help="run the arms this many times, interleaved")
    ap.add_argument("--pacing", type=knob, nargs="*", default=[], metavar="KEY=VALUE",
                    help="scheduler.pacing fields for every pacing arm (e.g. max_pause_s=10); checked by serve")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    knobs = dict(a.pacing)
    for arm in a.arms:
        pacing(arm, knobs)
    blocks = math.ceil(a.programs * a.live_context / a.oversub / 2 / BLOCK_SIZE)
    blocks = max(blocks, math.ceil(2048 / BLOCK_SIZE) + 1)  # vLLM wants max_model_len to fit
    with tempfile.TemporaryDirectory(prefix="agentic-vllm-") as d:
        work = Path(d)
        model = build_tiny_llama(work / "model", hidden=256, heads=4, layers=8, intermediate=704)
        python = vllm_python(work)
        servers = [VllmServer(f"vllm{i}", python, model, work, cpu=cpu_binding(i),
                              extra_args=("--num-gpu-blocks-override", str(blocks)),
                              extra_env={"VLLM_SERVER_DEV_MODE": "1"}) for i in range(2)]
        t0 = time.monotonic()
        start_ready(servers)
        print(f"2 vLLM servers ready in {time.monotonic() - t0:.0f} s, {blocks} KV blocks of {BLOCK_SIZE} tokens each "
              f"(fleet {2 * blocks * BLOCK_SIZE:,} tokens; {a.programs} programs x ~{a.live_context} = "
              f"{a.oversub:g}x); tools {a.tool_s[0]:g}-{a.tool_s[1]:g} s, {a.max_tokens} output tokens per step, "
              f"pacing knobs {knobs or 'none'}", flush=True)
        results: dict[str, list[dict]] = {arm: [] for arm in a.arms}
        try:
            for rnd in range(a.rounds):
                for arm in a.arms:
                    reset_cache(servers)
                    cfg = {"model": str(model), "model_name": "tiny", "control_plane": {"heartbeat_interval": 0.5},
                           "routing": {"seed": 7},
                           "execution_group": {"nodes": [{"engine": "vllm", "block_size": BLOCK_SIZE,
                                                          "endpoints": [s.endpoint() for s in servers]}]}}
                    if pacing(arm, knobs):
                        cfg["scheduler"] = {"pacing": pacing(arm, knobs)}
                    front, url = start_front(cfg, work, f"front-{rnd}-{arm.replace(' ', '_')}")
                    try:
                        caps = re.findall(r'num_gpu_blocks="(\d+)"', http_get(f"{servers[0].url}/metrics"))
                        stats = asyncio.run(drive(a, url, "tiny"))
                        metrics = http_get(f"{url}/metrics")
                    finally:
                        stop(front)
                    r = {"steps": sum(stats.steps) / a.duration * 60, "hit": stats.cached / max(1, stats.prompt),
                         "p50": pct(stats.ttft, 0.5), "p99": pct(stats.ttft, 0.99), "jain": jain(stats.steps),
                         "pauses": counter(metrics, "thunderagent_program_pauses_total"),
                         "resumes": counter(metrics, "thunderagent_program_resumes_total"),
                         # requests that waited in the holding queue, and those of them it sent ahead of its next
                         # for their cache on a free server (scheduler/affinity.py)
                         "held": counter(metrics, "thunderagent_scheduler_queue_wait_seconds_count"),
                         "ahead": counter(metrics, "thunderagent_scheduler_affinity_dispatches_total"),
                         "unserved": sum(1 for s in stats.steps if s == 0), "errors": len(stats.errors),
                         "ctx": statistics.mean(stats.contexts) if stats.contexts else 0.0,
                         "recomputed": stats.prompt - stats.cached}
                    results[arm].append(r)
                    print(f"round {rnd + 1} {arm}: {r['steps']:.1f} steps/min, hit {r['hit']:.1%}, TTFT p50 "
                          f"{r['p50']:.2f} s p99 {r['p99']:.2f} s, Jain {r['jain']:.2f}, pauses {r['pauses']:.0f}, "
                          f"held {r['held']:.0f} (sent ahead for their cache {r['ahead']:.0f}), "
                          f"mean prompt {r['ctx']:.0f} (vLLM num_gpu_blocks {caps}), errors {r['errors']}"
                          + (f" first: {stats.errors[0]}" if stats.errors else ""), flush=True)
        finally:
            for s in servers:
                s.stop()
    report(a, results, blocks)


def report(a: argparse.Namespace, results: dict[str, list[dict]], blocks: int) -> None:
    def med(arm: str, k: str) -> float:
        return statistics.median(r[k] for r in results[arm])

    base = a.arms[0]
    rows = []
    for arm in a.arms:
        rows.append((arm, f"{med(arm, 'steps'):.1f} ({med(arm, 'steps') / med(base, 'steps'):.2f}x)",
                     f"{med(arm, 'hit'):.1%} ({med(arm, 'hit') / max(1e-9, med(base, 'hit')):.1f}x)",
                     f"{med(arm, 'recomputed'):,.0f}", f"{med(arm, 'p50'):.2f}",
                     f"{med(arm, 'p99'):.2f} ({med(arm, 'p99') / med(base, 'p99'):.2f}x)", f"{med(arm, 'jain'):.2f}",
                     f"{med(arm, 'pauses'):.0f}", f"{med(arm, 'unserved'):.0f}", f"{med(arm, 'ctx'):.0f}"))
    live = a.programs * statistics.median(r["ctx"] for rs in results.values() for r in rs)
    print_table(f"{a.programs} programs on 2 vLLM servers x {blocks} blocks ({2 * blocks * BLOCK_SIZE:,} KV tokens; "
                f"measured live context {live / (2 * blocks * BLOCK_SIZE):.1f}x), {a.duration:g} s per arm, median of "
                f"{a.rounds} round(s)",
                ("arm", "steps/min", "prefix hit", "recomputed", "TTFT p50 s", "TTFT p99 s", "Jain", "pauses",
                 "unserved", "mean prompt"), rows)


if __name__ == "__main__":
    main()
