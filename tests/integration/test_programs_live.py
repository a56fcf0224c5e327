"""Agent programs on a live server: ids from our header, the body (top level or ``extra_body``) or
Dynamo's session header; states in ``GET /v1/programs``; release by URL or by the paper proxy's body."""

from __future__ import annotations

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
        assert listed["by_state"] == {"reasoning": 0, "acting": 4}

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
                assert r.status == 200 and (await r.json()) == {"id": "agent-1", "released": True}
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
