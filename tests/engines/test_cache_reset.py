"""The fleet's prefix-cache reset in front of vLLM-shaped servers (``control/cache_reset.py``): each server asked
on its own path, the index following, a server that refuses (busy, or without the dev-mode path) keeping its cache
and saying why; the engine's ``AllBlocksCleared`` that follows is applied in sequence (no gap, no resync).

Real sockets on 127.0.0.1: fake vLLM servers (``support.fake_engine``, ``dev_mode``), ThunderAgent's real HTTP
server with the admin API on. (A real vLLM server's reset: ``tests/engines/test_conformance.py`` and
``test_real_vllm_admin.py``.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from support.fake_engine import FakeEngine, fake_vllm_config
from support.server import running_server
from support.waiting import wait_until

BS = 16


async def _reset(base: str, body: object = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(base + "/v1/admin/reset_prefix_cache", json=body) as r:
        return r.status, await r.json()


async def test_each_server_is_reset_on_its_path_and_the_index_follows(tiny_model_dir: Path) -> None:
    engines = [FakeEngine(block_size=BS, dev_mode=True), FakeEngine(block_size=BS, dev_mode=True),
               FakeEngine(block_size=BS)]  # the last without VLLM_SERVER_DEV_MODE: no reset path
    for e in engines:
        await e.start()
    try:
        async with running_server(fake_vllm_config(engines, tiny_model_dir, BS, control={"admin_api": True})) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 3, 10, "the servers routable")
            for e in engines:
                await e.wait_subscribed()
            ids = {e.url: w.worker_id for w in srv.fleet.workers.values() for e in engines
                   if getattr(w, "url", None) == e.url}
            index = srv.fleet.index
            prompts = {e.url: [1000 + k * 7 + i for i in range(6 * BS)] for k, e in enumerate(engines)}
            for e in engines:  # each server caches a prompt of its own (its events reach the index)
                e.cache_prompt(prompts[e.url])
            for e in engines:
                await wait_until(lambda e=e: index.num_blocks(ids[e.url]) == 6, 10, "the blocks indexed")

            def resyncs() -> float:  # (an index gap asks for one: counted by cause)
                return sum(x.value for m in srv.fleet.metrics.registry.collect() if m.name == "thunderagent_kv_resyncs"
                           for x in m.samples if x.name.endswith("_total"))

            before = resyncs()
            seqs = {e.url: index.last_seq(ids[e.url]) for e in engines}

            status, body = await _reset(srv.base_url)
            assert status == 200 and body["success"] is False
            answers = {w["id"]: w for w in body["workers"]}
            assert [answers[ids[e.url]]["success"] for e in engines] == [True, True, False]
            assert "has no /reset_prefix_cache (vLLM serves it with VLLM_SERVER_DEV_MODE=1)" in \
                answers[ids[engines[2].url]]["error"]
            assert [e.resets for e in engines] == [[{}], [{}], []]
            # the index: emptied for the two that reset, kept for the one that could not
            assert [index.num_blocks(ids[e.url]) for e in engines] == [0, 0, 6]
            assert [len(e._cache) for e in engines] == [0, 0, 6]
            # their AllBlocksCleared came (right away here) and applied in sequence, then a prompt cached anew
            for e in engines[:2]:
                await wait_until(lambda e=e: index.last_seq(ids[e.url]) == seqs[e.url] + 1, 10, "AllBlocksCleared")
            engines[0].cache_prompt(prompts[engines[0].url])
            await wait_until(lambda: index.num_blocks(ids[engines[0].url]) == 6, 10, "new blocks indexed")
            await asyncio.sleep(0.3)  # (a gap would have asked for a resync by now)
            assert resyncs() == before

            # a busy server refuses (vLLM's {"success": false}) and keeps its cache; with running requests: reset
            engines[0].running = 1
            status, body = await _reset(srv.base_url, {"workers": [ids[engines[0].url]]})
            assert status == 200 and body["success"] is False
            assert "blocks are still in use" in body["workers"][0]["error"]
            assert index.num_blocks(ids[engines[0].url]) == 6
            status, body = await _reset(srv.base_url, {"workers": [ids[engines[0].url]],
                                                        "reset_running_requests": True, "reset_external": True})
            assert (status, body) == (200, {"success": True, "workers": [{"id": ids[engines[0].url],
                                                                          "success": True}]})
            assert engines[0].resets[-1] == {"reset_running_requests": "true", "reset_external": "true"}
            assert index.num_blocks(ids[engines[0].url]) == 0
            engines[0].running = 0
    finally:
        for e in engines:
            await e.stop()


async def test_sglang_servers_are_flushed(tiny_model_dir: Path) -> None:
    engine = FakeEngine(flavor="sglang", block_size=BS, dev_mode=True)
    await engine.start()
    try:
        cfg = fake_vllm_config([engine], tiny_model_dir, BS, control={"admin_api": True}, engine="sglang")
        async with running_server(cfg) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 1, 10, "the server routable")
            await engine.wait_subscribed()
            engine.running = 1  # SGLang flushes only an idle server: 400, said
            status, body = await _reset(srv.base_url)
            assert status == 200 and body["success"] is False and "HTTP 400" in body["workers"][0]["error"]
            status, body = await _reset(srv.base_url, {"reset_running_requests": True})
            assert "SGLang's /flush_cache resets neither running requests" in body["workers"][0]["error"]
            engine.running = 0
            status, body = await _reset(srv.base_url)
            assert (status, body["success"]) == (200, True) and len(engine.resets) == 2
    finally:
        await engine.stop()
