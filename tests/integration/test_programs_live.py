"""Agent programs on a live server: ids from our header, the body (top level or ``extra_body``) or
Dynamo's session header; states in ``GET /v1/programs``; release by URL or by the paper proxy's body."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from support.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"


def programs(srv) -> dict[str, dict]:
    return {p["id"]: p for p in srv.fleet.programs.snapshot(srv.fleet.now())}


async def test_program_ids_states_and_release(server_factory):
    async with server_factory() as srv:
        c = srv.client
        msgs = [{"role": "user", "content": "plan the next tool call " * 4}]
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, max_tokens=8, extra_headers={"x-thunderagent-program-id": "agent-1"})
        await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, extra_body={"program_id": "agent-2"})
        await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                        extra_headers={"x-dynamo-session-id": "dyn-3"})
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "nested", "max_tokens": 4, "extra_body": {"program_id": "agent-4"}}
            async with s.post(srv.base_url + "/v1/completions", json=body) as r:
                assert r.status == 200
            async with s.get(srv.base_url + "/v1/programs") as r:
                listed = await r.json()
        progs = {p["id"]: p for p in listed["data"]}
        assert set(progs) == {"agent-1", "agent-2", "dyn-3", "agent-4"}
        p1 = progs["agent-1"]
        assert (p1["state"], p1["steps"], p1["in_flight"]) == ("acting", 1, 0)
        assert p1["worker"] == raw.headers["x-thunderagent-worker"] and p1["context_tokens"] > 0
        assert listed["by_state"] == {"reasoning": 0, "acting": 4, "paused": 0}

        # a step in flight: reasoning
        stream = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, stream=True,
                                                 extra_headers={"x-thunderagent-program-id": "agent-1"})
        await anext(aiter(stream))
        assert programs(srv)["agent-1"]["state"] == "reasoning"
        async for _ in stream:
            pass
        await wait_until(lambda: programs(srv)["agent-1"]["state"] == "acting", 5, "back to acting")
        assert programs(srv)["agent-1"]["steps"] == 2

        async with aiohttp.ClientSession() as s:
            async with s.post(srv.base_url + "/v1/programs/agent-1/release") as r:
                assert r.status == 200 and (await r.json()) == {"id": "agent-1", "tenant": None, "released": True}
            async with s.post(srv.base_url + "/v1/programs/agent-1/release") as r:
                err = (await r.json())["error"]
                assert r.status == 404 and err["code"] == "program_not_found" and err["param"] == "program_id"
            async with s.post(srv.base_url + "/programs/release", json={"program_id": "agent-2"}) as r:
                assert r.status == 200
            async with s.post(srv.base_url + "/v1/chat/completions",
                              json={"model": MODEL, "messages": msgs, "program_id": "../../etc/passwd"}) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == "program_id"
        assert set(programs(srv)) == {"dyn-3", "agent-4"}


async def test_a_new_program_is_held_while_the_fleet_is_full_and_resumed_when_room_comes(server_factory):
    """One worker of 640 KV tokens: a second program of ~450 tokens cannot start next to the first
    (admission holds it: ``paused`` in ``GET /v1/programs``), and is resumed once the first is idle."""
    pacing = {"enabled": True, "tick_s": 0.05, "acting_half_life_s": 0.05, "work_conserving": False}
    async with server_factory(execution_group={"nodes": [{"kv_blocks": 40, "block_size": 16}]},
                              scheduler={"pacing": pacing}, simulation={"speedup": 1.0}) as srv:
        c = srv.client
        first = await c.completions.create(model=MODEL, prompt="a" * 450, max_tokens=60, stream=True,
                                           extra_headers={"x-thunderagent-program-id": "first"})
        await anext(aiter(first))
        await wait_until(lambda: srv.fleet.dispatcher.pacer.next_tick > 0, 5, "a pacing tick")
        second = asyncio.create_task(c.completions.create(
            model=MODEL, prompt="b" * 450, max_tokens=4, extra_headers={"x-thunderagent-program-id": "second"}))
        await wait_until(lambda: programs(srv).get("second", {}).get("state") == "paused", 5, "second held")
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.base_url + "/v1/programs") as r:
                listed = await r.json()
        assert listed["by_state"]["paused"] == 1 and listed["pacing"]["held_requests"] == 1
        assert any(e["program"] == "second" and e["action"] == "hold" for e in listed["pacing"]["recent"])
        assert not second.done()
        async for _ in first:
            pass
        done = await asyncio.wait_for(second, 10)
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.base_url + "/v1/programs") as r:
                listed = await r.json()
            async with s.get(srv.base_url + "/metrics") as r:
                metrics = await r.text()
        assert any(e["program"] == "second" and e["action"] == "resume" for e in listed["pacing"]["recent"])
        assert listed["pacing"]["resumes"] >= 1 and listed["by_state"]["paused"] == 0
        # the metric counts what the pacer did (the idle first program may have been paused and resumed too)
        assert f"thunderagent_program_resumes_total {float(listed['pacing']['resumes'])}" in metrics


async def test_past_max_programs_the_program_idle_longest_is_forgotten_and_counted(server_factory):
    """Program ids come from clients: the table stays within ``scheduler.max_programs``, a new program
    evicting the one idle longest, and ``/metrics`` counts the evictions."""
    async with server_factory(scheduler={"max_programs": 2}) as srv:
        c = srv.client
        for pid in ("one", "two", "three"):
            await c.completions.create(model=MODEL, prompt=f"step of {pid}", max_tokens=4,
                                       extra_headers={"x-thunderagent-program-id": pid})
        await c.completions.create(model=MODEL, prompt="two again", max_tokens=4,
                                   extra_headers={"x-thunderagent-program-id": "two"})
        await c.completions.create(model=MODEL, prompt="four", max_tokens=4,
                                   extra_headers={"x-thunderagent-program-id": "four"})  # evicts three, not two
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.base_url + "/v1/programs") as r:
                listed = await r.json()
            async with s.get(srv.base_url + "/metrics") as r:
                metrics = await r.text()
        assert {p["id"] for p in listed["data"]} == {"two", "four"}
        assert listed["by_state"] == {"reasoning": 0, "acting": 2, "paused": 0}
        assert 'thunderagent_programs_evicted_total{tenant=""} 2.0' in metrics  # keys off: no tenant
        assert 'thunderagent_programs{state="acting"} 2.0' in metrics


async def test_programs_are_listed_by_state_and_limit_and_one_by_id(server_factory):
    # engine time at the wall clock's pace: p4's 400 tokens take seconds, so it still reasons while every
    # query below runs, also on a loaded machine (at the suite's 20x they took ~0.2 s of wall time)
    async with server_factory(simulation={"speedup": 1.0}) as srv:
        c = srv.client
        for pid in ("p1", "p2", "p3"):
            await c.completions.create(model=MODEL, prompt=f"step of {pid}", max_tokens=2,
                                       extra_headers={"x-thunderagent-program-id": pid})
        stream = await c.completions.create(model=MODEL, prompt="long step", max_tokens=400, stream=True,
                                            extra_headers={"x-thunderagent-program-id": "p4"})
        await anext(aiter(stream))  # p4 reasons while we look
        async with aiohttp.ClientSession() as s:
            async def get(path: str) -> tuple[int, dict]:
                async with s.get(srv.base_url + path) as r:
                    return r.status, await r.json()

            status, body = await get("/v1/programs")
            assert status == 200 and (body["total"], body["truncated"]) == (4, False)
            assert [p["id"] for p in body["data"]] == ["p1", "p2", "p3", "p4"]  # oldest first
            status, body = await get("/v1/programs?state=acting&limit=2")
            assert [p["id"] for p in body["data"]] == ["p1", "p2"] and (body["total"], body["truncated"]) == (3, True)
            status, body = await get("/v1/programs?state=reasoning")
            assert [p["id"] for p in body["data"]] == ["p4"] and body["data"][0]["in_flight"] == 1
            status, body = await get("/v1/programs/p2")
            assert status == 200 and (body["id"], body["state"], body["steps"]) == ("p2", "acting", 1)
            for path, param in (("/v1/programs?state=done", "state"), ("/v1/programs?limit=0", "limit"),
                                ("/v1/programs?limit=x", "limit"), ("/v1/programs?limit=100001", "limit"),
                                ("/v1/programs/bad%20id", "program_id"),
                                ("/v1/programs?tenant=acme", "tenant")):  # keys off: programs have no tenant
                status, body = await get(path)
                assert status == 400 and body["error"]["param"] == param, (path, body)
            status, body = await get("/v1/programs/p9")
            assert status == 404 and body["error"]["code"] == "program_not_found"
        await stream.close()  # p4 is aborted: no need to wait for its 400 tokens
