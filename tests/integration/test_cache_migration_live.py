"""Cache migration on a live server with simulated workers: under injected skew (the prefix's holder made
to look busy to the migrator) the health-tick driver copies the prefix to the other worker as the two
halves of a handoff (the holder's one-token prefill-only job, the target's request taking its transfer); the
target imports the blocks by hash and the next request of the prefix finds them there (routing sees the
overlap). With ``routing.migration.link.sim_block_bytes`` the copy moves checksummed bytes over TCP, and the
target's own measure of its pull teaches the copies' link (``/health`` ``migration_links``)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import pytest

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
PREFIX = "shared context " * 150  # 2,250 characters: 35 full blocks of 64 tokens


async def ask(s: aiohttp.ClientSession, url: str, prompt: str) -> dict:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "explain": True}
    async with s.post(url + "/v1/completions", json=payload) as r:
        assert r.status == 200
        return (await r.json())["thunderagent"]


@pytest.mark.parametrize("block_bytes", [0, 65536], ids=["by-hash", "bytes"])
async def test_a_copy_lands_on_the_target_and_routing_sees_it(server_factory, block_bytes):
    mig = {"enabled": True, "min_prefix_tokens": 1024, "min_demand": 0.5, "sustain_s": 0.0,
           "demand_half_life_s": 3600.0,  # (a slow CI host must not let the one request of demand decay away)
           "link": {"enabled": True, "bandwidth_gbps": 200.0, "sim_block_bytes": block_bytes}}
    async with server_factory(execution_group={"nodes": [{"count": 2}]}, routing={"migration": mig},
                              scheduler={"enabled": False}) as srv:
        fleet = srv.fleet
        flow = fleet.cache_migration
        assert flow is not None
        async with aiohttp.ClientSession() as s:
            holder = (await ask(s, srv.base_url, PREFIX + "first question"))["worker"]
            second = await ask(s, srv.base_url, PREFIX + "second question")  # finds the prefix: demand
            assert second["worker"] == holder and second["overlap_blocks"] >= 32
            target = next(w for w in fleet.workers if w != holder)
            # injected skew: the migrator sees the holder busy (its engine queue at the busy threshold)
            states = [replace(w, load=replace(w.load, waiting=w.queue_depth_threshold)) if w.worker_id == holder
                      else w for w in fleet.routable()]
            flow.tick(states, fleet.now() + 1.0)  # past any look the health tick just had
            tasks = list(flow._tasks.values())
            assert len(tasks) == 1, flow.migrator.refusals
            await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
            assert flow.migrator.completed == 1 and flow.migrator.plane.inflight == {}
            engine = fleet.workers[target].engine  # type: ignore[attr-defined]
            assert engine.kv_imported_blocks >= 32
            third = await ask(s, srv.base_url, PREFIX + "third question")
            seen = {c["worker"]: c["overlap_blocks"] for c in third["candidates"]}
            assert seen[target] >= 32  # the index holds the copy on the target: routing may send it there
            async with s.get(srv.base_url + "/health") as r:
                health = await r.json()
            assert health["cache_migration"]["completed"] == 1
            learned = [x for x in health["migration_links"] if x["samples"]]
            if block_bytes:  # the bytes moved, checksummed; the target's pull taught the link its rate
                stats = fleet.workers[target].service.stats  # type: ignore[attr-defined]
                assert stats.pulls_ok == 1 and stats.bytes_received == engine.kv_imported_blocks * block_bytes
                assert [(x["src"], x["dst"], x["samples"]) for x in learned] == [(holder, target, 1)]
                assert learned[0]["bandwidth_gbps"] != 200.0
            else:  # by hash: nothing moved, nothing to learn from
                assert learned == [] and not hasattr(fleet.workers[target], "service")
            async with s.get(srv.base_url + "/metrics") as r:
                text = await r.text()
            assert 'thunderagent_cache_migration_copies_total{outcome="ok"} 1.0' in text
            moved = flow.migrator.bytes_moved
            (line,) = [x for x in text.splitlines() if x.startswith("thunderagent_cache_migration_bytes_total ")]
            assert moved > 0 and float(line.split()[1]) == moved
            assert "thunderagent_cache_migration_inflight 0.0" in text
            assert "thunderagent_cache_migration_left_out 0.0" in text


async def test_a_removed_worker_hands_its_prefix_off_before_it_leaves(server_factory):
    """``POST /v1/admin/workers/{id}/remove`` with ``routing.migration`` on: while it drains, the worker's
    most-demanded prefix, held nowhere else, is copied to the other worker; the answer counts it, and the next
    request of the prefix finds it there instead of recomputing it."""
    mig = {"enabled": True, "min_prefix_tokens": 1024, "min_demand": 0.5, "demand_half_life_s": 3600.0,
           "link": {"enabled": True, "bandwidth_gbps": 200.0}}
    async with server_factory(execution_group={"nodes": [{"count": 2}]}, routing={"migration": mig},
                              scheduler={"enabled": False}, control_plane={"admin_api": True}) as srv:
        fleet = srv.fleet
        async with aiohttp.ClientSession() as s:
            holder = (await ask(s, srv.base_url, PREFIX + "first question"))["worker"]
            await ask(s, srv.base_url, PREFIX + "second question")  # finds the prefix: demand
            other = next(w for w in fleet.workers if w != holder)
            async with s.post(f"{srv.base_url}/v1/admin/workers/{holder}/remove", json={"timeout_s": 10}) as r:
                assert r.status == 200, await r.text()
                assert await r.json() == {"id": holder, "removed": True, "requests_moved": 0,
                                          "prefixes_handed_off": 1}
            assert list(fleet.workers) == [other]
            assert fleet.workers[other].engine.kv_imported_blocks >= 32  # type: ignore[attr-defined]
            third = await ask(s, srv.base_url, PREFIX + "third question")
            assert third["worker"] == other and third["overlap_blocks"] >= 32
