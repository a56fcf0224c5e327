"""OpenAI's Responses API (``/v1/responses``, what Codex and the Agents SDK speak) in front of a vLLM fleet:
relayed to the servers' own ``/v1/responses``, routed on ThunderAgent's rendering of the input (instructions,
messages, function calls and their outputs, tools), a continued response (``previous_response_id``) sent to
the server that stored it.

Real sockets on 127.0.0.1: two fake vLLM servers (``support.fake_engine``) that render a Responses body with the
tiny model's template, cache its blocks and publish them as KV events; ThunderAgent's real HTTP server; the
official ``openai`` client. (The rendering itself is checked against a real vLLM server in
``test_real_vllm_relay.py``.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from integration.conftest import test_config as make_config
from support.fake_engine import FakeEngine, fake_vllm_config
from support.server import relayed_counts, running_server
from support.waiting import wait_until
from thunderagent.frontend.hf_tokenizer import HfTokenizer
from thunderagent.frontend.responses import to_chat
from thunderagent.frontend.tenant_gate import GATE_KEY

BS = 16
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file of the repository.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
INSTRUCTIONS = "You are a coding agent. Read the files you need, then answer briefly. " * 4


def _config(engines: list[FakeEngine], model_dir: Path):
    return fake_vllm_config(engines, model_dir, BS)


async def _engines(model_dir: Path) -> list[FakeEngine]:
    tok = HfTokenizer(model_dir)
    engines = [FakeEngine(block_size=BS,
                          render_responses=lambda body: tok.apply_openai_chat(to_chat(body), keep_call_order=True))
               for _ in range(2)]
    for e in engines:
        await e.start()
    return engines


def _input(task: str, calls: int) -> list[dict]:
    """A Codex-like input after ``calls`` tool round trips (function_call, then its output), stateless."""
    items: list[dict] = [{"role": "user", "content": [{"type": "input_text", "text": f"Fix the bug in {task}."}]}]
    for k in range(calls):
        items.append({"type": "function_call", "call_id": f"call_{task}_{k}", "name": "read_file",
                      "arguments": json.dumps({"path": f"src/{task}/{k}.py"})})
        items.append({"type": "function_call_output", "call_id": f"call_{task}_{k}",
                      "output": f"def f{k}(x):\n    return x + {k}\n" * 3})
    return items


async def test_codex_like_agents_are_relayed_and_follow_their_cache(tiny_model_dir: Path) -> None:
    engines = await _engines(tiny_model_dir)
    try:
        async with running_server(_config(engines, tiny_model_dir)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            for e in engines:
                await e.wait_subscribed()
            c, model = srv.client, srv.fleet.model_name
            first: dict[str, str] = {}
            for task in ("parser", "router", "cache", "index"):
                raw = await c.responses.with_raw_response.create(
                    model=model, instructions=INSTRUCTIONS, input=_input(task, 0), tools=TOOLS, max_output_tokens=8,
                    store=False, extra_headers={"x-thunderagent-program-id": f"agent-{task}"})
                r = raw.parse()
                assert r.output[0].type == "function_call" and r.output[0].name == "read_file"  # the server's answer
                first[task] = raw.headers["x-thunderagent-worker"]
            sent = next(e for e in engines if e.responses).responses[0]
            assert sent["model"] == "fake-model" and sent["tools"] == TOOLS and sent["max_output_tokens"] == 8
            assert not any(e.requests or e.chats for e in engines)  # nothing went another way
            for calls in (1, 2):  # each agent's next steps go where its prefix is cached, block for block
                for task, worker in first.items():
                    raw = await c.responses.with_raw_response.create(
                        model=model, instructions=INSTRUCTIONS, input=_input(task, calls), tools=TOOLS,
                        max_output_tokens=8, store=False,
                        extra_headers={"x-thunderagent-program-id": f"agent-{task}", "x-thunderagent-explain": "1"})
                    cached = raw.parse().usage.input_tokens_details.cached_tokens
                    why = json.loads(raw.headers["x-thunderagent-explanation"])
                    assert raw.headers["x-thunderagent-worker"] == worker, (task, calls)
                    assert why["overlap_blocks"] * BS == cached > len(INSTRUCTIONS) // 2, (task, calls, why, cached)
            stream = await c.responses.create(model=model, input="hello", stream=True)
            events = [ev async for ev in stream]
            assert [ev.type for ev in events] == ["response.created", "response.output_text.delta",
                                                  "response.completed"]
            assert events[-1].response.output[0].content[0].text == "ok"
            assert relayed_counts(srv.fleet) == {"responses_api": 13.0}
            assert srv.fleet.programs.get("agent-parser").steps == 3  # type: ignore[union-attr]
    finally:
        for e in engines:
            await e.stop()


async def test_a_continued_response_goes_to_the_server_that_stored_it(tiny_model_dir: Path) -> None:
    engines = await _engines(tiny_model_dir)
    try:
        async with running_server(_config(engines, tiny_model_dir)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            c, model = srv.client, srv.fleet.model_name
            for k in range(4):  # four conversations, each continued three times by id alone
                r = await c.responses.create(model=model, input=f"conversation {k}: hello")
                owner = next(i for i, e in enumerate(engines) if r.id in e._answered)
                for turn in range(3):
                    r = await c.responses.create(model=model, input=f"turn {turn}", previous_response_id=r.id)
                    assert r.id in engines[owner]._answered, (k, turn)  # never the other server (it would 404)
            # one this frontend never saw goes anywhere: the server says what it thinks of it
            with pytest.raises(openai.NotFoundError) as missing:
                await c.responses.create(model=model, input="x", previous_response_id="resp_unknown")
            assert "resp_unknown" in missing.value.body["message"]
            # a background response is relayed (the server answers it queued), and read on the server storing it
            made = await c.responses.with_raw_response.create(model=model, input="in the background", background=True)
            r, wid = made.parse(), made.headers["x-thunderagent-worker"]
            owner = next(i for i, e in enumerate(engines) if r.id in e._answered)
            assert (await c.responses.retrieve(r.id)).id == r.id and r.id in engines[owner]._answered
            # its server paused (noticed from its /is_paused while the other is not yet: a CI run saw it): new work
            # goes to the other, but a read, a cancel or a continuation of what only it stores still goes to it
            srv.fleet.paused.add(wid)
            try:
                got = await c.responses.with_raw_response.retrieve(r.id)
                assert got.headers["x-thunderagent-worker"] == wid and got.parse().id == r.id
                nxt = await c.responses.with_raw_response.create(model=model, input="go on", previous_response_id=r.id)
                assert nxt.headers["x-thunderagent-worker"] == wid
                fresh = await c.responses.with_raw_response.create(model=model, input="a new conversation")
                assert fresh.headers["x-thunderagent-worker"] != wid  # (the paused server last, as before)
            finally:
                srv.fleet.paused.discard(wid)
            with pytest.raises(openai.BadRequestError) as bad:
                await c.responses.create(model=model, input="x", extra_body={"max_token": 3})
            assert bad.value.body["param"] == "max_token"
    finally:
        for e in engines:
            await e.stop()


async def test_a_simulated_fleet_says_it_has_no_server_to_relay_to() -> None:
    async with running_server(make_config()) as srv:
        with pytest.raises(openai.NotFoundError) as missing:
            await srv.client.responses.create(model=srv.fleet.model_name, input="hi")
        assert "has none to relay to" in missing.value.body["message"]


async def test_a_background_response_is_charged_its_whole_max_output_tokens(tiny_model_dir: Path) -> None:
    """Its completion is generated after the server's answer, out of ThunderAgent's sight: under a tenant's token
    limit it is charged its max_output_tokens in full (and must name one); an ordinary response pays what it used."""
    key = "acme-key-0123456789abcdef"
    engines = await _engines(tiny_model_dir)
    try:
        # a slow refill (1 token a second), so that the bucket's level shows each request's charge
        control = {"api_keys": {key: "acme"}, "tenant_limits": {"acme": {"tokens_per_min": 60, "token_burst": 100_000}}}
        async with running_server(fake_vllm_config(engines, tiny_model_dir, BS, control=control)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            c = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0)
            model = srv.fleet.model_name
            limiter = srv.app[GATE_KEY].limiter  # type: ignore[index]
            loop = asyncio.get_running_loop()
            with pytest.raises(openai.BadRequestError) as bad:
                await c.responses.create(model=model, input="x", background=True)
            assert bad.value.body["param"] == "max_output_tokens"
            drops = []
            for background in (False, True):
                before = limiter.tokens_left("acme", loop.time())
                r = await c.responses.create(model=model, input="the same question", max_output_tokens=50,
                                             background=background)
                assert r.usage is not None and r.usage.output_tokens == 1
                drops.append(before - limiter.tokens_left("acme", loop.time()))
            assert 48 <= drops[1] - drops[0] <= 50  # 50 charged against the 1 used (give or take a second's refill)
            await c.close()
    finally:
        for e in engines:
            await e.stop()
