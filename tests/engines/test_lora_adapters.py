"""LoRA adapters by name: a vLLM server lists its adapters in ``/v1/models`` (``parent``: the base model),
and clients name one as the ``model``, as they would talking to vLLM. ThunderAgent serves an adapter by
name once some worker's server lists it (routing sends it only to those), sends it as the model on both the
token path and the relayed one, lists it in its own ``/v1/models``, and follows adapters loaded at runtime.

Real sockets on 127.0.0.1: two fake vLLM servers (``support.fake_engine``), ThunderAgent's HTTP server,
the official ``openai`` client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import openai
import pytest

from integration.conftest import test_config as make_config
from support.fake_engine import FakeEngine
from support.server import running_server
from support.waiting import wait_until
from thunderagent.frontend.hf_tokenizer import HfTokenizer

BS = 16


async def test_adapters_are_models_routed_to_the_servers_that_list_them(tiny_model_dir: Path) -> None:
    tok = HfTokenizer(tiny_model_dir)
    engines = [FakeEngine(block_size=BS, render=tok.apply_openai_chat, adapters=["sql-lora", *extra])
               for extra in ([], ["math-lora"])]
    for e in engines:
        await e.start()
    cfg = make_config(model=str(tiny_model_dir), control_plane={"heartbeat_interval": 0.1, "heartbeat_misses": 5},
                      execution_group={"nodes": [{"engine": "vllm", "block_size": BS,
                                                  "endpoints": [{"url": e.url} for e in engines]}]})
    try:
        async with running_server(cfg) as srv:
            c = srv.client
            await wait_until(lambda: srv.fleet.registry.adapters_anywhere() == ["math-lora", "sql-lora"], 10,
                             "adapters listed")
            listed = await c.models.list()
            assert [(m.id, getattr(m, "parent", None)) for m in listed.data] == [
                (srv.fleet.model_name, None), ("math-lora", srv.fleet.model_name), ("sql-lora", srv.fleet.model_name)]
            msgs = [{"role": "user", "content": "select every row"}]
            r = await c.chat.completions.create(model="sql-lora", messages=msgs, max_tokens=3)
            assert r.usage.completion_tokens == 3
            sent = [b for e in engines for b in e.requests]
            assert [b["model"] for b in sent] == ["sql-lora"] and isinstance(sent[0]["prompt"], list)  # token path
            tools = [{"type": "function", "function": {"name": "run_sql", "parameters": {}}}]
            r = await c.chat.completions.create(model="sql-lora", messages=msgs, tools=tools)
            assert r.choices[0].finish_reason == "tool_calls"
            assert [b["model"] for e in engines for b in e.chats] == ["sql-lora"]  # relayed, rewritten the same way
            # an adapter one server of two lists goes only there, whatever the load and the cache say
            r = await c.completions.create(model="math-lora", prompt="one plus one is", max_tokens=2,
                                           extra_body={"explain": True})
            assert [x["worker"] for x in r.model_extra["thunderagent"]["candidates"]] == [r.model_extra[
                "thunderagent"]["worker"]]  # the one candidate
            for k in range(8):
                prompt = [{"role": "user", "content": f"two plus {k}"}]
                await c.chat.completions.create(model="math-lora", messages=prompt, max_tokens=2)
                await c.chat.completions.create(model="math-lora", messages=prompt, tools=tools)
            assert [b["model"] for b in engines[0].requests + engines[0].chats].count("math-lora") == 0
            assert [b["model"] for b in engines[1].requests + engines[1].chats].count("math-lora") == 17
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="no-such-lora", messages=msgs, max_tokens=3)
            engines[0].adapters.append("math-lora")  # loaded at runtime on the other server too
            await wait_until(lambda: srv.fleet.registry.adapter("math-lora") == (2, 2), 15,
                             "the runtime-loaded adapter to be seen")
            r = await c.completions.create(model="math-lora", prompt="one plus one is", max_tokens=2,
                                           extra_body={"explain": True})
            assert len(r.model_extra["thunderagent"]["candidates"]) == 2  # now both may take it
    finally:
        for e in engines:
            await e.stop()


@pytest.mark.nats
async def test_adapters_cross_the_bus(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Over NATS the worker's heartbeats carry its server's adapters: the frontend process serves them."""
    from integration.nats_cluster import Cluster

    engine = FakeEngine(block_size=BS, adapters=["sql-lora"])
    await engine.start()
    cluster = Cluster(tmp_path)
    cluster.config.write_text(
        f"model: {tiny_model_dir}\ncontrol_plane: {{heartbeat_interval: 0.2, heartbeat_misses: 5}}\n"
        f"execution_group:\n  nodes:\n    - {{engine: vllm, block_size: {BS}, "
        f"endpoints: [{{url: \"{engine.url}\"}}]}}\n")
    try:
        cluster.start_nats()
        cluster.start_worker("w0")
        cluster.start_frontend("fa")
        client = cluster.client("fa")

        def served() -> list[str]:  # (blocking HTTP: called off the loop, which serves the fake engine)
            try:
                return [m.id for m in client.models.list().data]
            except openai.APIConnectionError:
                return []

        async def listed() -> list[str]:
            return await asyncio.to_thread(served)

        for _ in range(300):  # the frontend up, the worker met, its adapters heard (60 s at most)
            if "sql-lora" in await listed():
                break
            assert not cluster.exited("fa") and not cluster.exited("w0"), cluster.logs()
            await asyncio.sleep(0.2)
        assert await listed() == ["thunderagent-sim", "sql-lora"], cluster.logs()  # (model_name: the default)
        r = await asyncio.to_thread(client.completions.create, model="sql-lora", prompt="select", max_tokens=2)
        assert r.usage is not None and r.usage.completion_tokens == 2
        assert engine.requests[-1]["model"] == "sql-lora"
        # Anthropic's Messages API crosses the bus too: the client's body in the worker's request, the
        # server's message back
        base = str(client.base_url).rstrip("/").removesuffix("/v1")
        with anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=30) as a:
            m = await asyncio.to_thread(a.messages.create, model="sql-lora", max_tokens=3,
                                        messages=[{"role": "user", "content": "select"}])
        assert m.content[0].text == "ok" and m.stop_reason == "end_turn"
        assert engine.messages[-1]["model"] == "sql-lora" and engine.messages[-1]["max_tokens"] == 3
        # vLLM's paths that generate nothing, and a stored response's read (a GET), cross it as well
        e = await asyncio.to_thread(client.embeddings.create, model="sql-lora", input="x", encoding_format="float")
        assert e.data[0].embedding == [0.5, 0.25] and engine.pooled[-1] == ("/v1/embeddings", {
            "model": "sql-lora", "input": "x", "encoding_format": "float"})
        made = await asyncio.to_thread(client.responses.create, model="thunderagent-sim", input="hi")
        got = await asyncio.to_thread(client.responses.retrieve, made.id)
        assert got.id == made.id and engine.reads == [f"/v1/responses/{made.id}"]
    finally:
        cluster.close()
        await engine.stop()
