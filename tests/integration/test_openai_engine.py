"""``engine: openai``: ThunderAgent as a one-hop proxy in front of OpenAI-compatible servers.

Real sockets on 127.0.0.1: two scriptable servers (``support.openai_backend``) started by the test,
ThunderAgent's real HTTP server in front, the official OpenAI client and raw aiohttp as clients.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest

from support.openai_backend import MODEL, OpenAIBackend
from support.server import Server, running_server
from support.waiting import wait_until
from thunderagent.config import ConfigError, TenantLimit, parse_config



def _config(backends: list[OpenAIBackend], **routing: object):
    return parse_config({
        "model_name": MODEL,
        "control_plane": {"heartbeat_interval": 0.1, "heartbeat_misses": 5},
        "routing": {"seed": 7, **routing},
        "execution_group": {"nodes": [{"engine": "openai", "block_size": 16,
                                       "endpoints": [{"url": b.url} for b in backends]}]},
    }, "test")


@asynccontextmanager
async def fleet(*backends: OpenAIBackend, **routing: object) -> AsyncIterator[Server]:
    for b in backends:
        await b.start()
    try:
        async with running_server(_config(list(backends), **routing)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == len(backends), 10, "servers heartbeat")
            yield srv
    finally:
        for b in backends:
            await b.stop()


async def _post(srv: Server, path: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(srv.base_url + path, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_the_clients_body_and_the_servers_bytes_pass_unchanged() -> None:
    """Fields ThunderAgent does not model reach the server; its SSE events reach the client as sent."""
    b = OpenAIBackend("a")
    async with fleet(b) as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "tools": [{"type": "function", "function": {"name": "f"}}], "logprobs": True, "top_k": 5}
        status, headers, raw = await _post(srv, "/v1/chat/completions", body)
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        assert b.bodies == [body]  # byte-for-byte JSON equality of what the client sent
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "xxx"
        assert all(c.get("served_by", "a") == "a" for c in chunks)  # the server's own fields survive


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("stream", [True, False])
async def test_openai_client_streaming_and_not(chat: bool, stream: bool) -> None:
    async with fleet(OpenAIBackend("a"), OpenAIBackend("b")) as srv:
        c = srv.client
        if chat:
            r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=5, stream=stream)
        else:
            r = await c.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=stream)
        if stream:
            parts = [ch async for ch in r]  # type: ignore[union-attr]
            text = "".join((p.choices[0].delta.content or "") if chat else p.choices[0].text
                           for p in parts if p.choices)
            assert parts[-1].choices[0].finish_reason == "length"
        else:
            text = r.choices[0].message.content if chat else r.choices[0].text  # type: ignore[union-attr]
            assert r.usage.completion_tokens == 5  # type: ignore[union-attr]
        assert text == "xxxxx"


async def test_a_repeated_prefix_goes_back_to_the_same_server() -> None:
    """No events: the router's own predictions keep a conversation on the server that has its prefix."""
    a, b = OpenAIBackend("a"), OpenAIBackend("b")
    async with fleet(a, b) as srv:
        system = "You are a careful assistant. " * 20  # 600 bytes: 37 blocks of 16 with the byte tokenizer
        homes = {}
        for user in range(4):
            prompt = f"{system}user {user}: "
            worker = None
            for turn in range(3):
                status, headers, _ = await _post(srv, "/v1/completions", {
                    "model": MODEL, "prompt": prompt + "more " * turn, "max_tokens": 2})
                assert status == 200
                worker = worker or headers["x-thunderagent-worker"]
                assert headers["x-thunderagent-worker"] == worker, f"user {user} turn {turn} moved"
            homes[user] = worker
        assert len(a.bodies) + len(b.bodies) == 12


async def test_a_server_error_is_an_openai_error() -> None:
    async with fleet(OpenAIBackend("a", status=400)) as srv:
        with pytest.raises(openai.BadRequestError) as exc:
            await srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert exc.value.status_code == 400 and "a refuses" in exc.value.message
        status, _, raw = await _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
        assert status == 400 and json.loads(raw)["error"]["message"] == "a refuses"


async def test_a_5xx_is_routed_to_another_server() -> None:
    bad, good = OpenAIBackend("bad", status=503), OpenAIBackend("good")
    async with fleet(bad, good) as srv:
        for i in range(6):
            r = await srv.client.completions.create(model=MODEL, prompt=f"p{i}" * 40, max_tokens=2)
            assert r.choices[0].text == "xx"
        assert len(good.bodies) == 6


async def test_every_server_failing_is_a_clean_error() -> None:
    async with fleet(OpenAIBackend("a", status=500)) as srv:
        status, _, raw = await _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status >= 500 and "error" in json.loads(raw)


async def test_a_server_dying_mid_stream_ends_with_an_error_event() -> None:
    """A relayed stream carries no token ids, so it cannot be continued elsewhere: the client gets
    what was streamed, then an error event and [DONE]; the server's request is gone."""
    dying, other = OpenAIBackend("dying", die_after=3), OpenAIBackend("other", die_after=3)
    async with fleet(dying, other) as srv:
        status, _, raw = await _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10,
                                                              "stream": True})
        assert status == 200
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "worker_failed"
        assert sum(1 for e in events if b'"text"' in e) == 3
        r = await srv.client.completions.create(model=MODEL, prompt="y", max_tokens=2)  # still serving
        assert r.choices[0].text == "xx"


async def test_validation_left_to_ours_and_the_servers() -> None:
    async with fleet(OpenAIBackend("a")) as srv:
        status, _, raw = await _post(srv, "/v1/completions", {"model": "served-name", "prompt": "x"})
        # a name no server lists is the server's to check: forwarded unchanged, its refusal passed on
        assert status == 404 and json.loads(raw)["error"]["message"] == "The model `served-name` does not exist."
        status, _, raw = await _post(srv, "/v1/completions", {"prompt": "x"})
        assert status == 400 and "model" in json.loads(raw)["error"]["message"]
        status, _, raw = await _post(srv, "/v1/chat/completions", {"model": MODEL})
        assert status == 400 and json.loads(raw)["error"]["param"] == "messages"
        status, _, raw = await _post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
        assert status == 400


async def test_several_models_each_routed_to_the_servers_that_list_it() -> None:
    """A fleet of OpenAI-compatible servers serving different models: ``/v1/models`` lists what they list, a request
    goes only to a server listing its model, and a model a server starts serving is followed."""
    a, b, both = OpenAIBackend("a", models=["llama"]), OpenAIBackend("b", models=["qwen"]), \
        OpenAIBackend("both", models=["llama", "qwen"])
    async with fleet(a, b, both) as srv:
        await wait_until(lambda: srv.fleet.registry.adapters_anywhere() == ["llama", "qwen"], 10, "models polled")
        assert [m.id for m in (await srv.client.models.list()).data] == ["llama", "qwen"]
        for k in range(12):  # unique prompts: no prefix draws them anywhere, only the model does
            for model, allowed in (("llama", {"a", "both"}), ("qwen", {"b", "both"})):
                r = await srv.client.with_raw_response.completions.create(model=model, prompt=f"{model} {k} " * 8,
                                                                         max_tokens=2)
                assert r.parse().model == model and r.parse().model_extra["served_by"] in allowed, (model, k)
        assert {x["model"] for x in a.bodies} == {"llama"} and {x["model"] for x in b.bodies} == {"qwen"}
        assert len(both.bodies) >= 1  # (its share of both models)
        b.models.append("mistral")  # the server loads another model: listed and routed once polled again
        await wait_until(lambda: "mistral" in srv.fleet.registry.adapters_anywhere(), 10, "the new model polled")
        for k in range(4):
            r = await srv.client.completions.create(model="mistral", prompt=f"m{k}", max_tokens=2)
            assert r.model_extra["served_by"] == "b"


async def test_servers_that_demand_an_api_key_get_it_on_every_call(monkeypatch) -> None:
    """``api_key_env``: the key goes as ``Authorization: Bearer`` on the polls, relayed requests (pooled lean client
    and aiohttp alike) and stored-response reads; a server whose key is missing from the environment stops the
    start with an error naming the field."""
    monkeypatch.setenv("SERVER_KEY", "sk-server-0123456789")
    a = OpenAIBackend("a", api_key="sk-server-0123456789", metrics=True)
    await a.start()
    try:
        data = _config([a]).model_dump(mode="json")
        data["execution_group"]["nodes"][0]["endpoints"][0]["api_key_env"] = "SERVER_KEY"
        async with running_server(parse_config(data, "test")) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 1, 10, "the server heartbeats")
            for stream in (False, True):
                r = await srv.client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=stream)
                if stream:
                    r = [c async for c in r][-1]
                assert r.choices[0].finish_reason == "length"
            await wait_until(lambda: {"/v1/models", "/metrics"} <= set(a.seen_keys), 10, "polls with the key")
            assert a.seen_keys["/v1/completions"] == 2
        monkeypatch.delenv("SERVER_KEY")
        with pytest.raises(ConfigError, match="api_key_env': environment variable SERVER_KEY is not set"):
            async with running_server(parse_config(data, "test")):
                pass
    finally:
        await a.stop()


async def test_load_comes_from_metrics_when_served_and_in_flight_accounting_otherwise() -> None:
    with_metrics, without = OpenAIBackend("m", metrics=True, step_s=0.01), OpenAIBackend("n")
    async with fleet(with_metrics, without) as srv:
        wid = {srv.fleet.workers[w].url: w for w in srv.fleet.workers}  # type: ignore[attr-defined]
        m, n = wid[with_metrics.url], wid[without.url]
        await wait_until(lambda: srv.fleet.registry.loads()[m].waiting == 3, 5, "metrics polled")
        assert srv.fleet.registry.loads()[n].waiting == 0


async def test_concurrent_requests_reach_the_server_together() -> None:
    """A non-streamed answer's first byte is its last: requests in flight count as running (the
    server's queue is invisible), so the holding queue does not feed the server one at a time."""
    b = OpenAIBackend("slow", delay_s=0.3)
    async with fleet(b) as srv:
        rs = await asyncio.gather(*(srv.client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=2)
                                    for i in range(12)))
        assert all(r.choices[0].text == "xx" for r in rs)
        assert b.peak == 12


def test_kv_events_are_refused_for_engine_openai() -> None:
    with pytest.raises(ConfigError, match="engine openai publishes no KV events"):
        parse_config({"execution_group": {"nodes": [{"engine": "openai", "endpoints": [
            {"url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:2"}]}]}})
    with pytest.raises(ConfigError, match="cannot share a fleet"):
        parse_config({"execution_group": {"nodes": [
            {"engine": "openai", "endpoints": [{"url": "http://127.0.0.1:1"}]}, {"engine": "simulated"}]}})


def test_serve_flags_build_an_openai_fleet() -> None:
    """``serve --engine openai --worker URL``: servers without events; ``URL=EVENTS`` is refused."""
    from thunderagent.overrides import build_config

    cfg = build_config(None, None, None, None, None, None, engine="openai",
                       worker_endpoints=["http://127.0.0.1:8080", "http://127.0.0.1:8081"], block_size=16)
    (node,) = cfg.execution_group.nodes
    assert node.engine == "openai" and node.count == 2 and node.block_size == 16
    assert [e.kv_events for e in node.endpoints] == [None, None]
    with pytest.raises(ConfigError, match="publishes no KV events"):
        build_config(None, None, None, None, None, None, engine="openai",
                     worker_endpoints=["http://127.0.0.1:8080=tcp://127.0.0.1:5571"])


@pytest.mark.parametrize("stream", [True, False])
async def test_a_tenants_token_limit_counts_relayed_prompts_and_completions(stream: bool) -> None:
    """control_plane.tenant_limits tokens_per_min in front of OpenAI-compatible servers: the prompt as
    ThunderAgent tokenized it, the completion as the server produced it."""
    from thunderagent.frontend.tenant_gate import GATE_KEY

    b = OpenAIBackend("a")
    await b.start()
    cfg = _config([b])
    cfg = cfg.model_copy(update={"control_plane": cfg.control_plane.model_copy(update={
        "api_keys": {"k-acme-0123456789abcdef": "acme"},
        "tenant_limits": {"acme": TenantLimit(tokens_per_min=60, token_burst=200)}})})
    try:
        async with running_server(cfg) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 1, 10, "the server heartbeats")
            limiter = srv.app[GATE_KEY].limiter  # type: ignore[index]
            clock = asyncio.get_running_loop().time
            c = openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="k-acme-0123456789abcdef", max_retries=0)
            prompt = list(range(1, 41))  # 40 tokens, as sent
            raw = await c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=100,
                                                               stream=stream)
            # OpenAI's x-ratelimit-* headers: the bucket after the prompt and max_tokens were taken
            room = (raw.headers["x-ratelimit-limit-tokens"], raw.headers["x-ratelimit-remaining-tokens"])
            assert room == ("200", "60")
            r = raw.parse()
            if stream:
                assert "".join([ch.choices[0].text async for ch in r if ch.choices]) == "x" * 100  # type: ignore[union-attr]
            else:
                assert r.choices[0].text == "x" * 100  # type: ignore[union-attr]
            assert 200 - 140 <= limiter.tokens_left("acme", clock()) < 200 - 140 + 3
            with pytest.raises(openai.RateLimitError) as exc:  # 60 left, 2 refilled at most: 80 do not fit
                await c.completions.create(model=MODEL, prompt=list(range(1, 81)), max_tokens=2)
            assert exc.value.body["code"] == "tokens_rate_limit_exceeded"
            await c.close()
    finally:
        await b.stop()


@pytest.mark.nats
async def test_several_models_over_nats(tmp_path) -> None:
    """Worker processes in front of OpenAI-compatible servers of different models, a frontend process: the
    servers' model lists cross the bus in the heartbeats, and each request reaches a server of its model."""
    from integration.nats_cluster import Cluster

    llama, qwen = OpenAIBackend("a", models=["llama"]), OpenAIBackend("b", models=["qwen"])
    for b in (llama, qwen):
        await b.start()
    cluster = Cluster(tmp_path)
    base = "control_plane: {heartbeat_interval: 0.2, heartbeat_misses: 5}\nexecution_group:\n  nodes:\n"
    node = "    - {{engine: openai, block_size: 16, endpoints: [{{url: \"{}\"}}]}}\n"
    cluster.config.write_text(base + node.format(llama.url))
    try:
        cluster.start_nats()
        cluster.start_worker("wa")
        (tmp_path / "b.yaml").write_text(base + node.format(qwen.url))
        cluster.start_worker("wb", config=tmp_path / "b.yaml")
        cluster.start_frontend("fa")
        client = cluster.client("fa")

        def listed() -> list[str]:  # (blocking HTTP: off the loop, which serves the backends)
            try:
                return [m.id for m in client.models.list().data]
            except openai.APIConnectionError:
                return []

        for _ in range(300):  # the frontend up, both workers met, their models heard (60 s at most)
            if await asyncio.to_thread(listed) == ["llama", "qwen"]:
                break
            assert not any(cluster.exited(p) for p in ("fa", "wa", "wb")), cluster.logs()
            await asyncio.sleep(0.2)
        assert await asyncio.to_thread(listed) == ["llama", "qwen"], cluster.logs()
        for k in range(6):
            for model, backend in (("llama", llama), ("qwen", qwen)):
                r = await asyncio.to_thread(client.completions.create, model=model, prompt=f"{model} {k}",
                                            max_tokens=2)
                assert r.model == model and r.model_extra["served_by"] == backend.name
        assert len(llama.bodies) == len(qwen.bodies) == 6
        # a client's trace context crosses the bus with its request
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        await asyncio.to_thread(client.completions.create, model="qwen", prompt="traced", max_tokens=2,
                                extra_headers={"traceparent": parent})
        assert qwen.headers[-1]["traceparent"] == parent
        # a speech-to-text form crosses the bus with its content type and reaches a server of its model intact
        audio = b"RIFF\r\n--\x00\xff" * 5_000
        heard = await asyncio.to_thread(client.audio.transcriptions.create, model="qwen", file=("a.wav", audio))
        assert heard.text == f"b heard {len(audio)} bytes" and qwen.forms[-1] == {"model": "qwen", "file": audio}
        # a relayed request's prompt is not sent, its body is: a conversation of 600,000 byte-tokens (the byte
        # stand-in) fits one message of the bus's 1 MiB; one whose body is past a message is refused up front
        long = "tool output " * 50_000
        r = await asyncio.to_thread(client.completions.create, model="qwen", prompt=long, max_tokens=2)
        assert r.usage is not None and qwen.bodies[-1]["prompt"] == long
        with pytest.raises(openai.APIStatusError) as big:
            await asyncio.to_thread(client.completions.create, model="qwen", prompt=long * 2, max_tokens=2)
        assert big.value.status_code == 413 and "max_payload" in big.value.body["message"]
    finally:
        cluster.close()
        for b in (llama, qwen):
            await b.stop()
