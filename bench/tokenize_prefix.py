"""What the frontend spends tokenizing agentic prompts, with and without its prefix cache and tokenize pool.

An agent's conversation grows turn by turn and every turn's prompt is rendered and tokenized whole for routing. This
bench replays one growing conversation (a long system prompt, then turns that each add a tool result, a user
message and a reply, up to ``--tokens`` tokens) through ``HfTokenizer.apply_openai_chat``, once with the prefix cache
(``frontend/token_cache.py``) and once without it, interleaved turn by turn, checks that both give the same ids, and
prints the time per turn against the prompt's size and the ratio. Then it measures how long the event loop stalls
while one long prompt is tokenized on the loop and through ``TokenizePool`` (``frontend/tokenize_pool.py``): a
ticker task sleeping 1 ms records its longest gap.

The tokenizer is the test suite's locally trained byte-level BPE (512 ids: more tokens per character than a real
model's, so the absolute times are pessimistic; the ratios are the point). Nothing is downloaded.

    python bench/tokenize_prefix.py [--tokens 100000] [--rounds 5]
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

from _common import print_table  # noqa: E402
from tests.engines.tiny_model import build_tokenizer, training_text  # noqa: E402
from thunderagent.frontend.hf_tokenizer import HfTokenizer  # noqa: E402
from thunderagent.frontend.tokenize_pool import TokenizePool  # noqa: E402


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


def per_turn(docs: list[dict], cached: HfTokenizer, plain: HfTokenizer) -> list[tuple[int, float, float]]:
    """(prompt tokens, cached ms, plain ms) per turn, interleaved; the ids must agree."""
    out = []
    for doc in docs:
        t0 = time.perf_counter()
        a = cached.apply_openai_chat(doc)
        t1 = time.perf_counter()
        b = plain.apply_openai_chat(doc)
        t2 = time.perf_counter()
        if a != b:
            raise SystemExit(f"the cached ids differ from the whole tokenization at {len(b)} tokens")
        out.append((len(b), (t1 - t0) * 1e3, (t2 - t1) * 1e3))
    return out


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000, help="the conversation's last prompt, tokens")
    ap.add_argument("--rounds", type=int, default=5, help="stall measurements per arm (median)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        build_tokenizer(Path(d))
        cached, plain = HfTokenizer(d), HfTokenizer(d, prefix_cache_bytes=0)
        assert cached.cache is not None, "the probe refused the prefix cache for this tokenizer"
        docs = conversation(args.tokens, plain)
        rows = per_turn(docs, cached, plain)
        title = (f"one conversation, {len(docs)} turns, up to {rows[-1][0]:,} prompt tokens; each turn tokenized with "
                 "the prefix cache and without it, interleaved (same ids)")
        bands = [(0, 25_000), (25_000, 50_000), (50_000, 75_000), (75_000, 10**9)]
        table = []
        for lo, hi in bands:
            sel = [r for r in rows[1:] if lo <= r[0] < hi]  # (the first turn has nothing to reuse)
            if not sel:
                continue
            c, p = statistics.median(r[1] for r in sel), statistics.median(r[2] for r in sel)
            table.append([f"{lo // 1000}k-{hi // 1000 if hi < 10**9 else 'max'}k", str(len(sel)), f"{p:.1f}",
                          f"{c:.1f}", f"{c / p:.3f}x"])
        last = rows[-1]
        table.append([f"last ({last[0]:,})", "1", f"{last[2]:.1f}", f"{last[1]:.1f}", f"{last[1] / last[2]:.3f}x"])
        print_table(title, ["prompt tokens", "turns", "whole ms (median)", "cached ms", "cached / whole"], table)
        cache = cached.cache
        print(f"cache: {len(cache)} entry, {cache.nbytes / 2**20:.1f} MiB, {cache.hits} of {cache.lookups} turns "
              f"reused {cache.reused_tokens:,} tokens")

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


if __name__ == "__main__":
    main()
