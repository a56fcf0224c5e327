"""Acceptance: 8 concurrent 10-turn conversations, no shared prefix, over 4 workers.

They must spread evenly (max/min requests per worker <= 2), each must stay on its worker (<= 1 switch),
and the engine's cached_tokens must grow turn after turn."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

pytestmark = pytest.mark.integration

WORDS = ("kv", "cache", "router", "prefill", "decode", "block", "hash", "worker", "token", "fleet", "queue")


def user_turn(conv: int, turn: int, rng: random.Random) -> str:
    # Starts with a per-conversation tag, so no two conversations share even their first block.
    body = " ".join(rng.choice(WORDS) for _ in range(40))
    return f"[conversation {conv} turn {turn}] {body}"


async def converse(client, conv: int, turns: int) -> list[tuple[str, int, int]]:
    rng = random.Random(conv)
    messages: list[dict[str, str]] = []
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": user_turn(conv, turn, rng)})
        raw = await client.chat.completions.with_raw_response.create(
            model="thunderagent-sim", messages=messages, max_tokens=48
        )
        resp = raw.parse()
        reply = resp.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        out.append((raw.headers["x-thunderagent-worker"], resp.usage.prompt_tokens,
                    resp.usage.prompt_tokens_details.cached_tokens))
    return out


async def test_conversations_spread_and_stick(server_factory):
    async with server_factory() as srv:
        results = await asyncio.gather(*(converse(srv.client, c, 10) for c in range(8)))
    per_worker = Counter(w for conv in results for (w, _, _) in conv)
    assert set(per_worker) == set(srv.fleet.workers), per_worker
    assert max(per_worker.values()) / min(per_worker.values()) <= 2, per_worker
    for conv in results:
        workers = [w for (w, _, _) in conv]
        switches = sum(1 for a, b in zip(workers, workers[1:]) if a != b)
        assert switches <= 1, workers
        cached = [c for (_, _, c) in conv]
        assert cached[0] == 0
        assert all(b > a for a, b in zip(cached, cached[1:])), cached
        # the previous turn's whole prompt (full blocks) is reused
        prompts = [p for (_, p, _) in conv]
        for k in range(1, len(conv)):
            if workers[k] == workers[k - 1]:
                assert cached[k] >= prompts[k - 1] // 64 * 64, (k, cached, prompts)
