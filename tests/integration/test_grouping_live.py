"""Prefix grouping on a live server, through the official OpenAI client: a burst of requests sharing
a long prefix all complete (followers are released by the KV events the fleet applies, their leader's
first token, or the bound), and nothing stays held."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
SHARED = "the same long system prompt for every request in this burst " * 40  # far more than 4 blocks


async def test_burst_of_siblings_all_complete_and_none_stays_held(server_factory):
    grouping = {"enabled": True, "coalesce": True, "follower_max_wait_ms": 5000}
    async with server_factory(scheduler={"grouping": grouping}, simulation={"speedup": 5.0}) as srv:
        async def one(i: int):
            return await srv.client.completions.create(model=MODEL, prompt=f"{SHARED} question {i}", max_tokens=8)

        done = await asyncio.gather(*(one(i) for i in range(16)))
        dup = await asyncio.gather(*(one(99) for _ in range(4)))  # identical prefills
        assert all(r.choices[0].finish_reason in ("length", "stop") for r in (*done, *dup))
        grouper = srv.fleet.dispatcher.grouper
        assert grouper is not None and srv.fleet.dispatcher.held() == 0 and not srv.fleet._held
        assert grouper.stats["followers"] + grouper.stats["leaders"] > 0
