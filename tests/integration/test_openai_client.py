"""The official openai client against the real server: streaming and not, both endpoints."""

from __future__ import annotations

import aiohttp
import pytest

from thunderagent.frontend.tokenizer import ChatMessage

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"


async def test_chat_non_streaming_names_worker_and_reports_usage(server_factory):
    async with server_factory() as srv:
        raw = await srv.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me about caches. " * 20}], max_tokens=40
        )
        worker = raw.headers["x-thunderagent-worker"]
        assert worker in srv.fleet.workers
        resp = raw.parse()
        text = resp.choices[0].message.content
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert 0 < resp.usage.completion_tokens <= 40
        assert len(text.encode()) == resp.usage.completion_tokens  # byte tokenizer: one token per byte
        assert text.isascii() and text.strip()
        expected_prompt = len(srv.tokenizer.apply_chat_template(
            [ChatMessage("user", "Tell me about caches. " * 20)]))
        assert resp.usage.prompt_tokens == expected_prompt
        assert resp.usage.prompt_tokens_details.cached_tokens == 0

        again = await srv.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me about caches. " * 20}], max_tokens=40
        )
        assert again.headers["x-thunderagent-worker"] == worker  # same prompt -> the worker that cached it
        second = again.parse()
        assert second.choices[0].message.content == text  # deterministic from the prompt
        assert second.usage.prompt_tokens_details.cached_tokens == (resp.usage.prompt_tokens - 1) // 64 * 64


async def test_chat_streaming(server_factory):
    async with server_factory() as srv:
        raw = await srv.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "stream please " * 10}], max_tokens=50,
            stream=True, stream_options={"include_usage": True},
        )
        assert raw.headers["x-thunderagent-worker"].startswith("worker-")
        assert raw.headers["content-type"].startswith("text/event-stream")
        stream = raw.parse()
        pieces, finish, usage, roles = [], None, None, []
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.role:
                    roles.append(ch.delta.role)
                if ch.delta.content:
                    pieces.append(ch.delta.content)
                if ch.finish_reason:
                    finish = ch.finish_reason
        assert roles == ["assistant"]
        assert len(pieces) > 1  # really streamed, not one blob
        assert finish in ("stop", "length")
        assert usage is not None and usage.completion_tokens == len("".join(pieces).encode())

        # the same prompt without streaming yields the same text
        full = await srv.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "stream please " * 10}], max_tokens=50
        )
        assert full.choices[0].message.content == "".join(pieces)


async def test_completions_text_and_token_ids(server_factory):
    async with server_factory() as srv:
        r = await srv.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
        assert r.usage.prompt_tokens == len("Once upon a time")
        ids = list("Once upon a time".encode())
        r2 = await srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=12)
        assert r2.choices[0].text == r.choices[0].text
        chunks = []
        async for c in await srv.client.completions.create(model=MODEL, prompt="abc " * 30, max_tokens=20, stream=True):
            chunks.append(c.choices[0].text)
        assert len("".join(chunks).encode()) == 20


async def test_stop_sequence_truncates_and_frees_the_request(server_factory):
    async with server_factory() as srv:
        msgs = [{"role": "user", "content": "say something long " * 5}]
        full = (await srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200))
        text = full.choices[0].message.content
        assert len(text) > 30
        stop = text[20:24]
        cut = await srv.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == text[: text.index(stop)]
        # streamed variant never leaks the stop string
        pieces = []
        async for c in await srv.client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=200, stop=stop, stream=True
        ):
            if c.choices and c.choices[0].delta.content:
                pieces.append(c.choices[0].delta.content)
        assert "".join(pieces) == text[: text.index(stop)]
        for load in srv.fleet.registry.loads().values():
            assert load.running == 0 and load.waiting == 0  # aborted requests released


async def test_models_health_metrics_and_explain(server_factory):
    async with server_factory() as srv:
        models = await srv.client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.base_url + "/health") as r:
                body = await r.json()
                assert r.status == 200 and body["healthy_workers"] == 4
            payload = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 5,
                       "explain": True}
            async with s.post(srv.base_url + "/v1/chat/completions", json=payload) as r:
                body = await r.json()
                assert r.status == 200
                exp = body["thunderagent"]
                assert exp["worker"] == r.headers["x-thunderagent-worker"]
                assert exp["policy"] == "kv_aware" and len(exp["candidates"]) == 4
                assert {"overlap_blocks", "cost", "queued_prefill_tokens", "kv_usage"} <= set(exp["candidates"][0])
            async with s.get(srv.base_url + "/metrics") as r:
                text = await r.text()
        for name in (
            "thunderagent_requests_total", "thunderagent_ttft_seconds_count", "thunderagent_itl_seconds_count",
            "thunderagent_worker_queue_depth", "thunderagent_worker_kv_usage",
            "thunderagent_router_predicted_hit_rate", "thunderagent_prefill_recompute_rate",
            "thunderagent_routing_decision_seconds_count",
        ):
            assert name in text, name
        assert 'thunderagent_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
