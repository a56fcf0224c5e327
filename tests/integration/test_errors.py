"""Bad requests get clear OpenAI-shaped 4xx errors, and the server keeps serving after each."""

from __future__ import annotations

import json

import aiohttp
import pytest

from support.faults import crash_engine
from support.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


async def post(s: aiohttp.ClientSession, url: str, data: bytes | str) -> tuple[int, dict, dict]:
    async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


async def assert_still_serving(s: aiohttp.ClientSession, base: str) -> None:
    status, body, _ = await post(s, base + "/v1/chat/completions", json.dumps(GOOD))
    assert status == 200 and body["choices"][0]["message"]["content"]


BAD_CASES = [
    ("/v1/chat/completions", "{not json", 400, None, "not valid JSON"),
    ("/v1/chat/completions", json.dumps({**GOOD, "max_tokens": "ten"}), 400, "max_tokens", "Expected `int"),
    ("/v1/chat/completions", json.dumps({**GOOD, "max_tokens": -5}), 400, "max_tokens", ">= 1"),
    ("/v1/chat/completions", json.dumps({**GOOD, "messages": "hi"}), 400, "messages", "Expected `array`"),
    ("/v1/chat/completions", json.dumps({**GOOD, "messages": []}), 400, "messages", "length >= 1"),
    ("/v1/chat/completions", json.dumps({"model": MODEL}), 400, "messages", "missing required field"),
    ("/v1/chat/completions", json.dumps({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}), 400,
     "messages[0].role", "Invalid enum value"),
    ("/v1/chat/completions", json.dumps({**GOOD, "temperature": 9}), 400, "temperature", "<= 2.0"),
    ("/v1/chat/completions", json.dumps({**GOOD, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop", "at most 4"),
    ("/v1/chat/completions", json.dumps({**GOOD, "n": 3}), 400, "n", None),
    ("/v1/chat/completions", json.dumps({**GOOD, "model": "gpt-9"}), 404, "model", "does not exist"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, -2]}), 400, "prompt", "non-negative"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["a", "b"]}), 400, "prompt", "one prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}), 400, "max_tokens", ">= 1"),
    ("/v1/nope", "{}", 404, None, None),
]


async def test_bad_requests_get_clear_errors_and_server_keeps_serving(server_factory):
    async with server_factory(control_plane={"max_body_bytes": 64 * 1024}) as srv:
        async with aiohttp.ClientSession() as s:
            for path, body, status, param, text in BAD_CASES:
                got, err, _ = await post(s, srv.base_url + path, body)
                assert got == status, (path, body, got, err)
                assert set(err["error"]) == {"message", "type", "param", "code"}, err
                assert err["error"]["param"] == param, (body, err)
                if text:
                    assert text in err["error"]["message"], err
                await assert_still_serving(s, srv.base_url)
            huge = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * 100_000}]})
            got, err, _ = await post(s, srv.base_url + "/v1/chat/completions", huge)
            assert got == 413 and "too large" in err["error"]["message"]
            await assert_still_serving(s, srv.base_url)
            async with s.get(srv.base_url + "/metrics") as r:
                metrics = await r.text()
            assert 'status="400"' in metrics and 'status="404"' in metrics and 'status="413"' in metrics


async def test_client_disconnect_mid_stream_releases_the_request(server_factory):
    async with server_factory(simulation={"speedup": 1.0}) as srv:
        async with aiohttp.ClientSession() as s:
            payload = {**GOOD, "max_tokens": 500, "stream": True,
                       "messages": [{"role": "user", "content": "long story " * 50}]}
            async with s.post(srv.base_url + "/v1/chat/completions", json=payload) as r:
                assert r.status == 200
                await r.content.readline()  # first event, then hang up
                wid = r.headers["x-thunderagent-worker"]
            load = await wait_until(lambda: (lo := srv.fleet.registry.loads()[wid]).running == 0 and lo, 5,
                                    "the worker released the request")
            assert load.running == 0 and load.waiting == 0
            await assert_still_serving(s, srv.base_url)


async def test_no_healthy_worker_gives_503_then_recovers(server_factory):
    async with server_factory() as srv:
        async with aiohttp.ClientSession() as s:
            for w in srv.fleet.workers.values():
                w.heartbeats_paused = True  # type: ignore[attr-defined]  (LocalWorker's fault injection)
            await wait_until(lambda: not srv.fleet.registry.routable(), 5, "every worker out of routing")
            got, err, headers = await post(s, srv.base_url + "/v1/chat/completions", json.dumps(GOOD))
            assert got == 503 and err["error"]["code"] == "no_healthy_worker"
            assert int(headers["Retry-After"]) >= 1
            async with s.get(srv.base_url + "/health") as r:
                assert r.status == 503
            for w in srv.fleet.workers.values():
                w.heartbeats_paused = False  # type: ignore[attr-defined]
            await wait_until(lambda: len(srv.fleet.registry.routable()) == 4, 5, "every worker back")
            await assert_still_serving(s, srv.base_url)


async def test_unhealthy_worker_leaves_routing_and_index_then_returns(server_factory):
    async with server_factory() as srv:
        prompt = [{"role": "user", "content": "sticky prefix " * 40}]
        raw = await srv.client.chat.completions.with_raw_response.create(model=MODEL, messages=prompt, max_tokens=4)
        home = raw.headers["x-thunderagent-worker"]
        assert srv.fleet.index.num_blocks(home) > 0
        srv.fleet.workers[home].heartbeats_paused = True  # type: ignore[attr-defined]
        await wait_until(lambda: home not in {w.worker_id for w in srv.fleet.registry.routable()}, 5,
                         f"{home} out of routing")
        assert srv.fleet.index.num_blocks(home) == 0  # purged
        for _ in range(8):
            raw = await srv.client.chat.completions.with_raw_response.create(
                model=MODEL, messages=prompt, max_tokens=4)
            assert raw.headers["x-thunderagent-worker"] != home
        srv.fleet.workers[home].heartbeats_paused = False  # type: ignore[attr-defined]
        await wait_until(lambda: home in {w.worker_id for w in srv.fleet.registry.routable()}, 5, f"{home} back")
        assert srv.fleet.index.num_blocks(home) > 0  # resynced from the worker's cache


async def test_prompt_longer_than_any_worker_can_hold_is_a_clear_400(server_factory):
    nodes = {"nodes": [{"count": 2, "kv_blocks": 8, "block_size": 16}]}  # 128 tokens per worker
    async with server_factory(execution_group=nodes) as srv:
        async with aiohttp.ClientSession() as s:
            body = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * 200}]})
            got, err, _ = await post(s, srv.base_url + "/v1/chat/completions", body)
            assert got == 400 and err["error"]["param"] == "messages"
            assert err["error"]["code"] == "context_length_exceeded"
            body = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * 50}], "max_tokens": 100})
            got, err, _ = await post(s, srv.base_url + "/v1/chat/completions", body)
            assert got == 400 and err["error"]["param"] == "max_tokens"
            await assert_still_serving(s, srv.base_url)


async def test_a_mixed_fleet_serves_a_long_prompt_on_the_worker_that_holds_it(server_factory):
    """worker-0 holds 128 tokens, worker-1 1,024: a 200-token prompt is served by worker-1 every time
    (before, kv_aware could pick worker-0, whose engine ended it unserved), short ones go anywhere."""
    nodes = {"nodes": [{"count": 1, "kv_blocks": 8, "block_size": 16}, {"count": 1, "kv_blocks": 64, "block_size": 16}]}
    async with server_factory(execution_group=nodes) as srv, aiohttp.ClientSession() as s:
        homes = set()
        for i in range(6):
            body = json.dumps({**GOOD, "messages": [{"role": "user", "content": f"{i} " + "x" * 200}], "max_tokens": 16})
            got, answer, headers = await post(s, srv.base_url + "/v1/chat/completions", body)
            assert got == 200 and answer["choices"][0]["finish_reason"] == "length", answer
            assert answer["usage"]["completion_tokens"] == 16
            homes.add(headers["x-thunderagent-worker"])
        assert homes == {"worker-1"}
        for i in range(8):  # short requests: both workers serve
            body = json.dumps({**GOOD, "messages": [{"role": "user", "content": f"short {i}"}], "max_tokens": 4})
            got, answer, headers = await post(s, srv.base_url + "/v1/chat/completions", body)
            assert got == 200 and answer["usage"]["completion_tokens"] == 4
            homes.add(headers["x-thunderagent-worker"])
        assert homes == {"worker-0", "worker-1"}


async def test_prompt_longer_than_a_pass_without_chunked_prefill_is_a_clear_400(server_factory):
    """Without chunked prefill a prompt must fit one pass: a longer one would end unserved (``abort``
    after a 200), so it is refused up front, naming the setting; one that fits is served."""
    nodes = {"nodes": [{"count": 2, "kv_blocks": 64, "block_size": 16, "max_num_batched_tokens": 64,
                        "enable_chunked_prefill": False}]}
    async with server_factory(execution_group=nodes) as srv, aiohttp.ClientSession() as s:
        body = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * 100}]})
        got, err, _ = await post(s, srv.base_url + "/v1/chat/completions", body)
        assert got == 400 and err["error"]["param"] == "messages"
        assert err["error"]["code"] == "context_length_exceeded"
        assert "64 tokens" in err["error"]["message"] and "max_num_batched_tokens" in err["error"]["message"]
        body = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * 20}], "max_tokens": 100})
        got, answer, _ = await post(s, srv.base_url + "/v1/chat/completions", body)
        assert got == 200 and answer["choices"][0]["finish_reason"] == "length", answer
        assert answer["usage"]["completion_tokens"] == 100  # decode is not bound by a pass


async def test_failed_engine_ends_requests_with_an_error_and_leaves_routing(server_factory):
    async with server_factory(execution_group={"nodes": [{"count": 2}]}) as srv:
        victim = srv.fleet.workers["worker-0"]
        crash_engine(victim, "simulated engine bug")
        async with aiohttp.ClientSession() as s:
            statuses = []
            for i in range(6):
                body = json.dumps({**GOOD, "messages": [{"role": "user", "content": f"request {i} " * 20}]})
                got, err, headers = await post(s, srv.base_url + "/v1/chat/completions", body)
                statuses.append(got)
                if got != 200:
                    assert got == 502 and err["error"]["code"] == "worker_failed"
            # The failure produced no output before it broke, so nothing was lost: the request it held
            # and every later one were routed to the other worker.
            assert victim.failed and statuses == [200] * 6, statuses
            assert srv.fleet.unavailable == {"worker-0": "engine_failed"}
            assert srv.fleet.metrics.rerouted._value.get() >= 1  # type: ignore[attr-defined]
            await wait_until(lambda: [w.worker_id for w in srv.fleet.registry.routable()] == ["worker-1"], 5,
                             "the failed worker's lease expires")
            assert [w.worker_id for w in srv.fleet.registry.routable()] == ["worker-1"]
            for _ in range(4):
                await assert_still_serving(s, srv.base_url)
