"""A vLLM fleet relays what ThunderAgent does not model (``relay: unmodelled``, the default): tools, a tool-call
history, logprobs, the engine's own fields go to the server's chat endpoint with the client's body, routed on
ThunderAgent's rendering of the prompt (tools included), while plain requests stay on the token path.

Real sockets on 127.0.0.1: two fake vLLM servers (``support.fake_engine``) that render a chat body with
the tiny model's template (as vLLM would), cache its blocks and publish them as KV events; ThunderAgent's
real HTTP server with the official ``openai`` client."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest

from support.fake_engine import FakeEngine, fake_vllm_config
from support.server import relayed_counts, running_server
from support.waiting import wait_until
from thunderagent.frontend.hf_tokenizer import HfTokenizer

BS = 16
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository and return its text.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
SYSTEM = "You are a coding agent. Read the files you need, then answer in one short paragraph. " * 4


def _config(engines: list[FakeEngine], model_dir: Path, **node: object):
    return fake_vllm_config(engines, model_dir, BS, **node)


async def _engines(model_dir: Path, max_model_len: int | None = None) -> list[FakeEngine]:
    tok = HfTokenizer(model_dir)
    engines = [FakeEngine(block_size=BS, render=tok.apply_openai_chat, max_model_len=max_model_len) for _ in range(2)]
    for e in engines:
        await e.start()
    return engines


def _history(task: str, calls: int) -> list[dict]:
    """An agent's conversation after ``calls`` tool round trips (the assistant's tool call, the tool's answer)."""
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Fix the bug in {task}."}]
    for k in range(calls):
        call = {"id": f"{task}-{k}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/{task}/{k}.py"})}}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": f"def f{k}(x):\n    return x + {k}\n" * 3})
    return msgs


async def test_tool_calling_agents_are_relayed_and_follow_their_cache(tiny_model_dir: Path) -> None:
    engines = await _engines(tiny_model_dir)
    try:
        async with running_server(_config(engines, tiny_model_dir)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            for e in engines:
                await e.wait_subscribed()
            c = srv.client
            model = srv.fleet.model_name
            first: dict[str, str] = {}
            for task in ("parser", "router", "cache", "index"):  # each agent's first step
                raw = await c.chat.completions.with_raw_response.create(
                    model=model, messages=_history(task, 0), tools=TOOLS, max_tokens=8,
                    extra_body={"program_id": f"agent-{task}", "top_k": 5})
                r = raw.parse()
                assert r.choices[0].finish_reason == "tool_calls"  # the server's answer, relayed as it came
                assert r.choices[0].message.tool_calls[0].function.name == "read_file"
                first[task] = raw.headers["x-thunderagent-worker"]
            sent = next(e for e in engines if e.chats).chats[0]
            assert sent["model"] == "fake-model"  # the server's own name (the client named ThunderAgent's)
            assert sent["tools"] == TOOLS and sent["top_k"] == 5 and sent["max_tokens"] == 8
            assert "program_id" not in sent and "extra_body" not in sent  # ThunderAgent's own, not the server's
            assert not engines[0].requests and not engines[1].requests  # nothing went the token path
            # Each agent's next steps (its history grown by tool round trips) go where its prefix is cached,
            # and the router knew block for block what the server then reported cached: ThunderAgent's
            # rendering (tools, tool calls, tool answers) hashes to the blocks of the server's KV events.
            for calls in (1, 2):
                for task, worker in first.items():
                    raw = await c.chat.completions.with_raw_response.create(
                        model=model, messages=_history(task, calls), tools=TOOLS, max_tokens=8,
                        extra_body={"program_id": f"agent-{task}"}, extra_headers={"x-thunderagent-explain": "1"})
                    cached = raw.parse().usage.prompt_tokens_details.cached_tokens
                    why = json.loads(raw.headers["x-thunderagent-explanation"])
                    assert raw.headers["x-thunderagent-worker"] == worker, (task, calls)
                    assert why["overlap_blocks"] * BS == cached > len(SYSTEM) // 2, (task, calls, why, cached)
            async with aiohttp.ClientSession() as s, s.get(srv.base_url + "/v1/programs") as resp:
                programs = {p["id"]: p for p in (await resp.json())["data"]}
            relayed = relayed_counts(srv.fleet)
            assert relayed == {"top_k": 4.0, "tools": 8.0}  # the first field each had that the token path lacks
            assert programs["agent-parser"]["steps"] == 3  # relayed steps count as the program's
            # a streamed relayed request: the server's events, unchanged
            stream = await c.chat.completions.create(model=model, messages=_history("parser", 2), tools=TOOLS,
                                                     stream=True, extra_body={"logprobs": True})
            chunks = [ch async for ch in stream]
            assert chunks[0].choices[0].delta.tool_calls[0].function.name == "read_file"
            assert chunks[1].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens == 1
            # a plain request still takes the token path (token ids to /v1/completions)
            plain = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3)
            assert plain.usage.completion_tokens == 3
            sent_plain = [b for e in engines for b in e.requests]
            assert len(sent_plain) == 1 and isinstance(sent_plain[0]["prompt"], list)  # token ids
    finally:
        for e in engines:
            await e.stop()


async def test_relayed_requests_are_checked_and_can_be_switched_off(tiny_model_dir: Path) -> None:
    engines = await _engines(tiny_model_dir, max_model_len=1024)
    try:
        async with running_server(_config(engines, tiny_model_dir, relay="unmodelled")) as srv:
            await wait_until(lambda: srv.fleet.max_context_tokens == 1024, 10, "both servers stated their limit")
            # the servers' max_model_len binds relayed requests as it does the others: without max_tokens
            # the accounting takes what fits (the body goes without it: the server decides), past it a 400
            def tokens(chars: int) -> int:
                return len(srv.tokenizer.apply_openai_chat({"messages": [
                    {"role": "system", "content": (SYSTEM * 4)[:chars]}, {"role": "user", "content": "go"}],
                    "tools": TOOLS}))

            lo, hi = 0, len(SYSTEM) * 4  # the longest system prompt whose request is under 1,024 tokens
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if tokens(mid) < 1024 else (lo, mid - 1)
            long = [{"role": "system", "content": (SYSTEM * 4)[:lo]}, {"role": "user", "content": "go"}]
            n = tokens(lo)
            assert 1024 - 16 < n < 1024  # the default max_tokens (16) would not fit
            r = await srv.client.chat.completions.create(model=srv.fleet.model_name, messages=long, tools=TOOLS)
            assert r.choices[0].finish_reason == "tool_calls"
            assert "max_tokens" not in next(e for e in engines if e.chats).chats[-1]
            with pytest.raises(openai.BadRequestError) as too_long:
                await srv.client.chat.completions.create(model=srv.fleet.model_name, messages=long, tools=TOOLS,
                                                         max_tokens=64)
            assert too_long.value.body["code"] == "context_length_exceeded"
            for e in engines:
                e.chats.clear()
            c, model = srv.client, srv.fleet.model_name
            msgs = [{"role": "user", "content": "hello"}]
            for extra, param in (({"tools": TOOLS, "toppk": 3}, "toppk"),  # a misspelt field: no server reads it
                                 ({"tools": TOOLS, "kv_transfer_params": {"do_remote_prefill": True}},
                                  "kv_transfer_params"),  # the fleet's own
                                 ({"best_of": 2, "logprobs": True}, "best_of")):  # vLLM has no best_of for chat
                with pytest.raises(openai.BadRequestError) as err:
                    await c.chat.completions.create(model=model, messages=msgs, extra_body=extra)
                assert err.value.body["param"] == param, err.value.body
            with pytest.raises(openai.NotFoundError):  # ThunderAgent's model name is checked before relaying
                await c.chat.completions.create(model="other", messages=msgs, tools=TOOLS)
            # completions relay too (echo: a vLLM field, not modelled here)
            r = await c.completions.create(model=model, prompt="hello", max_tokens=2, echo=True)
            assert r.usage.completion_tokens == 2
            sent = [b for e in engines for b in e.requests]
            assert len(sent) == 1 and sent[0]["prompt"] == "hello" and sent[0]["echo"] is True
            assert sent[0]["model"] == "fake-model"
            assert not any(e.chats for e in engines)  # the refusals above reached no server
        async with running_server(_config(engines, tiny_model_dir, relay="off")) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            with pytest.raises(openai.BadRequestError) as err:  # switched off: refused by name, as before
                await srv.client.chat.completions.create(model=srv.fleet.model_name, messages=msgs, tools=TOOLS)
            assert err.value.body["param"] == "tools" and err.value.body["code"] == "unsupported_parameter"
    finally:
        for e in engines:
            await e.stop()


async def test_relay_all_sends_every_request_with_its_body(tiny_model_dir: Path) -> None:
    """``relay: all``: plain requests too go to the server's own endpoints (its tool-call and reasoning parsers
    on every answer), still routed on ThunderAgent's rendering and still checked field by field."""
    engines = await _engines(tiny_model_dir)
    try:
        async with running_server(_config(engines, tiny_model_dir, relay="all")) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            for e in engines:
                await e.wait_subscribed()
            c, model = srv.client, srv.fleet.model_name
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
            first = await c.chat.completions.with_raw_response.create(model=model, messages=msgs, max_tokens=5)
            assert first.parse().choices[0].message.content == "ok"  # the server's answer, not the token path's
            worker = first.headers["x-thunderagent-worker"]
            r = await c.completions.create(model=model, prompt="hello", max_tokens=2)
            assert r.choices[0].text == "ab"
            assert [b["prompt"] for e in engines for b in e.requests] == ["hello"]  # the text, not token ids
            grown = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            again = await c.chat.completions.with_raw_response.create(model=model, messages=grown, max_tokens=5)
            assert again.headers["x-thunderagent-worker"] == worker  # its conversation's blocks are there
            assert again.parse().usage.prompt_tokens_details.cached_tokens > 0
            with pytest.raises(openai.BadRequestError) as err:  # checked as the unmodelled ones are
                await c.chat.completions.create(model=model, messages=msgs, extra_body={"toppk": 1})
            assert err.value.body["param"] == "toppk"
            relayed = relayed_counts(srv.fleet)
            assert relayed == {"all": 3.0}
    finally:
        for e in engines:
            await e.stop()


async def test_sglang_fleets_relay_sglangs_own_fields(tiny_model_dir: Path) -> None:
    tok = HfTokenizer(tiny_model_dir)
    engines = [FakeEngine(flavor="sglang", block_size=BS, render=tok.apply_openai_chat) for _ in range(2)]
    for e in engines:
        await e.start()
    try:
        async with running_server(_config(engines, tiny_model_dir, engine="sglang")) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            c, model = srv.client, srv.fleet.model_name
            msgs = [{"role": "user", "content": "a date please"}]
            r = await c.chat.completions.create(model=model, messages=msgs, extra_body={"regex": r"\d{4}"})
            assert r.choices[0].message.content == "ok"
            assert [b["regex"] for e in engines for b in e.chats] == [r"\d{4}"]
            with pytest.raises(openai.BadRequestError) as err:  # vLLM's, not SGLang's
                await c.chat.completions.create(model=model, messages=msgs, extra_body={"structured_outputs": {}})
            assert err.value.body["param"] == "structured_outputs" and "sglang" in err.value.body["message"]
    finally:
        for e in engines:
            await e.stop()
