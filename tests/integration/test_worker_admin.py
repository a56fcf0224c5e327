"""The operator's worker endpoints through the real server (``/v1/admin/workers*``): cordon and uncordon,
a worker added and removed at runtime (drained, or forced with its streams moved), the switch and the keys."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from support.openai_backend import MODEL as OPENAI_MODEL
from support.openai_backend import OpenAIBackend
from support.server import running_server
from support.waiting import wait_until
from thunderagent.config import parse_config

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
ADMIN = "/v1/admin/workers"
LONG = 200  # tokens of a stream that must still run when the next call comes
ADMIN_KEY, TENANT_KEY = "admin-key-0123456789abcdef", "tenant-key-0123456789abcdef"


def _sim(**extra: object) -> dict:
    # at the engine's own speed, so that a 200-token stream runs for a second or more
    return {"control_plane": {"admin_api": True, **extra}, "execution_group": {"nodes": [{"count": 2}]},
            "scheduler": {"enabled": False}, "simulation": {"speedup": 1.0}}


async def _call(s: aiohttp.ClientSession, method: str, url: str, body: object = None,
                key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with s.request(method, url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def _worker_of(s: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int = 2) -> str:
    async with s.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                      "max_tokens": max_tokens}) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-thunderagent-worker"]


async def _stream(s: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int,
                  started: asyncio.Event, gate: asyncio.Event | None = None) -> tuple[str, int, str]:
    """A streamed completion read to its end: (worker it started on, tokens received, finish reason);
    ``gate``: stop reading after the first token until it is set (the request stays in flight)."""
    n, finish = 0, ""
    async with s.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                      "stream": True}) as r:
        assert r.status == 200
        worker = r.headers["x-thunderagent-worker"]
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                n += bool(c["text"])
                finish = c["finish_reason"] or finish
            if n and not started.is_set():
                started.set()
                if gate is not None:
                    await gate.wait()
    return worker, n, finish


async def test_cordon_takes_a_worker_out_of_routing_and_uncordon_brings_it_back_warm(server_factory) -> None:
    async with server_factory(**_sim()) as srv, aiohttp.ClientSession() as s:
        base = srv.base_url
        status, listing = await _call(s, "GET", base + ADMIN)
        assert status == 200
        assert [(w["id"], w["cordoned"], w["in_flight"], w["group"], w["engine"]) for w in listing["data"]] == [
            ("worker-0", False, 0, 0, "simulated"), ("worker-1", False, 0, 0, "simulated")]
        prompt = "a long shared system prompt about rivers and bridges. " * 20
        home = await _worker_of(s, base, prompt)
        other = "worker-1" if home == "worker-0" else "worker-0"

        # a stream in flight on the worker keeps running when it is cordoned
        started, gate = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(_stream(s, base, prompt + " go on", 40, started, gate))
        await asyncio.wait_for(started.wait(), 10)
        status, body = await _call(s, "POST", f"{base}{ADMIN}/{home}/cordon")
        assert (status, body) == (200, {"id": home, "cordoned": True, "in_flight": 1})
        assert {await _worker_of(s, base, prompt + f" q{i}") for i in range(6)} == {other}  # its cache no matter
        health = await (await s.get(base + "/health")).json()
        assert health["healthy_workers"] == 1
        assert {w["id"]: w["cordoned"] for w in health["workers"]} == {home: True, other: False}
        metrics = await (await s.get(base + "/metrics")).text()
        assert f'thunderagent_worker_cordoned{{worker="{home}"}} 1.0' in metrics
        gate.set()
        assert await asyncio.wait_for(task, 20) == (home, 40, "length")  # finished where it ran

        status, body = await _call(s, "POST", f"{base}{ADMIN}/{home}/uncordon")
        assert (status, body) == (200, {"id": home, "cordoned": False, "in_flight": 0})
        assert await _worker_of(s, base, prompt + " again") == home  # back, with its cache
        assert f'thunderagent_worker_cordoned{{worker="{home}"}} 0.0' in await (await s.get(base + "/metrics")).text()
        # idempotent, and an unknown worker is a 404
        assert (await _call(s, "POST", f"{base}{ADMIN}/{home}/uncordon"))[0] == 200
        status, body = await _call(s, "POST", f"{base}{ADMIN}/worker-9/cordon")
        assert status == 404 and body["error"]["code"] == "worker_not_found" and body["error"]["param"] == "worker_id"

        # every worker cordoned: nothing to route to (503, as with no healthy worker), /health 503
        for w in ("worker-0", "worker-1"):
            assert (await _call(s, "POST", f"{base}{ADMIN}/{w}/cordon"))[0] == 200
        async with s.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 503
        assert (await s.get(base + "/health")).status == 503


async def test_a_worker_added_at_runtime_serves_and_a_removal_drains_or_moves_its_streams(server_factory) -> None:
    async with server_factory(**_sim()) as srv, aiohttp.ClientSession() as s:
        base = srv.base_url
        status, body = await _call(s, "POST", base + ADMIN, {})
        assert (status, body) == (201, {"id": "worker-2", "added": True})
        status, body = await _call(s, "POST", base + ADMIN, {"id": "spare-1"})
        assert (status, body) == (201, {"id": "spare-1", "added": True})
        assert len(srv.fleet.routable()) == 4
        for w in ("worker-0", "worker-1", "spare-1"):
            await _call(s, "POST", f"{base}{ADMIN}/{w}/cordon")
        assert await _worker_of(s, base, "to the new one") == "worker-2"

        # a drain that runs out of time leaves the worker cordoned, in the fleet, its stream running
        started, gate = asyncio.Event(), asyncio.Event()
        slow = asyncio.create_task(_stream(s, base, "a long answer please", LONG, started, gate))
        await asyncio.wait_for(started.wait(), 10)
        status, body = await _call(s, "POST", f"{base}{ADMIN}/worker-2/remove", {"timeout_s": 0.2})
        assert status == 409 and body["error"]["code"] == "worker_busy"
        assert "worker-2" in srv.fleet.workers and "worker-2" in srv.fleet.cordoned
        # a drain that waits long enough: removed once the stream ended there
        removal = asyncio.create_task(_call(s, "POST", f"{base}{ADMIN}/worker-2/remove", {"timeout_s": 20}))
        await asyncio.sleep(0.3)
        assert not removal.done()
        gate.set()
        assert await asyncio.wait_for(slow, 20) == ("worker-2", LONG, "length")
        assert await asyncio.wait_for(removal, 20) == (200, {"id": "worker-2", "removed": True, "requests_moved": 0,
                                                              "prefixes_handed_off": 0})
        assert "worker-2" not in srv.fleet.workers and srv.fleet.index.num_blocks("worker-2") == 0
        status, body = await _call(s, "POST", f"{base}{ADMIN}/worker-2/remove")
        assert status == 404

        # force: the stream is cut there and continues on another worker, every token once
        await _call(s, "POST", f"{base}{ADMIN}/worker-0/uncordon")
        _, *unbroken = await _stream(s, base, "a stream that moves", LONG, asyncio.Event())
        started, gate = asyncio.Event(), asyncio.Event()
        moving = asyncio.create_task(_stream(s, base, "a stream that moves", LONG, started, gate))
        await asyncio.wait_for(started.wait(), 10)
        assert srv.fleet.generations_on(srv.fleet.workers["worker-0"])
        await _call(s, "POST", f"{base}{ADMIN}/worker-1/uncordon")  # somewhere for it to go
        status, body = await _call(s, "POST", f"{base}{ADMIN}/worker-0/remove", {"force": True})
        assert (status, body) == (200, {"id": "worker-0", "removed": True, "requests_moved": 1,
                                        "prefixes_handed_off": 0})
        gate.set()
        assert await asyncio.wait_for(moving, 20) == ("worker-0", *unbroken)  # as if never moved
        assert srv.fleet.metrics.registry.get_sample_value("thunderagent_migrations_total", {"cause": "removed"}) == 1
        assert sorted(srv.fleet.workers) == ["spare-1", "worker-1"]
        # a new worker gets an id no worker had
        assert (await _call(s, "POST", base + ADMIN, {}))[1]["id"] == "worker-3"


async def test_bad_requests_name_the_field(server_factory) -> None:
    async with server_factory(**_sim()) as srv, aiohttp.ClientSession() as s:
        base = srv.base_url
        for body, param in (({"url": "http://127.0.0.1:1"}, "url"), ({"group": 3}, "group"),
                            ({"id": "bad id!"}, "id"), ({"kv_events": "tcp://127.0.0.1:5"}, "url"),
                            ({"colour": 1}, "colour")):
            status, err = await _call(s, "POST", base + ADMIN, body)
            assert status == 400 and err["error"]["param"] == param, (body, err)
        status, err = await _call(s, "POST", base + ADMIN, {"id": "worker-1"})
        assert status == 409 and err["error"]["code"] == "worker_exists"
        status, err = await _call(s, "POST", f"{base}{ADMIN}/worker-1/remove", {"timeout_s": -1})
        assert status == 400 and err["error"]["param"] == "timeout_s"
        assert sorted(srv.fleet.workers) == ["worker-0", "worker-1"] and not srv.fleet.cordoned


async def test_the_switch_and_the_keys(server_factory) -> None:
    async with server_factory(execution_group={"nodes": [{"count": 1}]}) as srv, aiohttp.ClientSession() as s:
        status, err = await _call(s, "POST", f"{srv.base_url}{ADMIN}/worker-0/cordon")
        assert status == 403 and err["error"]["code"] == "admin_api_disabled"
        assert not srv.fleet.cordoned
    keys = {"api_keys": {TENANT_KEY: "acme"}, "admin_keys": [ADMIN_KEY]}
    async with server_factory(**_sim(**keys)) as srv, aiohttp.ClientSession() as s:
        url = f"{srv.base_url}{ADMIN}/worker-0/cordon"
        assert (await _call(s, "POST", url))[0] == 401
        status, err = await _call(s, "POST", url, key=TENANT_KEY)
        assert status == 403 and err["error"]["code"] == "admin_key_required"
        assert not srv.fleet.cordoned
        assert (await _call(s, "POST", url, key=ADMIN_KEY))[0] == 200 and srv.fleet.cordoned == {"worker-0"}


async def test_a_server_added_to_an_openai_fleet_takes_requests_until_removed() -> None:
    a, b = OpenAIBackend("a"), OpenAIBackend("b")
    await a.start()
    await b.start()
    cfg = parse_config({
        "model_name": OPENAI_MODEL, "control_plane": {"heartbeat_interval": 0.1, "heartbeat_misses": 5,
                                                      "admin_api": True},
        "execution_group": {"nodes": [{"engine": "openai", "block_size": 16, "endpoints": [{"url": a.url}]}]},
    }, "test")
    try:
        async with running_server(cfg) as srv, aiohttp.ClientSession() as s:
            base = srv.base_url
            status, err = await _call(s, "POST", base + ADMIN, {"url": b.url, "api_key_env": "TA_TEST_UNSET_KEY"})
            assert status == 400 and err["error"]["param"] == "api_key_env" and "TA_TEST_UNSET_KEY" in \
                err["error"]["message"]
            status, body = await _call(s, "POST", base + ADMIN, {"url": b.url})
            assert (status, body) == (201, {"id": "worker-1", "added": True})
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "the added server heartbeats")
            listing = (await _call(s, "GET", base + ADMIN))[1]["data"]
            assert [(w["id"], w["url"], w["engine"]) for w in listing] == [
                ("worker-0", a.url, "openai"), ("worker-1", b.url, "openai")]
            await _call(s, "POST", f"{base}{ADMIN}/worker-0/cordon")
            chat = {"model": OPENAI_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with s.post(base + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200 and r.headers["x-thunderagent-worker"] == "worker-1"
            assert len(b.bodies) == 1 and not a.bodies
            await _call(s, "POST", f"{base}{ADMIN}/worker-0/uncordon")
            assert (await _call(s, "POST", f"{base}{ADMIN}/worker-1/remove"))[0] == 200
            for _ in range(4):
                async with s.post(base + "/v1/chat/completions", json=chat) as r:
                    assert r.status == 200 and r.headers["x-thunderagent-worker"] == "worker-0"
            assert len(b.bodies) == 1  # nothing more reached the removed server
    finally:
        await a.stop()
        await b.stop()


async def test_a_prefill_worker_added_at_runtime_takes_over_the_prefills(server_factory) -> None:
    """Prefill/decode disaggregation (mode always): a prefill worker added to the prefill group serves the prefills
    once the first one is cordoned, its KV moving to the decode workers; the first is then removed."""
    plane = {"enabled": True, "max_inflight": 4, "sim_block_bytes": 16 << 10}
    nodes = {"nodes": [{"role": "prefill", "count": 1, "kv_cache_transfer": plane}, {"role": "decode", "count": 2}]}
    async with server_factory(execution_group=nodes, routing={"seed": 7, "disaggregation": {"mode": "always"}},
                              scheduler={"enabled": False}, control_plane={"admin_api": True}) as srv, \
            aiohttp.ClientSession() as s:
        base = srv.base_url
        assert (await _call(s, "POST", base + ADMIN, {}))[0] == 400  # two groups: name one
        assert await _call(s, "POST", base + ADMIN, {"group": 0}) == (201, {"id": "worker-3", "added": True})
        await _call(s, "POST", f"{base}{ADMIN}/worker-0/remove")
        for i in range(3):
            r = await srv.client.completions.create(model=MODEL, prompt=f"prompt {i} " + "a long prompt " * 60,
                                                    max_tokens=4, extra_body={"explain": True})
            pd = r.model_extra["thunderagent"]["pd"]
            assert pd["prefill_worker"] == "worker-3" and pd["transfer_tokens"] > 0
            assert r.model_extra["thunderagent"]["worker"] in ("worker-1", "worker-2")
        assert srv.fleet.metrics.pd_ok._value.get() == 3  # type: ignore[attr-defined]


async def _cached(s: aiohttp.ClientSession, base: str, prompt: str) -> int:
    """A tenant's completion: the prompt tokens its worker found cached (a tenant is not told which worker)."""
    async with s.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                      headers={"Authorization": f"Bearer {TENANT_KEY}"}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_prefix_cache_reset_empties_the_workers_and_the_index(server_factory) -> None:
    """``/v1/admin/reset_prefix_cache`` (all or some workers), ``.../workers/{id}/reset_prefix_cache`` and vLLM's
    ``/reset_prefix_cache``: the engines forget their cache, the index its entries; refusals name the field."""
    async with server_factory(**_sim(api_keys={TENANT_KEY: "acme"}, admin_keys=[ADMIN_KEY])) as srv, \
            aiohttp.ClientSession() as s:
        base = srv.base_url
        prompt = "a long shared system prompt about rivers and bridges. " * 20
        index = srv.fleet.index

        def holder() -> str:
            (wid,) = [w for w in ("worker-0", "worker-1") if index.num_blocks(w) > 0]
            return wid

        await _cached(s, base, prompt)
        home = holder()
        assert await _cached(s, base, prompt + " again") > 0  # its cache, found
        status, body = await _call(s, "POST", base + "/v1/admin/reset_prefix_cache", key=ADMIN_KEY)
        assert (status, body) == (200, {"success": True, "workers": [{"id": "worker-0", "success": True},
                                                                      {"id": "worker-1", "success": True}]})
        assert index.num_blocks("worker-0") == index.num_blocks("worker-1") == 0
        assert await _cached(s, base, prompt + " again") == 0  # the engine's cache is gone too
        calls = srv.fleet.metrics.registry.get_sample_value
        assert calls("thunderagent_server_calls_total", {"call": "reset_prefix_cache", "result": "done"}) == 2
        # one worker (its own path, or named in the fleet's), with vLLM's parameters
        await _cached(s, base, prompt)
        home = holder()
        status, body = await _call(s, "POST", f"{base}{ADMIN}/{home}/reset_prefix_cache", {}, key=ADMIN_KEY)
        assert (status, body) == (200, {"success": True, "workers": [{"id": home, "success": True}]})
        assert index.num_blocks(home) == 0
        status, body = await _call(s, "POST", base + "/v1/admin/reset_prefix_cache",
                                   {"workers": [home], "reset_running_requests": True}, key=ADMIN_KEY)
        assert status == 200 and body["success"] is False and body["workers"][0]["id"] == home
        assert "does not preempt its running requests" in body["workers"][0]["error"]
        # vLLM's own path: the fleet's reset, its query parameters checked
        await _cached(s, base, prompt)
        home = holder()
        async with s.post(base + "/reset_prefix_cache?reset_external=true",
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 200 and (await r.json())["success"] is True
        assert index.num_blocks(home) == 0
        for query, param in (("reset_running_requests=maybe", "reset_running_requests"), ("all=1", "all")):
            async with s.post(f"{base}/reset_prefix_cache?{query}",
                              headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == param
        # refusals: an unknown worker, an unknown field, a list on the one-worker path, no admin key
        for url, payload, code, param in (
                (base + "/v1/admin/reset_prefix_cache", {"workers": ["worker-0", "nope"]}, 404, "workers"),
                (f"{base}{ADMIN}/nope/reset_prefix_cache", None, 404, "worker_id"),
                (base + "/v1/admin/reset_prefix_cache", {"reset": True}, 400, None),
                (f"{base}{ADMIN}/worker-0/reset_prefix_cache", {"workers": ["worker-1"]}, 400, "workers")):
            status, body = await _call(s, "POST", url, payload, key=ADMIN_KEY)
            assert status == code and (param is None or body["error"]["param"] == param), (url, body)
        assert (await _call(s, "POST", base + "/v1/admin/reset_prefix_cache"))[0] == 401
        async with s.post(base + "/reset_prefix_cache") as r:
            assert r.status == 401


async def test_a_prefix_cache_reset_needs_the_admin_api(server_factory) -> None:
    async with server_factory(execution_group={"nodes": [{"count": 1}]}) as srv, aiohttp.ClientSession() as s:
        for path in ("/v1/admin/reset_prefix_cache", "/reset_prefix_cache", f"{ADMIN}/worker-0/reset_prefix_cache"):
            status, body = await _call(s, "POST", srv.base_url + path)
            assert status == 403 and body["error"]["code"] == "admin_api_disabled", path
