"""The fleet's prefix-cache reset in front of vLLM-shaped servers (``control/server_admin.py``): each server asked
on its own path, the index following, a server that refuses (busy, or without the dev-mode path) keeping its cache
and saying why; the engine's ``AllBlocksCleared`` that follows is applied in sequence (no gap, no resync).

Real sockets on 127.0.0.1: fake vLLM servers (``support.fake_engine``, ``dev_mode``), ThunderAgent's real HTTP
server with the admin API on. (A real vLLM server's reset: ``tests/engines/test_conformance.py`` and
``test_real_vllm_admin.py``.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from support.fake_engine import FakeEngine, fake_vllm_config
from support.server import Server, running_server
from support.waiting import wait_until

BS = 16


@asynccontextmanager
async def _fleet(engines: list[FakeEngine], model_dir: Path, **node: object) -> AsyncIterator[Server]:
    """``serve`` with the admin API on in front of ``engines`` (started here, stopped after), all routable."""
    for e in engines:
        await e.start()
    try:
        async with running_server(fake_vllm_config(engines, model_dir, BS, control={"admin_api": True},
                                                   **node)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == len(engines), 10, "the servers routable")
            for e in engines:
                await e.wait_subscribed()
            yield srv
    finally:
        for e in engines:
            await e.stop()


async def _reset(base: str, body: object = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(base + "/v1/admin/reset_prefix_cache", json=body) as r:
        return r.status, await r.json()


async def test_each_server_is_reset_on_its_path_and_the_index_follows(tiny_model_dir: Path) -> None:
    engines = [FakeEngine(block_size=BS, dev_mode=True), FakeEngine(block_size=BS, dev_mode=True),
               FakeEngine(block_size=BS)]  # the last without VLLM_SERVER_DEV_MODE: no reset path
    async with _fleet(engines, tiny_model_dir) as srv:
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


async def test_sglang_servers_are_flushed(tiny_model_dir: Path) -> None:
    engine = FakeEngine(flavor="sglang", block_size=BS, dev_mode=True)
    async with _fleet([engine], tiny_model_dir, engine="sglang") as srv:
        engine.running = 1  # SGLang flushes only an idle server: 400, said
        status, body = await _reset(srv.base_url)
        assert status == 200 and body["success"] is False and "HTTP 400" in body["workers"][0]["error"]
        status, body = await _reset(srv.base_url, {"reset_running_requests": True})
        assert "SGLang's /flush_cache resets neither running requests" in body["workers"][0]["error"]
        engine.running = 0
        status, body = await _reset(srv.base_url)
        assert (status, body["success"]) == (200, True) and len(engine.resets) == 2


async def _admin(base: str, path: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body) as r:
        return r.status, await r.json()


async def test_lora_adapters_loaded_and_unloaded_on_the_fleets_servers(tiny_model_dir: Path) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` for the fleet: every server (or those named)
    asked, the fleet routing the adapter's requests to the servers that hold it at once; a server that refuses
    (already loaded, no runtime loading) makes it a 502 with each server's answer."""
    engines = [FakeEngine(block_size=BS, lora_updating=True), FakeEngine(block_size=BS, lora_updating=True),
               FakeEngine(block_size=BS)]  # the last without VLLM_ALLOW_RUNTIME_LORA_UPDATING
    async with _fleet(engines, tiny_model_dir) as srv:
        ids = [next(w.worker_id for w in srv.fleet.workers.values() if getattr(w, "url", None) == e.url)
               for e in engines]
        base, c = srv.base_url, srv.client

        async def served_by(model: str) -> set[str]:
            got = set()
            for k in range(8):
                raw = await c.completions.with_raw_response.create(model=model, prompt=f"q{k} " * 20,
                                                                   max_tokens=1)
                got.add(raw.headers["x-thunderagent-worker"])
            return got

        load = {"lora_name": "sql", "lora_path": "/loras/sql", "workers": ids[:2]}
        status, body = await _admin(base, "/v1/load_lora_adapter", load)
        assert (status, body) == (200, {"success": True, "workers": [{"id": ids[0], "success": True},
                                                                    {"id": ids[1], "success": True}]})
        assert engines[0].adapters == engines[1].adapters == ["sql"] and engines[2].adapters == []
        assert engines[0].lora_calls == [("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/loras/sql"})]
        assert await served_by("sql") <= set(ids[:2])  # at once: no poll waited for
        async with aiohttp.ClientSession() as s, s.get(base + "/v1/admin/workers") as r:
            assert {w["id"]: w["adapters"] for w in (await r.json())["data"]} == {
                ids[0]: ["sql"], ids[1]: ["sql"], ids[2]: []}  # what each server serves, for the operator
        # already loaded: the servers' refusal, a 502 with each answer; in place: replaced
        status, body = await _admin(base, "/v1/load_lora_adapter", load)
        assert status == 502 and body["error"]["code"] == "servers_refused" and body["success"] is False
        assert "has already been loaded" in body["workers"][0]["error"]
        status, _ = await _admin(base, "/v1/load_lora_adapter", {**load, "load_inplace": True})
        assert status == 200 and engines[0].lora_calls[-1][1]["load_inplace"] is True
        # every server: the one without runtime loading says so, the others load it
        status, body = await _admin(base, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/l/c"})
        assert status == 502 and [w["success"] for w in body["workers"]] == [True, True, False]
        assert "has no /v1/load_lora_adapter (vLLM serves it with --enable-lora and " \
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)" in body["workers"][2]["error"]
        assert "1 of 3" not in body["error"]["message"] and "2 of 3 servers" in body["error"]["message"]
        assert await served_by("chat") <= set(ids[:2])
        # unloaded: no server serves it any more
        status, body = await _admin(base, "/v1/unload_lora_adapter", {"lora_name": "sql", "workers": ids[:2]})
        assert status == 200 and engines[0].adapters == engines[1].adapters == ["chat"]
        status, body = await _admin(base, "/v1/completions", {"model": "sql", "prompt": "x", "max_tokens": 1})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body = await _admin(base, "/v1/unload_lora_adapter", {"lora_name": "sql", "workers": ids[:1]})
        assert status == 502 and "cannot be found" in body["workers"][0]["error"]
        # ours: the fields named
        n = sum(len(e.lora_calls) for e in engines)
        for path, payload, code, param in (
                ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
                ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/p"}, 400, "lora_name"),
                ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/p", "is_3d_lora_weight": True}, 400,
                 "is_3d_lora_weight"),
                ("/v1/unload_lora_adapter", {"lora_name": "x", "workers": ["nope"]}, 404, "workers")):
            status, body = await _admin(base, path, payload)
            assert status == code and body["error"]["param"] == param, (payload, body)
        assert sum(len(e.lora_calls) for e in engines) == n  # none reached a server


async def test_the_fleets_generation_paused_and_resumed(tiny_model_dir: Path) -> None:
    """vLLM's ``/pause`` and ``/resume`` for the fleet (an RL trainer around a weight update): every server asked with
    the mode; a request sent meanwhile waits in its server and completes after the resume; a pause that clears the
    caches drops the index entries; bad parameters are named."""
    engines = [FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)]
    async with _fleet(engines, tiny_model_dir) as srv:
        base, index = srv.base_url, srv.fleet.index
        engines[0].cache_prompt(list(range(100, 100 + 4 * BS)))
        await wait_until(lambda: sum(index.num_blocks(w) for w in srv.fleet.workers) == 4, 10, "indexed")
        status, body = await _admin(base, "/pause?mode=keep&clear_cache=false", None)
        assert status == 200 and body["success"] and [e.pauses for e in engines] == [
            [{"mode": "keep", "clear_cache": "false"}]] * 2
        assert sum(index.num_blocks(w) for w in srv.fleet.workers) == 4  # kept: no clear asked
        waiting = asyncio.create_task(srv.client.completions.create(model=srv.fleet.model_name,
                                                                    prompt="during the pause", max_tokens=3))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # held in its server
        ids = sorted(srv.fleet.workers)
        async with aiohttp.ClientSession() as s, s.get(base + "/is_paused") as r:
            assert (r.status, await r.json()) == (200, {"is_paused": True, "workers": [
                {"id": w, "is_paused": True} for w in ids]})
        status, body = await _admin(base, "/resume", None)
        assert (status, body["success"]) == (200, True)
        async with aiohttp.ClientSession() as s, s.get(base + "/is_paused") as r:
            assert (await r.json())["is_paused"] is False
        out = await asyncio.wait_for(waiting, 10)
        assert out.usage.completion_tokens == 3
        # the default pause (abort, caches cleared): streams in flight end as the servers end them (finish_reason
        # abort, with what they made so far: an RL trainer resends from there), relayed or on the token path
        async def finish_of(extra: dict) -> tuple[int, str | None]:
            n, reason = 0, None
            async for ch in await srv.client.completions.create(model=srv.fleet.model_name, prompt="a long one " * 4,
                                                                max_tokens=400, stream=True, extra_body=extra):
                for c in ch.choices:
                    n += bool(c.text)
                    reason = c.finish_reason or reason
            return n, reason

        streams = [asyncio.create_task(finish_of(extra)) for extra in ({}, {"logprobs": 1})]  # token path, relayed
        await asyncio.sleep(0.15)
        status, body = await _admin(base, "/pause", None)
        ended = await asyncio.wait_for(asyncio.gather(*streams), 10)
        assert all(reason == "abort" and 0 < n < 400 for n, reason in ended), ended
        assert status == 200 and engines[0].pauses[-1] == {"mode": "abort", "clear_cache": "true"}
        assert sum(index.num_blocks(w) for w in srv.fleet.workers) == 0
        assert (await _admin(base, "/resume", None))[0] == 200
        for query, param in (("mode=later", "mode"), ("clear_cache=maybe", "clear_cache"), ("x=1", "x")):
            status, body = await _admin(base, f"/pause?{query}", None)
            assert status == 400 and body["error"]["param"] == param, query
        assert (await _admin(base, "/resume?now=1", None))[0] == 400
        assert len(engines[0].pauses) == 4  # the refused ones never left
        # vLLM's parameterless operator paths, on every server
        for path in ("/start_profile", "/stop_profile", "/reset_mm_cache", "/reset_encoder_cache"):
            status, body = await _admin(base, path, None)
            assert status == 200 and body["success"] and len(body["workers"]) == 2, (path, body)
        assert engines[1].dev_calls[-4:] == ["/start_profile", "/stop_profile", "/reset_mm_cache",
                                             "/reset_encoder_cache"]
        assert (await _admin(base, "/start_profile?delay=1", None))[0] == 400
