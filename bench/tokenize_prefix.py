"""What the frontend spends tokenizing agentic prompts, with and without its prefix cache and tokenize pool.

An agent's conversation grows turn by turn and every turn's prompt is rendered and tokenized whole for routing. This
bench replays one growing conversation (a long system prompt, then turns that each add a tool result, a user
message and a reply, up to ``--tokens`` tokens) through ``HfTokenizer.apply_openai_chat``, once with the prefix cache
(``frontend/token_cache.py``) and once without it, interleaved turn by turn, checks that both give the same ids, and
prints the time per turn against the prompt's size and the ratio. A second table does the same for an agent that
writes its whole transcript into one user message (no added token inside it to cut at: the cache reuses the
previous turn's ids up to its last lines, ``HfTokenizer``'s line cuts), beside the cache with line cuts off (added
tokens only, as before line cuts). Then it measures how long the event loop stalls
while one long prompt is tokenized on the loop and through ``TokenizePool`` (``frontend/tokenize_pool.py``): a
ticker task sleeping 1 ms records its longest gap.

The tokenizer is the test suite's locally trained byte-level BPE (512 ids), or a model's own with ``--tokenizer DIR``
(a local directory with its tokenizer files and chat template, as ``model:`` takes). Nothing is downloaded.

With ``--live`` it then runs ``thunderagent serve`` (two simulated workers, 50x fast engines, the same tokenizer)
twice, as before this change (``threads: 0``, ``prefix_cache_mb: 0``) and with the defaults: one agent sends the
conversation's turns one after another while ``--clients`` clients stream short chats; it prints the agent's turn
latency, the short streams' gaps between chunks (inter-token latency), the server's event-loop lag and its CPU.

    python bench/tokenize_prefix.py [--tokens 100000] [--rounds 5] [--tokenizer DIR] [--live [--clients 6]]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]

from _common import print_table

from tests.engines.tiny_model import build_tokenizer, training_text
from thunderagent.frontend.hf_tokenizer import HfTokenizer
from thunderagent.frontend.tokenize_pool import TokenizePool


def conversation(tokens: int, tok: HfTokenizer) -> list[dict]:
    """The requests of one growing tool-calling conversation, up to about ``tokens`` prompt tokens."""
    lines = iter(training_text(200_000, seed=1))

    def words(n: int) -> str:
        return " ".join(next(lines) for _ in range(n))

    msgs: list[dict] = [{"role": "system", "content": words(300)}]
    out: list[dict] = []
    k = 0
    while True:
        msgs.append({"role": "user", "content": words(8)})
        doc = {"messages": list(msgs), "tools": [{"type": "function", "function": {"name": "bash"}}]}
        out.append(doc)
        if len(tok.apply_openai_chat(doc)) >= tokens:
            return out
        msgs.append({"role": "assistant", "content": words(2), "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": words(40)})
        k += 1


def one_message(tokens: int, tok: HfTokenizer) -> list[dict]:
    """The requests of an agent that keeps its whole transcript in one user message, growing by a step's lines (a
    thought, an action, its output) a turn, up to about ``tokens`` prompt tokens."""
    lines = iter(training_text(200_000, seed=2))
    transcript = ""
    out: list[dict] = []
    k = 0
    while True:
        transcript += (f"Thought {k}: {next(lines)}\nAction: bash {next(lines)}\nObservation:\n"
                       + "".join(f"  {next(lines)}\n" for _ in range(30)) + "\n")
        doc = {"messages": [{"role": "system", "content": "You are a coding agent."},
                            {"role": "user", "content": transcript}]}
        out.append(doc)
        if len(tok.apply_openai_chat(doc)) >= tokens:
            return out
        k += 1


def per_turn(docs: list[dict], cached: HfTokenizer, plain: HfTokenizer,
             *others: HfTokenizer) -> list[tuple[float, ...]]:
    """(prompt tokens, cached ms, plain ms, each other's ms) per turn, interleaved; the ids must agree."""
    out = []
    for doc in docs:
        times = []
        ids = []
        for tok in (cached, plain, *others):
            t0 = time.perf_counter()
            ids.append(tok.apply_openai_chat(doc))
            times.append((time.perf_counter() - t0) * 1e3)
        if any(x != ids[1] for x in ids):
            raise SystemExit(f"the cached ids differ from the whole tokenization at {len(ids[1])} tokens")
        out.append((len(ids[1]), *times))
    return out


def band_table(rows: list[tuple[float, ...]], extra: bool = False) -> list[list[str]]:
    """Medians per band of prompt sizes (the first turn, with nothing to reuse, left out), and the last turn."""
    bands = [(0, 25_000), (25_000, 50_000), (50_000, 75_000), (75_000, 10**9)]
    table = []
    for lo, hi in bands:
        sel = [r for r in rows[1:] if lo <= r[0] < hi]
        if not sel:
            continue
        med = [statistics.median(r[k] for r in sel) for k in range(1, len(rows[0]))]
        row = [f"{lo // 1000}k-{hi // 1000 if hi < 10**9 else 'max'}k", str(len(sel)), f"{med[1]:.1f}",
               f"{med[0]:.1f}", f"{med[0] / med[1]:.3f}x"]
        table.append(row + ([f"{med[2]:.1f}", f"{med[2] / med[1]:.3f}x"] if extra else []))
    last = rows[-1]
    row = [f"last ({last[0]:,})", "1", f"{last[2]:.1f}", f"{last[1]:.1f}", f"{last[1] / last[2]:.3f}x"]
    table.append(row + ([f"{last[3]:.1f}", f"{last[3] / last[2]:.3f}x"] if extra else []))
    return table


async def longest_stall(run) -> float:  # type: ignore[no-untyped-def]
    """The longest gap (ms) a 1 ms ticker sees while ``run()`` (a coroutine function) runs."""
    done = False
    worst = 0.0

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    worst = 0.0
    await run()
    done = True
    await task
    return worst * 1e3


def plain_turns(docs: list[dict]) -> list[list[dict]]:
    """The conversation's turns as plain chats (the simulated workers' token path takes no tools or tool calls)."""
    out = []
    for doc in docs:
        msgs = []
        for m in doc["messages"]:
            role = {"tool": "user"}.get(m["role"], m["role"])
            msgs.append({"role": role, "content": m["content"]})
        out.append(msgs)
    return out


async def live_arm(name: str, config: str, turns: list[list[dict]], clients: int) -> list[object]:
    import aiohttp
    from overload import ServeProcess

    srv = ServeProcess(config, Path(tempfile.gettempdir()) / f"tokenize-live-{name.split()[0]}.log")
    try:
        async with aiohttp.ClientSession() as s:
            await srv.ready(s, timeout=60)
            cpu0 = srv.cpu_s()
            done = False
            gaps: list[float] = []
            turn_ms: list[float] = []

            async def agent() -> None:
                for msgs in turns:
                    t0 = time.perf_counter()
                    async with s.post(srv.base + "/v1/chat/completions",
                                      json={"model": "tiny", "messages": msgs, "max_tokens": 1}) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                    turn_ms.append((time.perf_counter() - t0) * 1e3)

            async def client(k: int) -> None:
                n = 0
                while not done:
                    n += 1
                    body = {"model": "tiny", "stream": True, "max_tokens": 64, "messages": [
                        {"role": "user", "content": f"client {k} asks question {n} about the router"}]}
                    async with s.post(srv.base + "/v1/chat/completions", json=body) as r:
                        last = None
                        async for _ in r.content:
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append((now - last) * 1e3)
                            last = now

            tasks = [asyncio.create_task(client(k)) for k in range(clients)]
            await asyncio.sleep(1.0)
            await agent()
            done = True
            await asyncio.gather(*tasks)
            cpu = srv.cpu_s() - cpu0
            async with s.get(srv.base + "/metrics") as r:
                metrics = await r.text()
        lag = next((float(x.split()[-1]) for x in metrics.splitlines()
                    if x.startswith("thunderagent_loop_lag_max_seconds ")), float("nan"))
        gaps.sort()
        tail = turn_ms[len(turn_ms) // 2:]
        return [name, f"{statistics.median(tail):.0f}", f"{gaps[len(gaps) // 2]:.2f}",
                f"{gaps[int(len(gaps) * 0.99)]:.1f}", f"{gaps[-1]:.0f}", f"{lag * 1e3:.0f}", f"{cpu:.1f}"]
    finally:
        srv.stop()


def live(d: str, docs: list[dict], clients: int) -> None:
    base = f"""model: {d}
model_name: tiny
execution_group:
  nodes:
    - count: 2
      engine: simulated
      block_size: 64
      timing: {{speedup: 50.0}}
"""
    before = base + "control_plane:\n  tokenizer: {threads: 0, prefix_cache_mb: 0}\n"
    turns = plain_turns(docs)
    rows = [asyncio.run(live_arm("before (on the loop, no cache)", before, turns, clients)),
            asyncio.run(live_arm("defaults (pool + prefix cache)", base, turns, clients))]
    print_table(f"thunderagent serve, 2 simulated workers (50x), one agent's {len(turns)} turns while {clients} "
                "clients stream 64-token chats",
                ["arm", "agent turn ms (median, 2nd half)", "ITL p50 ms", "ITL p99 ms", "ITL max ms",
                 "loop lag max ms", "server CPU s"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000, help="the conversation's last prompt, tokens")
    ap.add_argument("--rounds", type=int, default=5, help="stall measurements per arm (median)")
    ap.add_argument("--tokenizer", type=Path, help="a model directory (tokenizer + chat template) instead of the "
                    "test suite's BPE")
    ap.add_argument("--live", action="store_true", help="also run thunderagent serve before / after (about 1 min)")
    ap.add_argument("--clients", type=int, default=6, help="--live: clients streaming short chats meanwhile")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = str(args.tokenizer) if args.tokenizer else tmp
        if not args.tokenizer:
            build_tokenizer(Path(d))
        cached, plain = HfTokenizer(d), HfTokenizer(d, prefix_cache_bytes=0)
        assert cached.cache is not None, "the probe refused the prefix cache for this tokenizer"
        docs = conversation(args.tokens, plain)
        rows = per_turn(docs, cached, plain)
        title = (f"one conversation, {len(docs)} turns, up to {rows[-1][0]:,} prompt tokens; each turn tokenized with "
                 "the prefix cache and without it, interleaved (same ids)")
        print_table(title, ["prompt tokens", "turns", "whole ms (median)", "cached ms", "cached / whole"],
                    band_table(rows))
        cache = cached.cache
        print(f"cache: {len(cache)} entry, {cache.nbytes / 2**20:.1f} MiB, {cache.hits} of {cache.lookups} turns "
              f"reused {cache.reused_tokens:,} tokens; line cuts {'on' if cached._line_cuts else 'off (probe)'}")

        # one message growing: line cuts against the cache cutting at added tokens only
        single, no_lines = HfTokenizer(d), HfTokenizer(d)
        no_lines._line_cuts = False
        msg_docs = one_message(args.tokens, plain)
        rows1 = per_turn(msg_docs, single, plain, no_lines)
        print_table(f"\none user message growing, {len(msg_docs)} turns, up to {rows1[-1][0]:,} prompt tokens; with "
                    "line cuts, without the cache, and with the cache cutting at added tokens only, interleaved "
                    "(same ids)", ["prompt tokens", "turns", "whole ms (median)", "line cuts ms", "line cuts / whole",
                                   "added tokens only ms", "added only / whole"], band_table(rows1, extra=True))
        assert single.cache is not None and no_lines.cache is not None
        print(f"reused tokens: line cuts {single.cache.reused_tokens:,}, added tokens only "
              f"{no_lines.cache.reused_tokens:,}")

        long_doc = docs[-1]
        size = 10**9  # (any body: the pool's threshold is not what is measured here)

        async def stalls() -> tuple[float, float]:
            pool = TokenizePool(2, offload_bytes=0)
            on_loop, off_loop = [], []
            try:
                for _ in range(args.rounds):  # (the plain tokenizer: every round tokenizes the whole prompt)
                    on_loop.append(await longest_stall(lambda: asyncio.sleep(0, plain.apply_openai_chat(long_doc))))
                    off_loop.append(await longest_stall(lambda: pool.run(size, plain.apply_openai_chat, long_doc)))
            finally:
                pool.close()
            return statistics.median(on_loop), statistics.median(off_loop)

        on, off = asyncio.run(stalls())
        print(f"\nevent loop's longest stall while a {len(plain.apply_openai_chat(long_doc)):,}-token prompt is "
              f"tokenized whole (median of {args.rounds}): on the loop {on:.1f} ms, through the tokenize pool "
              f"{off:.1f} ms ({off / on:.3f}x)")
        if args.live:
            live(d, docs, args.clients)


if __name__ == "__main__":
    main()
