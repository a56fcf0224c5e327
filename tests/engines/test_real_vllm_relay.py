"""Relayed requests (``relay: unmodelled``) against two real vLLM servers (CPU build, tiny random Llama whose
template renders tools and tool calls): ThunderAgent renders a tool conversation to exactly the tokens vLLM
renders (its ``/tokenize``), so the router's hashes are the blocks vLLM's KV events announce; tool
requests and logprobs, which the token path does not model, are served by vLLM through ThunderAgent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from support.waiting import wait_until
from tests.engines.conftest import front_config, thunderagent
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer
from thunderagent.frontend.hf_tokenizer import HfTokenizer
from thunderagent.kv.hashing import block_hashes, hash_seed

pytestmark = pytest.mark.real_engine

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
SYSTEM = "You are a coding agent: read the files you need, then answer in one short paragraph. " * 5


def _history(calls: int) -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": [{"type": "text", "text": "Fix the parser."},
                                                     {"type": "text", "text": "Tests fail since Monday."}]}]
    for k in range(calls):
        call = {"id": f"call-{k}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/parser/{k}.py"})}}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": f"def parse_{k}(text):\n    return text\n"})
    return msgs


async def test_relayed_tool_requests_on_real_vllm(tiny_model_dir: Path, vllm_servers: list[VllmServer]) -> None:
    tok = HfTokenizer(tiny_model_dir)
    served = str(tiny_model_dir)
    async with aiohttp.ClientSession() as s:  # vLLM's own rendering of the same requests
        for doc in ({"messages": _history(0)}, {"messages": _history(2), "tools": TOOLS},
                    {"messages": _history(1), "tools": TOOLS, "add_generation_prompt": False}):
            async with s.post(vllm_servers[0].url + "/tokenize", json={"model": served, **doc}) as r:
                assert r.status == 200, await r.text()
                theirs = (await r.json())["tokens"]
            assert tok.apply_openai_chat(doc) == theirs, doc
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
        c, fleet = front.client, front.fleet
        first = await c.chat.completions.with_raw_response.create(
            model=front.model, messages=_history(1), tools=TOOLS, tool_choice="none", max_tokens=4,
            extra_body={"ignore_eos": True, "program_id": "agent-1"})
        r1 = first.parse()
        assert r1.choices[0].finish_reason == "length" and r1.usage.completion_tokens == 4
        worker = first.headers["x-thunderagent-worker"]
        hashes = block_hashes(tok.apply_openai_chat({"messages": _history(1), "tools": TOOLS}), BLOCK_SIZE, hash_seed())
        full = len(hashes)
        await wait_until(lambda: fleet.index.is_confirmed(worker, hashes[-1]), 20, "vLLM's events of the first step")
        grown = await c.chat.completions.with_raw_response.create(
            model=front.model, messages=_history(2), tools=TOOLS, tool_choice="none", max_tokens=4,
            extra_body={"ignore_eos": True, "program_id": "agent-1"}, extra_headers={"x-thunderagent-explain": "1"})
        why = json.loads(grown.headers["x-thunderagent-explanation"])
        cached = grown.parse().usage.prompt_tokens_details.cached_tokens
        assert grown.headers["x-thunderagent-worker"] == worker
        assert why["overlap_blocks"] == full and cached == full * BLOCK_SIZE, (why, cached)  # block for block
        lp = await c.chat.completions.create(model=front.model, messages=_history(0), max_tokens=3, logprobs=True,
                                             top_logprobs=2, extra_body={"ignore_eos": True})
        content = lp.choices[0].logprobs.content
        assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


# -- Anthropic's Messages API (/v1/messages): vLLM converts it to a chat request and renders that -----------------
A_TOOLS = [{"name": "read_file", "description": "Read a file of the repository.",
            # no "type": vLLM adds it
            "input_schema": {"properties": {"path": {"type": "string"}}, "required": ["path"]}}]
A_SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=4f0a1;"},
            {"type": "text", "text": SYSTEM}, {"type": "text", "text": "Be brief."}]


def _a_history(calls: int) -> list[dict]:
    """Claude Code's shapes: text blocks, tool_use (with and without text), tool_result as text and as blocks,
    a thinking block, an inline system reminder."""
    msgs: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Fix the parser."},
                                                     {"type": "text", "text": "Tests fail since Monday."}]}]
    for k in range(calls):
        use = {"type": "tool_use", "id": f"toolu_{k}", "name": "read_file", "input": {"path": f"src/parser/{k}.py"}}
        blocks = [{"type": "thinking", "thinking": "I should read it.", "signature": "sig"}, use] if k % 2 else \
            [{"type": "text", "text": "Reading the file."}, use]
        msgs.append({"role": "assistant", "content": blocks})
        result = f"def parse_{k}(text):\n    return text\n"
        content = [{"type": "text", "text": result}, {"type": "text", "text": "(end of file)"}] if k % 2 else result
        result_block = {"type": "tool_result", "tool_use_id": use["id"], "content": content}
        msgs.append({"role": "user", "content": [result_block]})
        if k == 0:
            msgs.append({"role": "system", "content": "<system-reminder>Keep going.</system-reminder>"})
    return msgs


async def test_messages_api_on_real_vllm(tiny_model_dir: Path, vllm_servers: list[VllmServer]) -> None:
    import anthropic

    from thunderagent.frontend.anthropic import to_chat

    tok = HfTokenizer(tiny_model_dir)
    served = str(tiny_model_dir)
    counted = [*A_SYSTEM[:1], {"type": "text", "text": "(counted directly) "}, *A_SYSTEM[1:]]  # a cold prefix later
    docs = [{"system": counted, "messages": _a_history(0)},
            {"system": counted, "messages": _a_history(3), "tools": A_TOOLS, "tool_choice": {"type": "none"}},
            {"system": "plain system text", "messages": _a_history(2), "tools": A_TOOLS,
             "tool_choice": {"type": "none"},
             "thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}]
    async with aiohttp.ClientSession() as s:  # vLLM's own count of the same requests
        for doc in docs:
            async with s.post(vllm_servers[0].url + "/v1/messages/count_tokens", json={"model": served, **doc}) as r:
                assert r.status == 200, await r.text()
                theirs = (await r.json())["input_tokens"]
            chat = to_chat(doc, system_first=tok.system_first, effort_off=tok.thinking_off_effort())
            ours = tok.apply_openai_chat(chat)
            assert len(ours) == theirs, doc
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
        fleet = front.fleet
        async with anthropic.AsyncAnthropic(base_url=front.base_url, api_key="unused", max_retries=0,
                                            timeout=120) as c:
            count = await c.messages.count_tokens(model=front.model, system=A_SYSTEM, tools=A_TOOLS,
                                                  tool_choice={"type": "none"}, messages=_a_history(3))
            asked = {"system": A_SYSTEM, "tools": A_TOOLS, "messages": _a_history(3)}
            expected = tok.apply_openai_chat(to_chat(asked, system_first=False, effort_off="none"))
            assert count.input_tokens == len(expected)
            program = {"x-thunderagent-program-id": "claude-1"}
            first = await c.messages.with_raw_response.create(
                model=front.model, system=A_SYSTEM, tools=A_TOOLS, messages=_a_history(2), max_tokens=4,
                tool_choice={"type": "none"}, extra_headers=program)
            m1 = await first.parse()
            # vLLM's answer, relayed (random weights: an early end of sequence is possible)
            assert m1.stop_reason in ("max_tokens", "end_turn") and 1 <= m1.usage.output_tokens <= 4, m1
            worker = first.headers["x-thunderagent-worker"]
            ids = tok.apply_openai_chat(to_chat({"system": A_SYSTEM, "tools": A_TOOLS, "messages": _a_history(2)},
                                                system_first=False, effort_off="none"))
            hashes = block_hashes(ids, BLOCK_SIZE, hash_seed())
            await wait_until(lambda: fleet.index.is_confirmed(worker, hashes[-1]), 20,
                             "vLLM's events of the first step")
            grown = await c.messages.with_raw_response.create(
                model=front.model, system=A_SYSTEM, tools=A_TOOLS, messages=_a_history(3), max_tokens=4,
                tool_choice={"type": "none"}, extra_headers={**program, "x-thunderagent-explain": "1"})
            why = json.loads(grown.headers["x-thunderagent-explanation"])
            cached = (await grown.parse()).usage.cache_read_input_tokens
            assert grown.headers["x-thunderagent-worker"] == worker
            assert why["overlap_blocks"] == len(hashes) and cached == len(hashes) * BLOCK_SIZE, (why, cached)
            async with c.messages.stream(model=front.model, max_tokens=3, messages=_a_history(0),
                                         system=A_SYSTEM) as stream:
                final = await stream.get_final_message()
            assert final.stop_reason in ("max_tokens", "end_turn") and 1 <= final.usage.output_tokens <= 3, final


# -- OpenAI's Responses API (/v1/responses): vLLM builds chat messages from the input and renders those ----------
R_TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def _r_input(calls: int) -> list[dict]:
    """Codex's shapes: a developer message, input_text parts, function calls and their outputs, an assistant
    message item, a reasoning item."""
    items: list[dict] = [{"role": "developer", "content": "Prefer small diffs."},
                         {"role": "user", "content": [{"type": "input_text", "text": "Fix the parser."},
                                                      {"type": "input_text", "text": "Tests fail since Monday."}]}]
    for k in range(calls):
        if k % 2:
            items.append({"type": "reasoning", "id": f"rs_{k}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": "Read the next file."}]})
        else:
            items.append({"type": "message", "role": "assistant", "id": f"msg_{k}", "status": "completed",
                          "content": [{"type": "output_text", "text": "Reading it.", "annotations": []}]})
        items.append({"type": "function_call", "call_id": f"call_{k}", "name": "read_file",
                      "arguments": json.dumps({"path": f"src/parser/{k}.py"})})
        items.append({"type": "function_call_output", "call_id": f"call_{k}",
                      "output": f"def parse_{k}(text):\n    return text\n"})
    return items


async def test_responses_api_on_real_vllm(tiny_model_dir: Path, vllm_servers: list[VllmServer]) -> None:
    from thunderagent.frontend.responses import to_chat

    tok = HfTokenizer(tiny_model_dir)
    served = str(tiny_model_dir)
    counting = "(counted directly) " + SYSTEM  # not the routed requests' prefix: they must find a cold cache
    docs = [{"instructions": counting, "input": "Fix the parser."},
            {"instructions": counting, "input": _r_input(3), "tools": R_TOOLS, "tool_choice": "none"},
            {"input": _r_input(2), "reasoning": {"effort": "high"}}]
    async with aiohttp.ClientSession() as s:  # vLLM's own count of the same requests (its usage)
        for doc in docs:
            body = {"model": served, "max_output_tokens": 1, "store": False, **doc}
            async with s.post(vllm_servers[0].url + "/v1/responses", json=body) as r:
                assert r.status == 200, await r.text()
                theirs = (await r.json())["usage"]["input_tokens"]
            assert len(tok.apply_openai_chat(to_chat(doc), keep_call_order=True)) == theirs, doc
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
        c, fleet = front.client, front.fleet
        step = {"instructions": SYSTEM, "tools": R_TOOLS, "tool_choice": "none", "max_output_tokens": 4,
                "store": False}
        first = await c.responses.with_raw_response.create(model=front.model, input=_r_input(2), **step)
        r1 = first.parse()
        assert r1.status in ("completed", "incomplete") and 1 <= r1.usage.output_tokens <= 4, r1
        worker = first.headers["x-thunderagent-worker"]
        ids = tok.apply_openai_chat(to_chat({**step, "input": _r_input(2)}), keep_call_order=True)
        hashes = block_hashes(ids, BLOCK_SIZE, hash_seed())
        await wait_until(lambda: fleet.index.is_confirmed(worker, hashes[-1]), 20, "vLLM's events of the first step")
        grown = await c.responses.with_raw_response.create(model=front.model, input=_r_input(3), **step,
                                                           extra_headers={"x-thunderagent-explain": "1"})
        why = json.loads(grown.headers["x-thunderagent-explanation"])
        cached = grown.parse().usage.input_tokens_details.cached_tokens
        assert grown.headers["x-thunderagent-worker"] == worker
        assert why["overlap_blocks"] == len(hashes) and cached == len(hashes) * BLOCK_SIZE, (why, cached)
        stream = await c.responses.create(model=front.model, input="hello", max_output_tokens=3, stream=True,
                                          store=False)
        events = [ev async for ev in stream]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert 1 <= events[-1].response.usage.output_tokens <= 3


async def test_tokenizer_paths_and_stored_responses_on_real_vllm(tiny_model_dir: Path,
                                                                 vllm_servers: list[VllmServer]) -> None:
    """vLLM's paths that generate nothing answer through ThunderAgent as they answer directly (its tokenizer and
    chat template; its refusal of embeddings on a generative model, with its status), and a stored response is
    read, refused a cancel and continued on the server that stored it (the servers run with the store on); its
    ``/tokenizer_info`` and a speech-to-text form (refused by a generative model's server, as directly)."""
    served = str(tiny_model_dir)
    chat = {"messages": _history(1), "tools": TOOLS, "add_generation_prompt": True}
    asks = [("/tokenize", {"prompt": "Hello, world: fix the parser."}), ("/tokenize", chat),
            ("/detokenize", {"tokens": []}), ("/v1/embeddings", {"input": "hello"})]
    async with aiohttp.ClientSession() as s:
        direct = []
        for path, body in asks:
            if path == "/detokenize":  # the ids the first call gave
                body["tokens"] = direct[0][1]["tokens"]
            async with s.post(vllm_servers[1].url + path, json={"model": served, **body}) as r:
                direct.append((r.status, await r.json()))
        assert direct[0][0] == direct[1][0] == direct[2][0] == 200 and direct[3][0] >= 400, direct
        async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
            for (path, body), (status, theirs) in zip(asks, direct):
                async with s.post(front.base_url + path, json={"model": front.model, **body}) as r:
                    ours = await r.json()
                    assert r.status == status, (path, ours)
                    if status == 200:
                        assert ours == theirs, path
                    else:  # vLLM's refusal (FastAPI's 404: a generative server has no such route), in OpenAI's shape
                        assert theirs == {"detail": "Not Found"} and "HTTP 404" in ours["error"]["message"]
            c = front.client
            made = await c.responses.with_raw_response.create(model=front.model, input="Fix the parser.",
                                                              max_output_tokens=3, store=True)
            r1 = made.parse()
            got = await c.responses.with_raw_response.retrieve(r1.id)
            assert got.parse().id == r1.id and got.parse().output == r1.output
            assert got.headers["x-thunderagent-worker"] == made.headers["x-thunderagent-worker"]
            async with s.post(front.base_url + f"/v1/responses/{r1.id}/cancel") as r:
                assert r.status == 400 and "synchronous" in (await r.json())["error"]["message"]
            follow = await c.responses.with_raw_response.create(model=front.model, input="and then?",
                                                                max_output_tokens=3, previous_response_id=r1.id)
            assert follow.headers["x-thunderagent-worker"] == made.headers["x-thunderagent-worker"]
            assert follow.parse().usage.input_tokens > r1.usage.input_tokens  # the stored conversation came along
            async with s.get(front.base_url + "/v1/responses/resp_nowhere") as r:
                assert r.status == 404
            # GET /tokenizer_info (the servers run with --enable-tokenizer-info-endpoint): the server's own answer
            async with s.get(vllm_servers[1].url + "/tokenizer_info") as r:
                assert r.status == 200
                theirs = await r.json()
            async with s.get(front.base_url + "/tokenizer_info") as r:
                assert r.status == 200 and await r.json() == theirs
            # a speech-to-text form reaches a server, whose refusal (a generative model has no transcription route)
            # comes back with its status, as it answers directly
            form = aiohttp.FormData(default_to_multipart=True)
            form.add_field("file", b"RIFF" + bytes(64), filename="a.wav", content_type="audio/wav")
            form.add_field("model", served)
            async with s.post(vllm_servers[1].url + "/v1/audio/transcriptions", data=form) as r:
                direct_status = r.status
            form = aiohttp.FormData(default_to_multipart=True)
            form.add_field("file", b"RIFF" + bytes(64), filename="a.wav", content_type="audio/wav")
            form.add_field("model", front.model)
            async with s.post(front.base_url + "/v1/audio/transcriptions", data=form) as r:
                assert direct_status >= 400 and r.status == direct_status, (direct_status, await r.text())


async def test_background_responses_on_real_vllm(tiny_model_dir: Path, vllm_servers: list[VllmServer]) -> None:
    """A background response (the servers run with the store on) is answered queued, generated on its server and
    read there through ThunderAgent until completed; a streamed one's events are replayed from ``starting_after``
    after the client left; a long one is cancelled on its server."""
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front, \
            aiohttp.ClientSession() as s:
        c = front.client
        made = await c.responses.with_raw_response.create(model=front.model, input="Fix the parser.",
                                                          max_output_tokens=6, background=True,
                                                          extra_body={"ignore_eos": True})
        first = made.parse()
        assert first.status in ("queued", "in_progress"), first.status
        worker = made.headers["x-thunderagent-worker"]

        async def status() -> str:
            got = await c.responses.with_raw_response.retrieve(first.id)
            assert got.headers["x-thunderagent-worker"] == worker  # read where it is stored
            return got.parse().status

        for _ in range(200):
            if await status() not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.1)
        done = await c.responses.retrieve(first.id)  # (incomplete: it stopped at max_output_tokens)
        assert done.status in ("completed", "incomplete") and done.usage.output_tokens == 6
        # streamed in the background: the client reads two events and leaves; the rest is replayed after the second
        async with s.post(front.base_url + "/v1/responses", json={
                "model": front.model, "input": "Tell me about the parser.", "max_output_tokens": 8,
                "background": True, "stream": True, "ignore_eos": True}) as r:
            assert r.status == 200
            seen: list[dict] = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    seen.append(json.loads(line[6:]))
                    if len(seen) == 2:
                        break
        rid, last = seen[0]["response"]["id"], seen[-1]["sequence_number"]
        rest = [e async for e in await c.responses.retrieve(rid, stream=True, starting_after=last)]
        assert rest[0].sequence_number == last + 1 and rest[-1].type == "response.completed"
        assert rest[-1].response.usage.output_tokens == 8
        # a long one is cancelled where it waits: the servers' scheduling paused first (vLLM's dev path, sent to them
        # directly), so the response is still queued when the cancel comes (a busy test process once sent the cancel
        # after the tiny model had generated all 1,800 tokens: vLLM then refuses it)
        for v in vllm_servers:
            async with s.post(f"{v.url}/pause?mode=keep&clear_cache=false") as r:
                assert r.status == 200
        try:
            long = await c.responses.create(model=front.model, input="A long essay.", max_output_tokens=1800,
                                            background=True, extra_body={"ignore_eos": True})
            cancelled = await c.responses.cancel(long.id)
            assert cancelled.status == "cancelled"
            assert (await c.responses.retrieve(long.id)).status == "cancelled"
        finally:  # (the servers are shared with the tests after this one)
            for v in vllm_servers:
                async with s.post(f"{v.url}/resume") as r:
                    assert r.status == 200
