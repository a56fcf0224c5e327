"""Anthropic's Messages API (``/v1/messages``, what Claude Code speaks) in front of a vLLM fleet: relayed to the
servers' own ``/v1/messages``, routed on ThunderAgent's rendering of the conversation (system prompt, tools,
tool calls and results), answered in Anthropic's shapes (messages, event streams, errors), with Anthropic's
``x-api-key``.

Real sockets on 127.0.0.1: two fake vLLM servers (``support.fake_engine``) that render a Messages body with the
tiny model's template, cache its blocks and publish them as KV events; ThunderAgent's real HTTP server; the
official ``anthropic`` client. (The rendering itself is checked against a real vLLM server in
``test_real_vllm_relay.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import anthropic
import pytest

from integration.conftest import test_config as make_config
from support.fake_engine import FakeEngine, fake_vllm_config
from support.server import relayed_counts, running_server
from support.waiting import wait_until
from thunderagent.frontend.anthropic import to_chat
from thunderagent.frontend.hf_tokenizer import HfTokenizer

BS = 16
TOOLS = [{"name": "read_file", "description": "Read a file of the repository and return its text.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=8d1e2;"},
          {"type": "text", "text": "You are a coding agent. Read the files you need, then answer briefly. " * 4}]
TENANT_KEY = "sk-tenant-a-0123456789abcdef"


def _config(engines: list[FakeEngine], model_dir: Path, **control: object):
    return fake_vllm_config(engines, model_dir, BS, control=control)


async def _engines(model_dir: Path) -> list[FakeEngine]:
    tok = HfTokenizer(model_dir)

    def render(body: dict) -> list[int]:
        return tok.apply_openai_chat(to_chat(body, system_first=tok.system_first, effort_off="none"))

    engines = [FakeEngine(block_size=BS, render_messages=render) for _ in range(2)]
    for e in engines:
        await e.start()
    return engines


def _history(task: str, calls: int) -> list[dict]:
    """A Claude Code-like conversation after ``calls`` tool round trips (tool_use, then a user tool_result)."""
    msgs: list[dict] = [{"role": "user", "content": [{"type": "text", "text": f"Fix the bug in {task}."}]}]
    for k in range(calls):
        use = {"type": "tool_use", "id": f"toolu_{task}_{k}", "name": "read_file",
               "input": {"path": f"src/{task}/{k}.py"}}
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": "Reading it."}, use]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use["id"], "content": f"def f{k}(x):\n    return x + {k}\n" * 3}]})
    return msgs


def _client(srv, key: str = "unused", **kw: object) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=srv.base_url, api_key=key, max_retries=0, timeout=30, **kw)


async def test_claude_code_like_agents_are_relayed_and_follow_their_cache(tiny_model_dir: Path) -> None:
    engines = await _engines(tiny_model_dir)
    try:
        async with running_server(_config(engines, tiny_model_dir)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            for e in engines:
                await e.wait_subscribed()
            model = srv.fleet.model_name
            first: dict[str, str] = {}
            async with _client(srv) as c:
                for task in ("parser", "router", "cache", "index"):
                    raw = await c.messages.with_raw_response.create(
                        model=model, max_tokens=8, system=SYSTEM, tools=TOOLS, messages=_history(task, 0),
                        extra_headers={"x-thunderagent-program-id": f"agent-{task}"})
                    m = await raw.parse()
                    assert m.stop_reason == "tool_use" and m.content[0].name == "read_file"  # the server's answer
                    first[task] = raw.headers["x-thunderagent-worker"]
                sent = next(e for e in engines if e.messages).messages[0]
                assert sent["model"] == "fake-model" and sent["tools"] == TOOLS and sent["system"] == SYSTEM
                assert not engines[0].requests and not engines[1].requests and not any(e.chats for e in engines)
                # each agent's next steps go where its prefix is cached, and the router knew block for block
                # what the server then reported cached (its cache_read_input_tokens)
                for calls in (1, 2):
                    for task, worker in first.items():
                        raw = await c.messages.with_raw_response.create(
                            model=model, max_tokens=8, system=SYSTEM, tools=TOOLS, messages=_history(task, calls),
                            extra_headers={"x-thunderagent-program-id": f"agent-{task}", "x-thunderagent-explain": "1"})
                        cached = (await raw.parse()).usage.cache_read_input_tokens
                        why = json.loads(raw.headers["x-thunderagent-explanation"])
                        assert raw.headers["x-thunderagent-worker"] == worker, (task, calls)
                        assert why["overlap_blocks"] * BS == cached > 100, (task, calls, why, cached)
                # streamed: Anthropic's events, unchanged, read by the official client
                async with c.messages.stream(model=model, max_tokens=8, system=SYSTEM,
                                             messages=[{"role": "user", "content": "hello"}]) as stream:
                    text = "".join([t async for t in stream.text_stream])
                    final = await stream.get_final_message()
                assert text == "ok" and final.stop_reason == "end_turn" and final.usage.output_tokens == 1
                # counted as the servers render it
                count = await c.messages.count_tokens(model=model, system=SYSTEM, tools=TOOLS,
                                                      messages=_history("parser", 2))
                render = engines[0].render_messages
                assert render is not None
                assert count.input_tokens == len(render({"system": SYSTEM, "tools": TOOLS,
                                                         "messages": _history("parser", 2)}))
            async with aiohttp.ClientSession() as s, s.get(srv.base_url + "/v1/programs") as resp:
                programs = {p["id"]: p for p in (await resp.json())["data"]}
            assert programs["agent-parser"]["steps"] == 3  # relayed steps count as the program's
            relayed = relayed_counts(srv.fleet)
            assert relayed == {"messages_api": 13.0}
    finally:
        for e in engines:
            await e.stop()


async def test_errors_take_anthropic_shape_and_x_api_key_authenticates(tiny_model_dir: Path) -> None:
    engines = await _engines(tiny_model_dir)
    try:
        cfg = _config(engines, tiny_model_dir, api_keys={TENANT_KEY: "acme"})
        async with running_server(cfg) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            model = srv.fleet.model_name
            hi = [{"role": "user", "content": "hi"}]
            async with _client(srv, TENANT_KEY) as c:
                m = await c.messages.create(model=model, max_tokens=4, messages=hi)  # x-api-key
                assert m.content[0].text == "ok"
                sent = next(e for e in engines if e.messages).messages[-1]
                assert sent["cache_salt"] == "tenant:acme"  # the tenant's salt, as on the other paths
                # a field no server acts on: 400 naming it, in Anthropic's shape
                with pytest.raises(anthropic.BadRequestError) as bad:
                    await c.messages.create(model=model, max_tokens=4, messages=hi, extra_body={"max_token": 5})
                assert bad.value.body["type"] == "error" and "`max_token`" in bad.value.body["error"]["message"]
                assert bad.value.body["error"]["type"] == "invalid_request_error"
                with pytest.raises(anthropic.BadRequestError) as bad:
                    await c.messages.create(model=model, max_tokens=4, messages=hi,
                                            extra_body={"kv_transfer_params": {"do_remote_decode": True}})
                assert "set by ThunderAgent" in bad.value.body["error"]["message"]
                with pytest.raises(anthropic.NotFoundError) as missing:
                    await c.messages.create(model="no-such-model", max_tokens=4, messages=hi)
                assert missing.value.body["error"]["type"] == "not_found_error"
                # the server's own refusal passes as it is
                with pytest.raises(anthropic.BadRequestError) as refused:
                    await c.messages.create(model=model, max_tokens=4, messages=hi, extra_body={"temperature": 1.5})
                assert refused.value.body["error"]["message"] == "temperature: must be at most 1"
            async with _client(srv, "sk-wrong-0123456789abcdef") as c:
                with pytest.raises(anthropic.AuthenticationError) as denied:
                    await c.messages.create(model=model, max_tokens=4, messages=hi)
                assert denied.value.body["error"]["type"] == "authentication_error"
            async with aiohttp.ClientSession() as s:  # required fields, read before anything is sent
                async with s.post(srv.base_url + "/v1/messages", headers={"x-api-key": TENANT_KEY},
                                  json={"model": model, "messages": hi}) as resp:
                    body = await resp.json()
                    assert resp.status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]
    finally:
        for e in engines:
            await e.stop()


async def test_a_simulated_fleet_says_it_has_no_server_to_relay_to() -> None:
    async with running_server(make_config()) as srv:
        async with _client(srv) as c:
            with pytest.raises(anthropic.NotFoundError) as missing:
                await c.messages.create(model=srv.fleet.model_name, max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}])
            assert "has none to relay to" in missing.value.body["error"]["message"]


async def test_claude_code_sessions_are_programs(tiny_model_dir: Path) -> None:
    engines = await _engines(tiny_model_dir)
    try:
        async with running_server(_config(engines, tiny_model_dir)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            model, hi = srv.fleet.model_name, [{"role": "user", "content": "hi"}]
            current = json.dumps({"device_id": "d" * 64, "account_uuid": "",
                                  "session_id": "6f1c2a9e-4b7d-4e1a-9c3b-2d5e8f0a1b2c"})
            legacy = "user_" + "a" * 64 + "_account__session_435395a4-cecb-4661-b9ec-c38edb6ec9c5"
            async with _client(srv) as c:
                for _ in range(2):
                    await c.messages.create(model=model, max_tokens=2, messages=hi, metadata={"user_id": current})
                # (the beta client, as Claude Code, posts to /v1/messages?beta=true)
                await c.beta.messages.create(model=model, max_tokens=2, messages=hi, metadata={"user_id": legacy},
                                             betas=["context-management-2025-06-27"])
                await c.messages.create(model=model, max_tokens=2, messages=hi,
                                        extra_headers={"x-claude-code-session-id": "cc-header-session"})
                await c.messages.create(model=model, max_tokens=2, messages=hi,  # ours wins over Claude Code's
                                        metadata={"user_id": legacy},
                                        extra_headers={"x-thunderagent-program-id": "mine"})
                await c.messages.create(model=model, max_tokens=2, messages=hi, metadata={"user_id": "user-42"})
                await c.messages.create(model=model, max_tokens=2, messages=hi,  # not an id: no program, no error
                                        extra_headers={"x-claude-code-session-id": "bad id/with space"})
            async with aiohttp.ClientSession() as s, s.get(srv.base_url + "/v1/programs") as resp:
                steps = {p["id"]: p["steps"] for p in (await resp.json())["data"]}
            assert steps == {"6f1c2a9e-4b7d-4e1a-9c3b-2d5e8f0a1b2c": 2, "435395a4-cecb-4661-b9ec-c38edb6ec9c5": 1,
                             "cc-header-session": 1, "mine": 1}
    finally:
        for e in engines:
            await e.stop()
