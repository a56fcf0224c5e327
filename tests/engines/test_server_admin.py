"""The fleet's prefix-cache reset in front of vLLM-shaped servers (``control/server_admin.py``): each server asked
on its own path, the index following, a server that refuses (busy, or without the dev-mode path) keeping its cache
and saying why; the engine's ``AllBlocksCleared`` that follows is applied in sequence (no gap, no resync).

Real sockets on 127.0.0.1: fake vLLM servers (``support.fake_engine``, ``dev_mode``), ThunderAgent's real HTTP
server with the admin API on. (A real vLLM server's reset: ``tests/engines/test_conformance.py`` and
``test_real_vllm_admin.py``.)"""

from __future__ import annotations

import asyncio
import functools
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from typer.testing import CliRunner

from support.fake_engine import FakeEngine, fake_vllm_config
from support.server import Server, running_server
from support.waiting import wait_until
from thunderagent.cli import app

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


async def test_the_fleets_servers_put_to_sleep_and_woken(tiny_model_dir: Path) -> None:
    """vLLM's sleep mode for the fleet (an RL trainer freeing GPU memory between rollouts): ``/sleep`` on the servers
    named (or all), a sleeping server routed to only while no awake one can take a request, its index entries gone
    from level 1 (its KV cache discarded); a partial ``/wake_up`` keeps it asleep, a whole one brings it back; bad
    parameters are named before any server is asked."""
    engines = [FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)]
    async with _fleet(engines, tiny_model_dir) as srv:
        base, index, fleet = srv.base_url, srv.fleet.index, srv.fleet
        ids = {e.url: w.worker_id for w in fleet.workers.values() for e in engines if getattr(w, "url", None) == e.url}
        w0, w1 = ids[engines[0].url], ids[engines[1].url]
        engines[0].cache_prompt(list(range(100, 100 + 4 * BS)))
        engines[1].cache_prompt(list(range(500, 500 + 2 * BS)))
        await wait_until(lambda: (index.num_blocks(w0), index.num_blocks(w1)) == (4, 2), 10, "indexed")

        status, body = await _admin(base, f"/sleep?level=1&workers={w0}", None)
        assert status == 200 and body == {"success": True, "workers": [
            {"id": w0, "success": True, "answer": {"status": "sleeping", "level": 1}}]}
        assert engines[0].dev_calls == ["/sleep?level=1"] and engines[1].dev_calls == []
        assert fleet.asleep == {w0} and (index.num_blocks(w0), index.num_blocks(w1)) == (0, 2)
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/health") as r:
                assert {w["id"]: w["asleep"] for w in (await r.json())["workers"]} == {w0: True, w1: False}
            async with s.get(base + "/metrics") as r:
                assert f'thunderagent_worker_asleep{{worker="{w0}"}} 1.0' in await r.text()
            async with s.get(base + "/is_sleeping") as r:
                assert (r.status, await r.json()) == (200, {"is_sleeping": False, "workers": [
                    {"id": w0, "is_sleeping": True}, {"id": w1, "is_sleeping": False}]})
            served = []
            for k in range(6):  # (the sleeping server would hold them: they all go to the awake one)
                async with s.post(base + "/v1/completions", json={"model": fleet.model_name, "prompt": f"p{k} " * 9,
                                                                   "max_tokens": 2}) as r:
                    assert r.status == 200
                    served.append(r.headers["x-thunderagent-worker"])
            assert served == [w1] * 6
        # every server asleep: a request is routed anyway and waits in its server until that one wakes
        status, body = await _admin(base, f"/sleep?level=0&mode=wait&workers={w1}", None)
        assert status == 200 and fleet.asleep == {w0, w1} and index.num_blocks(w1) > 0  # (level 0 keeps the cache)
        waiting = asyncio.create_task(srv.client.completions.create(model=fleet.model_name, prompt="while asleep",
                                                                    max_tokens=3))
        await asyncio.sleep(0.4)
        assert not waiting.done()
        status, body = await _admin(base, "/wake_up?tags=weights", None)  # w0's kv_cache still sleeps
        assert status == 200 and [w["answer"]["status"] for w in body["workers"]] == ["sleeping", "awake"]
        assert fleet.asleep == {w0}
        status, body = await _admin(base, "/wake_up", None)
        assert status == 200 and fleet.asleep == set() and engines[0].asleep_tags == set()
        assert (await asyncio.wait_for(waiting, 10)).usage.completion_tokens == 3
        async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
            assert f'thunderagent_worker_asleep{{worker="{w0}"}} 0.0' in await r.text()
        # refused before any server is asked, naming the parameter
        for query, param, code in (("level=3", "level", 400), ("mode=now", "mode", 400), ("x=1", "x", 400),
                                   ("workers=nobody", "workers", 404), ("workers=", "workers", 400)):
            status, body = await _admin(base, f"/sleep?{query}", None)
            assert (status, body["error"]["param"]) == (code, param), query
        status, body = await _admin(base, "/wake_up?tags=gpu", None)
        assert (status, body["error"]["param"]) == (400, "tags")
        assert engines[0].dev_calls[-2:] == ["/wake_up?tags=weights", "/wake_up"]
        # the same from the command line
        cli = functools.partial(CliRunner().invoke, app)
        r = await asyncio.to_thread(cli, ["workers", "sleep", "--level", "0", "--worker", w1, "--url", base])
        assert r.exit_code == 0 and r.output.splitlines() == [f"{w1}: asleep"] and fleet.asleep == {w1}
        r = await asyncio.to_thread(cli, ["workers", "list", "--url", base])
        assert r.exit_code == 0 and "asleep (l" in r.output  # (the table, cut to the runner's 80 columns)
        r = await asyncio.to_thread(cli, ["workers", "wake-up", "--tag", "scheduling", "--url", base])
        assert r.exit_code == 0 and r.output.splitlines() == [f"{w0}: awake", f"{w1}: awake"] and not fleet.asleep
        # a KV-memory release needs a paused server: the servers' refusal comes back, naming each
        status, body = await _admin(base, "/release_kv_cache_memory", None)
        assert status == 502 and body["error"]["code"] == "servers_refused"
        assert "requires a completed pause first" in body["workers"][0]["error"]
        # a server put to sleep behind ThunderAgent's back (a trainer calling it directly): its metrics say so, and
        # the fleet follows within a poll, both ways
        async with aiohttp.ClientSession() as s:
            async with s.post(engines[1].url + "/sleep?level=0") as r:
                assert r.status == 200
            await wait_until(lambda: fleet.asleep == {w1}, 10, "the fleet to read w1's sleep gauge")
            async with s.post(engines[1].url + "/wake_up") as r:
                assert r.status == 200
            await wait_until(lambda: not fleet.asleep, 10, "the fleet to read w1 awake")


async def test_a_pause_sent_to_a_server_directly_is_noticed(tiny_model_dir: Path) -> None:
    """A trainer that pauses one server itself (vLLM's ``/pause``, not through ThunderAgent): the load polls read its
    ``/is_paused``, so routing leaves it for the others until it resumes, the gauge and ``/health`` say so; a sleep
    sent directly (which pauses vLLM's scheduling too) is a sleep mark only; a pause asked through ThunderAgent is not
    undone by the polls; a server without the dev-mode paths is asked once, and stays routable."""
    engines = [FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)] + [FakeEngine(block_size=BS)]
    async with _fleet(engines, tiny_model_dir) as srv:
        base, fleet = srv.base_url, srv.fleet
        ids = {e.url: w.worker_id for w in fleet.workers.values() for e in engines if getattr(w, "url", None) == e.url}
        w0, w1, w2 = (ids[e.url] for e in engines)
        await wait_until(lambda: not fleet.workers[w2]._health.reads_pause, 10, "the server without it asked once")
        async with aiohttp.ClientSession() as s:
            async with s.post(engines[0].url + "/pause?mode=keep&clear_cache=false") as r:
                assert r.status == 200
            await wait_until(lambda: fleet.paused == {w0}, 10, "the fleet to read w0's /is_paused")
            async with s.get(base + "/health") as r:
                assert {w["id"]: w["paused"] for w in (await r.json())["workers"]} == {w0: True, w1: False, w2: False}
            async with s.get(base + "/metrics") as r:
                assert f'thunderagent_worker_paused{{worker="{w0}"}} 1.0' in await r.text()
            for k in range(6):  # (the paused server would hold them)
                async with s.post(base + "/v1/completions", json={"model": fleet.model_name, "prompt": f"q{k} " * 9,
                                                                   "max_tokens": 2}) as r:
                    assert r.status == 200 and r.headers["x-thunderagent-worker"] in (w1, w2)
            async with s.post(engines[0].url + "/resume") as r:
                assert r.status == 200
            await wait_until(lambda: not fleet.paused, 10, "the fleet to read w0 resumed")
            async with s.get(base + "/metrics") as r:
                assert f'thunderagent_worker_paused{{worker="{w0}"}} 0.0' in await r.text()
            # asleep (its /is_paused says true as well): the sleep mark alone, both gone once woken
            async with s.post(engines[1].url + "/sleep?level=0") as r:
                assert r.status == 200
            await wait_until(lambda: fleet.asleep == {w1}, 10, "the fleet to read w1's sleep gauge")
            reads = engines[1].paused_reads
            await wait_until(lambda: engines[1].paused_reads >= reads + 3, 10, "more polls of w1")
            assert not fleet.paused
            async with s.post(engines[1].url + "/wake_up") as r:
                assert r.status == 200
            await wait_until(lambda: not fleet.asleep, 10, "the fleet to read w1 awake")
        # paused through ThunderAgent: the polls agree, and nothing flaps
        assert (await _admin(base, f"/pause?mode=keep&workers={w1}", None))[0] == 200
        reads = engines[1].paused_reads
        await wait_until(lambda: engines[1].paused_reads >= reads + 3, 10, "more polls of w1")
        assert fleet.paused == {w1}
        assert (await _admin(base, f"/resume?workers={w1}", None))[0] == 200 and not fleet.paused
        assert w2 in {w.worker_id for w in fleet.routable()} and not fleet.workers[w2]._health.reads_pause


async def test_collective_rpc_abort_and_weight_updates_on_the_fleets_servers(tiny_model_dir: Path) -> None:
    """vLLM's ``/collective_rpc`` (``results``: every server's, in worker order), ``/abort_requests`` and the RL weight
    transfer through the fleet: the body goes to each server as it came; ``workers`` picks servers (a per-server
    ``init_info``); a body that is not a JSON object is a 400, a server's refusal a 502 with its message."""
    engines = [FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)]
    async with _fleet(engines, tiny_model_dir) as srv:
        base, fleet = srv.base_url, srv.fleet
        ids = sorted(fleet.workers)
        urls = {w.worker_id: w.url for w in fleet.workers.values()}  # type: ignore[attr-defined]
        status, body = await _admin(base, "/collective_rpc", {"method": "echo", "args": ["x"], "kwargs": {"k": "v"}})
        assert status == 200 and body["results"] == [f"{urls[w]} echo" for w in ids]
        assert [e.rpc_calls for e in engines] == [[("/collective_rpc", {"method": "echo", "args": ["x"],
                                                                         "kwargs": {"k": "v"}})]] * 2
        status, body = await _admin(base, "/collective_rpc", {"args": []})
        assert status == 502 and "Missing 'method' in request body" in body["workers"][0]["error"]
        for bad in ([1], "x"):
            status, body = await _admin(base, "/collective_rpc", bad)
            assert status == 400 and "takes a JSON object" in body["error"]["message"]
        async with aiohttp.ClientSession() as s, s.post(base + "/collective_rpc", data=b"{nope",
                                                        headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        assert [len(e.rpc_calls) for e in engines] == [2, 2]  # the refused ones never left
        status, body = await _admin(base, "/abort_requests", {"request_ids": ["chatcmpl-1"]})
        assert status == 200 and body["success"]
        async with aiohttp.ClientSession() as s, s.post(base + "/abort_requests") as r:  # no body: everything
            assert r.status == 200 and engines[0].rpc_calls[-1] == ("/abort_requests", {})
        for k, w in enumerate(ids):  # each server its own rank offset
            status, _ = await _admin(base, f"/init_weight_transfer_engine?workers={w}",
                                     {"init_info": {"rank_offset": k + 1}})
            assert status == 200
        got = {e.url: [b for p, b in e.rpc_calls if p == "/init_weight_transfer_engine"] for e in engines}
        assert got == {urls[w]: [{"init_info": {"rank_offset": k + 1}}] for k, w in enumerate(ids)}
        status, body = await _admin(base, "/update_weights", {"update_info": {"names": ["w"]}})
        assert status == 200 and [w["answer"] for w in body["workers"]] == [{"message": "/update_weights done"}] * 2
        status, body = await _admin(base, "/start_weight_update", None)  # (no such path on these servers)
        assert status == 502 and "has no /start_weight_update (vLLM serves it with VLLM_SERVER_DEV_MODE=1)" in \
            body["workers"][0]["error"]


async def test_server_info_elastic_ep_and_fault_tolerance_on_the_fleets_servers(tiny_model_dir: Path) -> None:
    """vLLM's ``/server_info`` (each server's configuration, ``config_format`` checked), elastic EP scaling and fault
    tolerance (a 202 from the server is its instruction accepted) through the fleet, ``workers`` picking servers; an
    answer too large to carry is a refusal naming its size, not a cut JSON."""
    engines = [FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)]
    async with _fleet(engines, tiny_model_dir) as srv:
        base, fleet = srv.base_url, srv.fleet
        ids = sorted(fleet.workers)
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/server_info?config_format=json") as r:
                body = await r.json()
            assert r.status == 200 and [w["id"] for w in body["workers"]] == ids
            assert [w["answer"]["vllm_config"] for w in body["workers"]] == [{"model": "m", "block_size": BS}] * 2
            async with s.get(base + "/server_info?config_format=yaml") as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "config_format"
            engines[1].server_info_padding = 600_000
            async with s.get(f"{base}/server_info?workers={ids[0]}&workers={ids[1]}") as r:
                body = await r.json()
            assert r.status == 502 and body["workers"][0]["success"] and not body["workers"][1]["success"]
            assert "more than the 524288 kept" in body["workers"][1]["error"]
            async with s.get(base + "/fault_tolerance/status") as r:
                assert r.status == 200 and [w["answer"] for w in (await r.json())["workers"]] == [{"status": "healthy"}] * 2
        status, body = await _admin(base, f"/scale_elastic_ep?workers={ids[0]}", {"new_data_parallel_size": 2})
        assert status == 200 and [w["id"] for w in body["workers"]] == [ids[0]]
        urls = {w.worker_id: w.url for w in fleet.workers.values()}  # type: ignore[attr-defined]
        scaled = {e.url: [b for p, b in e.rpc_calls if p == "/scale_elastic_ep"] for e in engines}
        assert scaled == {urls[ids[0]]: [{"new_data_parallel_size": 2}], urls[ids[1]]: []}
        status, body = await _admin(base, "/is_scaling_elastic_ep", None)
        assert status == 200 and [w["answer"] for w in body["workers"]] == [{"is_scaling_elastic_ep": False}] * 2
        status, body = await _admin(base, "/fault_tolerance/apply", {"instruction": "retry"})
        assert status == 200 and [w["answer"]["request_id"] for w in body["workers"]] == ["ft-1"] * 2
        status, body = await _admin(base, "/fault_tolerance/apply", {"instruction": "restart"})
        assert status == 502 and "Invalid instruction: 'restart'" in body["workers"][0]["error"]


@pytest.mark.nats
async def test_sleep_over_nats_reaches_every_frontend(tmp_path: Path) -> None:
    """Worker processes in front of vLLM-shaped servers, two frontend processes: a sleep asked of one frontend is made
    by the worker process, which keeps the mark, so the other frontend reads it in heartbeats and routes to the awake
    server; a wake-up through the other puts it back everywhere; a ``/collective_rpc`` body crosses the bus; a pause
    sent to a server directly reaches every frontend from its worker process's polls."""
    pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")
    from integration.nats_cluster import Cluster

    engines = [FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)]
    for e in engines:
        await e.start()
    cluster = Cluster(tmp_path)
    base = ("control_plane: {{admin_api: true, heartbeat_interval: 0.2, heartbeat_misses: 5}}\nexecution_group:\n"
            "  nodes:\n    - {{engine: openai, block_size: 16, endpoints: [{{url: \"{}\"}}]}}\n")
    try:
        cluster.start_nats()
        for w, e in zip(("wa", "wb"), engines):
            (tmp_path / f"{w}.yaml").write_text(base.format(e.url))
            cluster.start_worker(w, config=tmp_path / f"{w}.yaml")
        for f in ("fa", "fb"):
            cluster.start_frontend(f, config=tmp_path / "wa.yaml")

        def asleep(f: str, mark: str = "asleep") -> dict[str, bool]:
            try:
                return {w["id"]: w[mark] for w in cluster.health(f)["workers"] if w["health"] == "healthy"}
            except OSError:
                return {}

        def call(f: str, path: str, body: object | None = None) -> tuple[int, dict]:
            req = urllib.request.Request(f"http://127.0.0.1:{cluster.ports[f]}{path}", method="POST",
                                         data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=20) as resp:
                    return resp.status, json.load(resp)
            except urllib.error.HTTPError as err:
                return err.code, json.load(err)

        async def until(f: str, want: dict[str, bool], timeout: float, mark: str = "asleep") -> None:
            for _ in range(int(timeout / 0.1)):  # (blocking HTTP off the loop, which serves the servers)
                if await asyncio.to_thread(asleep, f, mark) == want:
                    return
                assert not any(cluster.exited(p) for p in cluster.procs if p != "nats"), cluster.logs()
                await asyncio.sleep(0.1)
            assert await asyncio.to_thread(asleep, f, mark) == want, cluster.logs()

        for f in ("fa", "fb"):
            await until(f, {"wa": False, "wb": False}, 60)
        status, body = await asyncio.to_thread(call, "fa", "/sleep?level=1&workers=wa")
        assert status == 200 and body["workers"] == [{"id": "wa", "success": True,
                                                      "answer": {"status": "sleeping", "level": 1}}]
        assert engines[0].dev_calls == ["/sleep?level=1"]
        assert await asyncio.to_thread(asleep, "fa") == {"wa": True, "wb": False}  # at once on the frontend asked
        await until("fb", {"wa": True, "wb": False}, 5)  # from wa's heartbeat
        cluster.start_frontend("fc", config=tmp_path / "wa.yaml")  # started after the sleep: learns it from wa
        await until("fc", {"wa": True, "wb": False}, 60)
        client = cluster.client("fb")
        for k in range(4):
            raw = await asyncio.to_thread(client.completions.with_raw_response.create, model="thunderagent-sim",
                                          prompt=f"while wa sleeps {k}", max_tokens=2)
            assert raw.headers["x-thunderagent-worker"] == "wb"
        status, body = await asyncio.to_thread(call, "fb", "/wake_up")
        assert status == 200 and [w["answer"]["status"] for w in body["workers"]] == ["awake", "awake"]
        await until("fa", {"wa": False, "wb": False}, 5)
        # a pause of one worker through fa: every frontend routes around it (the worker keeps the mark)
        assert (await asyncio.to_thread(call, "fa", "/pause?mode=keep&workers=wb"))[0] == 200
        for f in ("fa", "fb", "fc"):
            for _ in range(50):
                if await asyncio.to_thread(asleep, f, "paused") == {"wa": False, "wb": True}:
                    break
                await asyncio.sleep(0.1)
            assert await asyncio.to_thread(asleep, f, "paused") == {"wa": False, "wb": True}, f
        assert (await asyncio.to_thread(call, "fc", "/resume"))[0] == 200
        status, body = await asyncio.to_thread(call, "fa", "/collective_rpc", {"method": "ping", "args": ["1"]})
        assert status == 200 and body["results"] == [f"{engines[0].url} ping", f"{engines[1].url} ping"]
        assert engines[1].rpc_calls == [("/collective_rpc", {"method": "ping", "args": ["1"]})]
        # a pause sent to wa's server directly: wa's process reads its /is_paused and tells every frontend
        async with aiohttp.ClientSession() as s:
            async with s.post(engines[0].url + "/pause?mode=keep&clear_cache=false") as r:
                assert r.status == 200
            for f in ("fa", "fb", "fc"):
                await until(f, {"wa": True, "wb": False}, 10, "paused")
            async with s.post(engines[0].url + "/resume") as r:
                assert r.status == 200
            for f in ("fa", "fb", "fc"):
                await until(f, {"wa": False, "wb": False}, 10, "paused")
    finally:
        cluster.close()
        for e in engines:
            await e.stop()


async def test_a_rolling_pause_keeps_the_rest_of_the_fleet_serving(tiny_model_dir: Path) -> None:
    """``/pause`` and ``/resume`` with ``workers``: the server named is paused (its requests would wait there), so
    every request goes to the others until it resumes; ``/health`` says which is paused; unknown or empty names are
    refused before any server is asked."""
    engines = [FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)]
    async with _fleet(engines, tiny_model_dir) as srv:
        base, fleet = srv.base_url, srv.fleet
        ids = {e.url: w.worker_id for w in fleet.workers.values() for e in engines if getattr(w, "url", None) == e.url}
        w0, w1 = ids[engines[0].url], ids[engines[1].url]
        status, body = await _admin(base, f"/pause?mode=keep&clear_cache=false&workers={w0}", None)
        assert status == 200 and [w["id"] for w in body["workers"]] == [w0] and fleet.paused == {w0}
        assert engines[0].pauses == [{"mode": "keep", "clear_cache": "false"}] and engines[1].pauses == []
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/health") as r:
                assert {w["id"]: w["paused"] for w in (await r.json())["workers"]} == {w0: True, w1: False}
            for k in range(6):  # (the paused server would hold them)
                async with s.post(base + "/v1/completions", json={"model": fleet.model_name, "prompt": f"q{k} " * 9,
                                                                   "max_tokens": 2}) as r:
                    assert r.status == 200 and r.headers["x-thunderagent-worker"] == w1
        for query, code in (("workers=nobody", 404), ("workers=", 400), (f"workers={w0}&x=1", 400)):
            status, body = await _admin(base, f"/pause?{query}", None)
            assert (status, body["error"]["param"]) == (code, "workers" if "x=" not in query else "x"), query
        assert (await _admin(base, "/resume?workers=", None))[0] == 400
        status, body = await _admin(base, f"/resume?workers={w0}", None)
        assert status == 200 and not fleet.paused and engines[0].pauses[-1] == {"resume": ""}
        assert len(engines[1].pauses) == 0
        r = await asyncio.to_thread(functools.partial(CliRunner().invoke, app),
                                    ["workers", "pause", "--mode", "wait", "--worker", w1, "--url", base])
        assert r.exit_code == 0 and r.output.splitlines() == [f"{w1}: paused"] and fleet.paused == {w1}
        r = await asyncio.to_thread(functools.partial(CliRunner().invoke, app), ["workers", "resume", "--url", base])
        assert r.exit_code == 0 and not fleet.paused
        # paused, then asleep, then woken whole: vLLM resumes a woken server's scheduling, so the pause is over too
        assert (await _admin(base, f"/pause?mode=keep&workers={w0}", None))[0] == 200
        assert (await _admin(base, f"/sleep?level=1&workers={w0}", None))[0] == 200
        assert fleet.paused == {w0} and fleet.asleep == {w0}
        assert (await _admin(base, f"/wake_up?workers={w0}", None))[0] == 200
        assert not fleet.paused and not fleet.asleep


async def test_abort_requests_ends_the_requests_held_in_the_queue(tiny_model_dir: Path) -> None:
    """vLLM's ``/abort_requests`` through the fleet also ends the requests ThunderAgent still holds (no server has
    them, so the servers' abort cannot): named by the client's ``x-request-id`` (bare or as vLLM's ``chatcmpl-`` /
    ``cmpl-`` id), or all of them with no ids. Each gets vLLM's answer to a request aborted while it waited: nothing
    generated, ``finish_reason: abort`` (JSON or streamed, usage as asked), on the token path and relayed; the
    Messages API vLLM's conversion of it (an empty text block, no stop reason). With ``?workers=`` only those
    servers are asked (held ones stay). The servers end the requests they hold, with vLLM's answers (a stream
    without a choice: aborted, not routed again)."""
    engines = [FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)]
    for e in engines:
        await e.start()
    # (a worker takes a request only while no prompt sent to it waits for its first token: the rest are held)
    cfg = fake_vllm_config(engines, tiny_model_dir, BS, control={"admin_api": True},
                           scheduler={"tracked_prefill_passes": 0.001})
    try:
        async with running_server(cfg) as srv:
            base, fleet, model = srv.base_url, srv.fleet, srv.fleet.model_name
            await wait_until(lambda: len(fleet.routable()) == 2, 10, "the servers routable")
            for e in engines:
                e._resumed.clear()  # (paused behind the fleet's back: what a server has, it keeps)
            first = [asyncio.create_task(srv.client.completions.create(model=model, prompt=f"first {k} " * 8,
                                                                       max_tokens=2)) for k in range(2)]
            await wait_until(lambda: sum(len(e.requests) for e in engines) == 2, 10, "one request in each server")

            async def post(path: str, body: dict, rid: str | None = None) -> tuple[int, str]:
                headers = {"x-request-id": rid} if rid else {"x-thunderagent-program-id": "prog-1"}
                async with aiohttp.ClientSession() as s, s.post(base + path, json=body, headers=headers) as r:
                    return r.status, await r.text()

            chat = {"model": model, "messages": [{"role": "user", "content": "held " * 10}], "max_tokens": 4}
            comp = {"model": model, "prompt": "held too " * 10, "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}}
            held = {  # the token path, named by x-request-id; relayed (logprobs), named too; unnamed ones
                "a": asyncio.create_task(post("/v1/chat/completions", chat, "rid-a")),
                "b": asyncio.create_task(post("/v1/completions", comp, "rid-b")),
                "c": asyncio.create_task(post("/v1/chat/completions", {**chat, "logprobs": True}, "rid-c")),
                "d": asyncio.create_task(post("/v1/completions", {**comp, "logprobs": 1})),
                "e": asyncio.create_task(post("/v1/messages", {"model": model, "max_tokens": 4, "messages": [
                    {"role": "user", "content": "a message"}]})),
                "f": asyncio.create_task(post("/v1/chat/completions", {**chat, "stream": True})),
                "g": asyncio.create_task(post("/v1/messages", {"model": model, "max_tokens": 4, "stream": True,
                                                               "messages": [{"role": "user", "content": "streamed"}]})),
            }
            await wait_until(lambda: fleet.dispatcher.held() == 7, 10, "seven requests held")
            status, body = await _admin(base, "/abort_requests", {"request_ids": ["chatcmpl-rid-a", "cmpl-rid-b",
                                                                               "rid-c", "nobody"]})
            assert status == 200 and body["held_aborted"] == 3 and engines[0].rpc_calls[-1] == (
                "/abort_requests", {"request_ids": ["chatcmpl-rid-a", "cmpl-rid-b", "rid-c", "nobody"]})
            status, text = await asyncio.wait_for(held.pop("a"), 5)
            answer = json.loads(text)
            assert status == 200 and answer["choices"] == [{"index": 0, "finish_reason": "abort", "logprobs": None,
                                                            "message": {"role": "assistant", "content": ""}}]
            assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] > 10
            status, text = await asyncio.wait_for(held.pop("b"), 5)
            events = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
            assert status == 200 and text.endswith("data: [DONE]\n\n")
            assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == ["abort"]
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 0  # usage, as asked
            status, text = await asyncio.wait_for(held.pop("c"), 5)  # relayed, named bare
            assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "abort"
            assert fleet.dispatcher.held() == 4 and not any(t.done() for t in held.values())
            # a call for some servers leaves the held requests alone; one for the fleet ends every one
            w0 = min(fleet.workers)
            status, body = await _admin(base, f"/abort_requests?workers={w0}", {"request_ids": ["rid-x"]})
            assert status == 200 and "held_aborted" not in body and fleet.dispatcher.held() == 4
            async with aiohttp.ClientSession() as s, s.post(base + "/abort_requests") as r:
                assert r.status == 200 and (await r.json())["held_aborted"] == 4
            got = {k: await asyncio.wait_for(t, 5) for k, t in held.items()}
            # relayed and streamed, vLLM's stream of it: no chunk for an output without tokens; the usage, [DONE]
            parts = got["d"][1].split("\n\n")
            assert got["d"][0] == 200 and parts[1:] == ["data: [DONE]", ""], got["d"]
            usage_chunk = json.loads(parts[0][6:])
            assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 0
            status, text = got["e"]  # vLLM's Messages answer to an aborted chat request (exclude_none: no stop_reason)
            message = json.loads(text)
            assert status == 200 and message["id"].startswith("chatcmpl-") and "stop_reason" not in message, text
            assert (message["type"], message["role"], message["content"], message["model"]) == (
                "message", "assistant", [{"type": "text", "text": ""}], model)
            assert message["usage"]["output_tokens"] == 0 and message["usage"]["input_tokens"] > 0
            status, text = got["g"]  # streamed: start, a delta with vLLM's stop reason (end_turn) and the usage, stop
            parts = [x.split("\n") for x in text.strip().split("\n\n")]
            assert status == 200 and [p[0] for p in parts] == ["event: message_start", "event: message_delta",
                                                                "event: message_stop"], text
            delta = json.loads(parts[1][1][6:])
            assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
            assert delta["usage"]["output_tokens"] == 0 and json.loads(parts[0][1][6:])["message"]["content"] == []
            assert got["f"][0] == 200 and '"finish_reason":"abort"' in got["f"][1]
            assert fleet.dispatcher.held() == 0
            async with aiohttp.ClientSession() as s, s.get(base + "/v1/programs/prog-1") as r:
                program = await r.json()  # (its requests were no steps of it)
                assert (program["in_flight"], program["steps"], program["state"]) == (0, 0, "acting"), program
            for bad in ({"request_ids": "rid-a"}, {"request_ids": [1]}):
                status, body = await _admin(base, "/abort_requests", bad)
                assert status == 400 and body["error"]["param"] == "request_ids"
            # the servers ended theirs too (vLLM's abort of everything): on the token path as vLLM's stream of a
            # request aborted before its first token says (no choice, then [DONE]): aborted, not routed again
            done = await asyncio.wait_for(asyncio.gather(*first), 10)
            assert [(d.choices[0].finish_reason, d.usage.completion_tokens) for d in done] == [("abort", 0)] * 2
            assert sum(len(e.requests) for e in engines) == 2
            async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
                assert 'thunderagent_scheduler_queued{priority="0"} 0.0' in await r.text()
    finally:
        for e in engines:
            await e.stop()


async def test_abort_requests_over_nats_ends_every_frontends_held_requests(tmp_path: Path) -> None:
    """Two frontend processes each hold a request (the one server is busy with the one each sent before it): an
    ``/abort_requests`` through one frontend ends its own held request and asks the other to end its one too, and
    counts both; each held client gets ``finish_reason: abort``, as the server's own requests do."""
    pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")
    from integration.nats_cluster import Cluster

    engine = FakeEngine(block_size=BS, dev_mode=True)
    await engine.start()
    cluster = Cluster(tmp_path)
    (tmp_path / "wa.yaml").write_text(
        "control_plane: {admin_api: true, heartbeat_interval: 0.2, heartbeat_misses: 5}\n"
        "scheduler: {tracked_prefill_passes: 0.001}\nexecution_group:\n"  # (one request at a time per frontend)
        f"  nodes:\n    - {{engine: openai, block_size: 16, endpoints: [{{url: \"{engine.url}\"}}]}}\n")

    def post(f: str, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{cluster.ports[f]}{path}", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    def health(f: str) -> dict:
        try:
            return cluster.health(f)
        except OSError:
            return {}

    def held(f: str) -> int:
        return health(f).get("scheduler", {}).get("held", -1)

    def peers(f: str) -> int:
        return len(health(f).get("frontend", {}).get("planner_leadership", {}).get("frontends", []))

    try:
        cluster.start_nats()
        cluster.start_worker("wa", config=tmp_path / "wa.yaml")
        for f in ("fa", "fb"):
            cluster.start_frontend(f, config=tmp_path / "wa.yaml")
        for f in ("fa", "fb"):  # (the one asked waits for the answers of the frontends it heard beat)
            await wait_until(lambda f=f: health(f).get("healthy_workers") == 1 and peers(f) == 2, 60,
                             f"{f} sees the worker and the other frontend")
        engine._resumed.clear()  # busy: what the server has, it keeps
        body = {"model": "thunderagent-sim", "max_tokens": 2}
        first = [asyncio.create_task(asyncio.to_thread(post, f, "/v1/completions", {**body, "prompt": f"{f} " * 30}))
                 for f in ("fa", "fb")]
        await wait_until(lambda: len(engine.requests) == 2, 10, "one request from each frontend in the server")
        late = [asyncio.create_task(asyncio.to_thread(post, f, "/v1/completions", {**body, "prompt": f"late {f} " * 20}))
                for f in ("fa", "fb")]
        for f in ("fa", "fb"):
            await wait_until(lambda f=f: held(f) == 1, 10, f"{f} holds one request")
        status, answer = await asyncio.to_thread(post, "fa", "/abort_requests", {})
        assert status == 200 and answer["held_aborted"] == 2, answer
        for t in late:
            status, out = await asyncio.wait_for(t, 10)
            assert status == 200 and out["choices"][0]["finish_reason"] == "abort" and out["usage"][
                "completion_tokens"] == 0, out
        assert held("fa") == 0 and held("fb") == 0 and len(engine.requests) == 2
        assert health("fb")["frontend"]["held_aborted_for_peers"] == 1
        assert health("fa")["frontend"]["held_aborted_for_peers"] == 0
        for t in first:  # (the server's abort of everything ended them: vLLM's answer, relayed)
            status, out = await asyncio.wait_for(t, 10)
            assert status == 200 and out["choices"][0]["finish_reason"] == "abort", out
    finally:
        cluster.close()
        await engine.stop()
