"""``engine: openai`` in front of two real vLLM servers (CPU build, tiny random Llama), their KV events
not subscribed to: requests relayed unchanged, routing on the router's own predictions."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.engines.conftest import thunderagent
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer
from thunderagent.config import parse_config

pytestmark = pytest.mark.real_engine


def _config(model_dir: Path, servers: list[VllmServer]):
    return parse_config({
        "model": str(model_dir),  # prompts hashed with the model's own tokenizer
        "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": 10},
        "routing": {"seed": 7},
        "execution_group": {"nodes": [{"engine": "openai", "block_size": BLOCK_SIZE,
                                       "endpoints": [{"url": s.url} for s in servers]}]},
    }, "test")


async def test_vllm_behind_engine_openai(tiny_model_dir: Path, vllm_servers: list[VllmServer]) -> None:
    model = str(tiny_model_dir)  # vLLM's served name: the client's body reaches it unchanged
    async with thunderagent(_config(tiny_model_dir, vllm_servers), vllm_servers, wait_healthy=False) as front:
        c = front.client
        system = "You are a terse assistant who answers every question in one short sentence. " * 6
        workers = []
        for turn in range(3):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]
            r = await c.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                                extra_body={"ignore_eos": True})  # vLLM's own field: passed on
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
            raw = await c.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=1)
            workers.append(raw.headers["x-thunderagent-worker"])
        assert len(set(workers)) == 1, "the shared system prompt stays on the server predicted to hold it"
        stream = await c.completions.create(model=model, prompt=system, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        assert any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)
        async with aiohttp.ClientSession() as s, s.post(front.base_url + "/v1/completions", json={
                "model": "no-such-model", "prompt": "x"}) as resp:
            assert resp.status == 404 and "error" in await resp.json()  # vLLM's own refusal, relayed
