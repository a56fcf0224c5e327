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


async def test_grouping_and_hot_prefix_metrics_match_the_grouper_after_a_burst(server_factory):
    """Identical prompts at once on one worker: the first leads, the others follow it (coalesced: every
    full block is the leader's); /metrics reports the grouper's totals and the hot-prefix replicas."""
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    grouping = {"enabled": True, "coalesce": True, "follower_max_wait_ms": 5000}
    async with server_factory(execution_group={"nodes": [{"count": 1}]}, scheduler={"grouping": grouping},
                              routing={"hot_prefix": {"enabled": True}}, simulation={"speedup": 1.0}) as srv:
        await asyncio.gather(*(srv.client.completions.create(model=MODEL, prompt=f"{SHARED} same question",
                                                             max_tokens=4) for _ in range(6)))
        grouper, hot = srv.fleet.dispatcher.grouper, srv.fleet.dispatcher.router.hot
        assert grouper is not None and hot is not None and srv.fleet.dispatcher.held() == 0
        stats = dict(grouper.stats)
        assert stats["followers"] >= 1 and stats["coalesced"] == stats["followers"]
        assert stats["stored"] + stats["leader"] + stats["timeout"] == stats["followers"]  # none left held

        def scrape() -> dict[tuple[str, str], float]:
            text = urllib.request.urlopen(f"{srv.base_url}/metrics", timeout=10).read().decode()
            return {(s.name, s.labels.get("cause", "")): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples}

        want = {("thunderagent_grouped_requests_total", ""): stats["followers"],
                ("thunderagent_coalesced_requests_total", ""): stats["coalesced"],
                ("thunderagent_grouping_windows_total", ""): stats["windows"],
                **{("thunderagent_follower_releases_total", c): stats[c] for c in ("stored", "leader", "timeout")},
                ("thunderagent_hot_prefix_replicas", ""): hot.live_replicas(srv.fleet.now()),
                ("thunderagent_hot_prefix_replicas_added_total", ""): hot.added,
                ("thunderagent_hot_prefix_routed_total", ""): hot.to_replicas}
        deadline = time.monotonic() + 5.0  # the fleet's tick (every heartbeat interval) publishes them
        while True:
            got = await asyncio.to_thread(scrape)
            if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert {k: got.get(k) for k in want} == want
