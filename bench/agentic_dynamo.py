"""Agent programs live, side by side with Dynamo 1.6.1: its kv_router and its thunderagent_router on its
simulated workers (``dynamo.mocker``) against ThunderAgent (``serve``) on simulated workers of the same KV size.

Workload: the kv-cache-tester agentic-coding traces (``../shared/traces/kv-cache-tester``; one program per
session, sub-agents their own program), replayed by one closed-loop client over HTTP. Every program starts at
t = 0 and issues its next request once the previous one finished plus its recorded think time (capped at
``--think-cap`` virtual seconds, as ``agentic_pacing.py`` does), divided by ``--speedup``. Each 64-token
trace block becomes ``--words-per-block`` words of a word-level vocabulary (one word = one token; the
default 16 plays the traces at a quarter of their length, so that the frontends tokenize and hash what a
2-core machine can carry); a block id gives the same words in every request, so a program's turns share
their prefix exactly as the trace says. Output: ``out`` scaled the same way. The same headers go to both
stacks: ``x-dynamo-session-id`` (Dynamo's program key, which ThunderAgent reads too) and, on a program's
last request, ``x-dynamo-session-final: true``; ThunderAgent's programs are also released with ``POST
/v1/programs/{id}/release``.

Fleets: ``--workers`` simulated workers per stack, the same engine model (the mocker's polynomial timing,
which ThunderAgent's simulated engine is calibrated to), the same ``--speedup`` (the mocker's
``--speedup-ratio``, our ``timing.speedup``), KV blocks of 16 tokens per worker sized so that the programs'
live context (the sum of their mean prompt lengths) is ``--ratio`` times the fleet's KV. A request that could
never fit one worker's KV is not sent (both stacks; counted as ``too long``).

Arms: ``dynamo kv`` (``dynamo.frontend --router-mode kv``, defaults), ``dynamo thunderagent`` (Dynamo's
``thunderagent_router`` at its defaults), ``kv_aware`` (``thunderagent serve`` defaults), ``pacing ours`` and
``pacing paper`` (``scheduler.pacing`` on, ours and the paper's accounting and placement). Per arm, over
``--duration`` wall seconds (= ``--duration x --speedup`` virtual): steps/min (virtual minutes), prefix hit
(the servers' ``cached_tokens`` / prompt tokens), TTFT p50/p99 (virtual seconds), Jain's fairness of steps per
program, programs that completed no step.

Targets (issue 9, live against Dynamo): steps/min >= 1.2x the better Dynamo arm, prefix hit >= 85 %, Jain no
more than 0.05 below plain kv_aware's, no program unserved.

Dynamo: ``ai-dynamo==1.6.1`` depends on a stub that downloads from NVIDIA at install time, so it lives in
its own venv (``--dynamo-python``, default ``.venv-dynamo``), made here on first use as DESIGN.md says:
``ai-dynamo-runtime==1.6.1``, then ``ai-dynamo==1.6.1 --no-deps``, then its pure-Python dependencies.

Run: ``python bench/agentic_dynamo.py [--traces DIR] [--workers 4] [--ratio 2] [--speedup 10] [--duration 120]
[--arms ...]`` (about ``--duration`` + 15 s per arm).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]

from _common import counter, jain, pct, print_table, read_chat_stream
from agentic_pacing import DEFAULT_TRACES, programs
from support.waiting import free_port

from thunderagent.sim.traces import TraceRequest, load_traces

BLOCK = 16  # KV block size of both stacks (the recipe's --block-size / --router-block-size)
TRACE_BLOCK = 64  # kv-cache-tester's block size
VOCAB = 8192
DYNAMO = "1.6.1"
DYNAMO_DEPS = ("aiohttp", "msgspec", "prometheus-client", "pyzmq", "transformers", "uvloop", "httpx", "kubernetes<33",
               "redis", "zstandard", "tqdm")
ARMS = ("dynamo kv", "dynamo thunderagent", "kv_aware", "pacing ours", "pacing paper")


# -- model directory: a word-level tokenizer, one word = one token -------------------------------------
def build_model(out: Path) -> Path:
    """config.json + a word-level tokenizer with a chat template (what the mocker and our frontend read)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)} | {f"w{i}": len(specials) + i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|eos|>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(str(out))
    LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=1, max_position_embeddings=1 << 21, bos_token_id=0, eos_token_id=1,
                architectures=["LlamaForCausalLM"], torch_dtype="float32").save_pretrained(str(out))
    return out


def dynamo_python(path: Path) -> Path:
    """The venv with Dynamo 1.6.1, made on first use (DESIGN.md's recipe)."""
    py = path / "bin" / "python"
    probe = subprocess.run([str(py), "-c", "import dynamo.mocker, dynamo.frontend, dynamo.thunderagent_router"],
                           capture_output=True, check=False) if py.exists() else None
    if probe is not None and probe.returncode == 0:
        return py
    print(f"installing Dynamo {DYNAMO} into {path} (once, a few minutes)", flush=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for cmd in ([sys.executable, "-m", "venv", "--clear", str(path)], [*pip, f"ai-dynamo-runtime=={DYNAMO}"],
                [*pip, "--no-deps", f"ai-dynamo=={DYNAMO}"], [*pip, *DYNAMO_DEPS]):
        if subprocess.run(cmd, check=False).returncode != 0:
            raise SystemExit(f"`{' '.join(cmd)}` failed")
    return py


# -- the programs -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Stats:
    steps: dict[str, int]
    ttft: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    too_long: int = 0
    retried: int = 0  # 429s answered with a retry
    cut: int = 0  # programs with a request still open at the end of the window
    errors: list[str] = field(default_factory=list)


class Prompts:
    """Block id -> its words, made once (a program's turns repeat most of their blocks)."""

    def __init__(self, words_per_block: int) -> None:
        self.w = words_per_block
        self._text: dict[int, str] = {}

    def block(self, c: int) -> str:
        s = self._text.get(c)
        if s is None:
            # a multiplicative hash spreads neighbouring ids over the vocabulary: distinct blocks, distinct words
            s = " ".join(f"w{((c * self.w + k) * 2654435761) % VOCAB}" for k in range(self.w))
            self._text[c] = s
        return s

    def prompt(self, r: TraceRequest) -> str:
        return " ".join(self.block(c) for c in r.block_ids)


def program_id(r: TraceRequest) -> str:
    """The session as a program id that fits a URL path (a sub-agent's session is ``trace/agent``)."""
    return (r.session or r.request_id).replace("/", ":")


async def run_program(reqs: list[TraceRequest], a: argparse.Namespace, url: str, ours: bool,
                      http: aiohttp.ClientSession,
                      prompts: Prompts, stats: Stats, t0: float, end: float) -> None:
    pid = program_id(reqs[0])
    kv_tokens = a.kv_blocks * BLOCK
    issued = t0
    prev: TraceRequest | None = None
    finished = t0
    for i, r in enumerate(reqs):
        if prev is not None:  # closed loop, as the simulator's (sim/arrivals.py)
            at = finished + r.think_s / a.speedup if r.think_s is not None else \
                max(finished, issued + (r.arrival_s - prev.arrival_s) / a.speedup)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
        prev = r
        if time.monotonic() >= end:
            return
        issued = time.monotonic()
        n_out = max(1, r.output_length * a.words_per_block // TRACE_BLOCK)
        if len(r.block_ids) * a.words_per_block + n_out + 8 > kv_tokens:
            stats.too_long += 1
            finished = issued
            continue
        headers = {"x-dynamo-session-id": pid}
        if i == len(reqs) - 1:
            headers["x-dynamo-session-final"] = "true"
        body = {"model": "mock", "messages": [{"role": "user", "content": prompts.prompt(r)}], "max_tokens": n_out,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            while True:  # a 429 is retried after its Retry-After, as the openai client does; TTFT counts the wait
                resp = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
                if resp.status != 429 or time.monotonic() >= end:
                    break
                stats.retried += 1
                resp.release()
                await asyncio.sleep(min(5.0, float(resp.headers.get("Retry-After") or 1.0)))
            async with resp:
                if resp.status != 200:
                    stats.errors.append(f"{resp.status}: {(await resp.text())[:200]}")
                    finished = time.monotonic()
                    continue
                first, _, usage = await read_chat_stream(resp, issued)
        except aiohttp.ClientError as exc:
            stats.errors.append(repr(exc))
            finished = time.monotonic()
            continue
        finished = time.monotonic()
        if finished > end:
            return  # finished past the window: not counted
        stats.steps[pid] += 1
        if first is not None:
            stats.ttft.append(first * a.speedup)
        if usage:
            stats.prompt += usage["prompt_tokens"]
            stats.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if ours:
        async with http.post(f"{url}/v1/programs/{pid}/release") as resp:
            await resp.read()


async def drive(sessions: list[list[TraceRequest]], a: argparse.Namespace, url: str, ours: bool) -> Stats:
    stats = Stats(steps={program_id(s[0]): 0 for s in sessions})
    prompts = Prompts(a.words_per_block)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        t0 = time.monotonic()
        end = t0 + a.duration
        tasks = [asyncio.ensure_future(run_program(s, a, url, ours, http, prompts, stats, t0, end)) for s in sessions]
        # a request still held or running at the end is abandoned (a router may hold one for half an hour)
        _, pending = await asyncio.wait(tasks, timeout=a.duration + 0.5)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        stats.cut = len(pending)
    return stats


# -- the stacks ---------------------------------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_until(ready, procs: list[subprocess.Popen], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise SystemExit(f"{what}: a process exited ({dead[0].returncode}): {dead[0].args[:4]}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what}: not ready after {timeout:g} s")


def start_dynamo(arm: str, a: argparse.Namespace, py: Path, model: Path,
                 work: Path) -> tuple[list[subprocess.Popen], str]:
    kv = work / f"dyn-{arm.replace(' ', '_')}"
    shutil.rmtree(kv, ignore_errors=True)
    kv.mkdir()
    env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv), "DYN_REQUEST_PLANE": "tcp",
           "DYN_EVENT_PLANE": "zmq"}
    port = free_port()
    plain = arm == "dynamo kv"
    mocker = [str(py), "-m", "dynamo.mocker", "--model-path", str(model),
              "--model-name", "mock" if plain else "internal", "--num-workers", str(a.workers),
              "--num-gpu-blocks-override", str(a.kv_blocks), "--block-size", str(BLOCK),
              "--speedup-ratio", str(a.speedup)]
    front = [str(py), "-m", "dynamo.frontend", "--router-mode", "kv" if plain else "round-robin",
             "--kv-cache-block-size", str(BLOCK), "--http-host", "127.0.0.1", "--http-port", str(port)]
    name = arm.replace(" ", "_")
    procs = [spawn(mocker, work / f"{name}-mocker.log", env)]
    if not plain:
        procs.append(spawn([str(py), "-m", "dynamo.thunderagent_router", "--endpoint", "dynamo.backend.generate",
                            "--model-name", "mock", "--model-path", str(model), "--router-block-size", str(BLOCK)],
                           work / f"{name}-router.log", env))
    procs.append(spawn(front, work / f"{name}-frontend.log", env))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: any(m["id"] == "mock" for m in json.loads(http_get(f"{url}/v1/models"))["data"]), procs, arm)
        time.sleep(2.0)  # every worker registered with the router (the model appears with the first)
    except BaseException:
        stop(procs)
        raise
    return procs, url


def start_ours(arm: str, a: argparse.Namespace, model: Path, work: Path) -> tuple[list[subprocess.Popen], str]:
    cfg: dict = {"model": str(model), "model_name": "mock",
                 "execution_group": {"nodes": [{"engine": "simulated", "count": a.workers, "kv_blocks": a.kv_blocks,
                                                "block_size": BLOCK, "timing": {"speedup": a.speedup}}]}}
    if arm == "pacing ours":
        cfg["scheduler"] = {"pacing": {"enabled": True}}
    elif arm == "pacing paper":
        cfg["scheduler"] = {"pacing": {"enabled": True, "accounting": "paper", "placement": "most_free",
                                       "work_conserving": False, "sticky": True}}
    name = arm.replace(" ", "_")
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    port = free_port()
    procs = [spawn([str(Path(sys.executable).parent / "thunderagent"), "serve", "--config", str(path), "--port",
                    str(port)], work / f"{name}.log")]
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        workers = json.loads(http_get(f"{url}/health")).get("workers") or []
        return len(workers) == a.workers and all(w["health"] == "healthy" for w in workers)

    try:
        wait_until(healthy, procs, arm)
    except BaseException:
        stop(procs)
        raise
    return procs, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=2.0, help="programs' live context / fleet KV")
    ap.add_argument("--speedup", type=float, default=10.0, help="engine and client time: virtual s per wall s")
    ap.add_argument("--duration", type=float, default=120.0, help="wall seconds per arm")
    ap.add_argument("--think-cap", type=float, default=30.0, help="virtual seconds")
    ap.add_argument("--words-per-block", type=int, default=16, help="tokens per 64-token trace block")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--dynamo-python", type=Path, default=ROOT / ".venv-dynamo",
                    help="venv with Dynamo 1.6.1 (made on first use)")
    ap.add_argument("--keep-logs", type=Path, default=None, help="copy the servers' logs here")
    a = ap.parse_args()
    if a.words_per_block < 1 or a.words_per_block > TRACE_BLOCK:
        ap.error("--words-per-block must be 1-64")
    if not a.traces.exists():
        sys.exit(f"no traces at {a.traces} (the kv-cache-tester folder from ../shared)")
    reqs = programs(load_traces([a.traces]), a.think_cap)
    by: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in reqs:
        by[r.session or r.request_id].append(r)
    sessions = [sorted(v, key=lambda r: r.arrival_s) for v in by.values()]
    live = sum(statistics.mean(len(r.block_ids) * a.words_per_block for r in s) for s in sessions)
    a.kv_blocks = math.ceil(live / a.ratio / a.workers / BLOCK)
    longest = max(len(r.block_ids) for r in reqs) * a.words_per_block
    print(f"{len(sessions)} programs, {len(reqs):,} requests; live context {live:,.0f} tokens = {a.ratio:g}x the "
          f"fleet's KV ({a.workers} workers x {a.kv_blocks:,} blocks x {BLOCK}); longest prompt {longest:,}; "
          f"speedup {a.speedup:g}: {a.duration:g} wall s = {a.duration * a.speedup:g} virtual s per arm", flush=True)
    dyn = dynamo_python(a.dynamo_python) if any(x.startswith("dynamo") for x in a.arms) else None
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="agentic-dynamo-") as d:
        work = Path(d)
        model = build_model(work / "model")
        try:
            for arm in a.arms:
                ours = not arm.startswith("dynamo")
                procs, url = start_ours(arm, a, model, work) if ours else start_dynamo(arm, a, dyn, model, work)
                try:
                    stats = asyncio.run(drive(sessions, a, url, ours))
                    metrics = http_get(f"{url}/metrics") if ours else ""
                finally:
                    stop(procs)
                steps = list(stats.steps.values())
                r = {"steps": sum(steps) / (a.duration * a.speedup) * 60, "hit": stats.cached / max(1, stats.prompt),
                     "p50": pct(stats.ttft, 0.5), "p99": pct(stats.ttft, 0.99), "jain": jain(steps),
                     "unserved": sum(1 for s in steps if s == 0), "errors": len(stats.errors),
                     "too_long": stats.too_long, "retried": stats.retried,
                     "pauses": counter(metrics, "thunderagent_program_pauses_total") if ours else math.nan}
                results[arm] = r
                print(f"{arm}: {r['steps']:.1f} steps/min, hit {r['hit']:.1%}, TTFT p50 {r['p50']:.1f} s p99 "
                      f"{r['p99']:.1f} s, Jain {r['jain']:.2f}, unserved {r['unserved']}, too long {r['too_long']}, "
                      f"429s retried {r['retried']}, "
                      f"errors {r['errors']}" + (f" (first: {stats.errors[0]})" if stats.errors else ""), flush=True)
        finally:
            if a.keep_logs is not None:
                a.keep_logs.mkdir(parents=True, exist_ok=True)
                for f in work.glob("*.log"):
                    shutil.copy(f, a.keep_logs / f.name)
    report(a, results)


def report(a: argparse.Namespace, results: dict[str, dict[str, float]]) -> None:
    dyn = [results[x]["steps"] for x in results if x.startswith("dynamo")]
    best = max(dyn) if dyn else math.nan
    rows = [(arm, f"{r['steps']:.1f}", f"{r['steps'] / best:.2f}x" if dyn else "-", f"{r['hit']:.1%}",
             f"{r['p50']:.1f}", f"{r['p99']:.1f}", f"{r['jain']:.2f}", r["unserved"],
             "-" if math.isnan(r["pauses"]) else f"{r['pauses']:.0f}",
             r["retried"], r["too_long"], r["errors"]) for arm, r in results.items()]
    print_table(f"{a.workers} workers x {a.kv_blocks:,} blocks x {BLOCK} tokens, live context {a.ratio:g}x the fleet's "
                f"KV, speedup {a.speedup:g}, {a.duration * a.speedup:g} virtual s per arm (steps/min and TTFT in "
                "virtual time)",
                ("arm", "steps/min", "vs better Dynamo", "prefix hit", "TTFT p50 s", "TTFT p99 s", "Jain", "unserved",
                 "pauses", "429 retried", "too long", "errors"), rows)


if __name__ == "__main__":
    main()
