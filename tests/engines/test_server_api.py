"""The rest of vLLM's API in front of a vLLM fleet: pooling, scoring and the server's tokenizer relayed to a server
that serves the model (``frontend/server_api.py``), and stored responses read and cancelled where they are stored
(``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``), found on every server when this frontend does
not know the id (another frontend answered it), kept to their tenant with API keys on.

Real sockets on 127.0.0.1: two fake vLLM servers (``support.fake_engine``), ThunderAgent's real HTTP server (two of
them in front of the same servers for the search), the official ``openai`` client and aiohttp. (The same paths on
a real vLLM server: ``test_real_vllm_relay.py``.)"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import aiohttp
import openai
import pytest

from integration.conftest import test_config as make_config
from support.fake_engine import FakeEngine, fake_vllm_config
from support.server import relayed_counts, running_server
from support.waiting import wait_until
from thunderagent.types import SERVER_PATHS

BS = 16
KEY_A, KEY_B = "sk-tenant-a-0123456789abcdef", "sk-tenant-b-0123456789abcdef"


async def _engines(n: int = 2) -> list[FakeEngine]:
    engines = [FakeEngine(block_size=BS) for _ in range(n)]
    for e in engines:
        await e.start()
    return engines


async def _post(base: str, path: str, body: object, key: str | None = None) -> tuple[int, dict, dict[str, str]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def test_pooling_scoring_and_tokenizer_paths_reach_a_server_of_the_model(tiny_model_dir: Path) -> None:
    engines = await _engines()
    try:
        async with running_server(fake_vllm_config(engines, tiny_model_dir, BS)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            model, base = srv.fleet.model_name, srv.base_url
            urls = {e.url for e in engines}
            for path in SERVER_PATHS:
                status, body, headers = await _post(base, path, {"model": model, "input": f"text for {path}",
                                                                 "priority": 2, "program_id": "p"})
                assert status == 200, (path, body)
                assert body["served_by"] in urls and body["model"] == "fake-model"  # the server's own name
                assert headers["x-thunderagent-worker"] in {w.worker_id for w in srv.fleet.routable()}
            pooled = [(p, b) for e in engines for p, b in e.pooled]
            assert sorted(p for p, _ in pooled) == sorted(SERVER_PATHS)  # each once, as sent
            sent = dict(pooled)["/v1/embeddings"]
            # ThunderAgent's fields do not reach the server (no priority scheduling on these servers)
            assert sent == {"model": "fake-model", "input": "text for /v1/embeddings"}
            # the official client's embeddings call
            emb = await srv.client.embeddings.create(model=model, input=["a", "b"], encoding_format="float")
            assert emb.data[0].embedding == [0.5, 0.25]
            # no model named: the fleet's (vLLM takes it so too)
            status, body, _ = await _post(base, "/tokenize", {"prompt": "hi"})
            assert status == 200 and body["model"] == "fake-model"
            # no program step was counted (these generate nothing)
            assert srv.fleet.programs.get("p") is None
            counts = relayed_counts(srv.fleet)
            assert counts["v1/embeddings"] == 2 and counts["tokenize"] == 2 and counts["rerank"] == 1
            # the server's refusal passes as it is, with its status
            status, body, _ = await _post(base, "/v1/embeddings", {"model": model, "input": "x", "fail": True})
            assert status == 400 and body["error"]["message"] == "bad input"
            # ours: a model no server serves, a body that is not an object, a query parameter
            status, body, _ = await _post(base, "/v1/embeddings", {"model": "other", "input": "x"})
            assert status == 404 and body["error"]["code"] == "model_not_found"
            status, body, _ = await _post(base, "/score", ["not", "an", "object"])
            assert status == 400 and body["error"]["type"] == "invalid_request_error"
            status, body, _ = await _post(base, "/rerank?top_n=3", {"model": model, "query": "q", "documents": []})
            assert status == 400 and body["error"]["param"] == "top_n"
            assert sum(len(e.pooled) for e in engines) == len(SERVER_PATHS) + 3  # the refused ones never left
    finally:
        for e in engines:
            await e.stop()


async def _routed(base: str, path: str, body: dict) -> tuple[str, int]:
    """The worker a request went to, and the blocks the router believed it held (its explanation)."""
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body,
                                                    headers={"x-thunderagent-explain": "1"}) as r:
        assert r.status == 200, await r.text()
        explained = json.loads(r.headers["x-thunderagent-explanation"])
        return r.headers["x-thunderagent-worker"], explained["overlap_blocks"]


async def test_embeddings_are_routed_on_the_cache_of_their_first_input(tiny_model_dir: Path) -> None:
    """An embedding, pooling or classification request's first input (text tokenized as vLLM does, or token ids) is
    hashed and routed on the cache as a prompt is: inputs sharing a long instruction go where it was sent; the
    router's prediction holds its blocks (``add_special_tokens`` false: tokenized without them). Where the tokens vLLM
    runs are not known here (a truncation, padding, chat messages) and on the scoring paths, a request is routed on
    load, its overlap 0."""
    from thunderagent.frontend.hf_tokenizer import HfTokenizer

    engines = await _engines()
    doc = "Represent this passage for retrieval by the search team, with its title and context: " * 3
    tok = HfTokenizer(tiny_model_dir)
    full = len(tok.encode(doc)) // BS
    assert full >= 3

    try:
        async with running_server(fake_vllm_config(engines, tiny_model_dir, BS)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            model = srv.fleet.model_name
            routed = functools.partial(_routed, srv.base_url)
            home, overlap = await routed("/v1/embeddings", {"model": model, "input": [doc + "first", "other"]})
            assert overlap == 0 and srv.fleet.index.num_blocks(home) >= full - 1
            for k in range(5):
                w, overlap = await routed("/v1/embeddings", {"model": model, "input": f"{doc} query {k}"})
                assert w == home and overlap >= full - 1, (k, w, overlap)
            ids = tok.encode(doc)
            assert await routed("/pooling", {"model": model, "input": ids}) == (home, len(ids) // BS)
            w, overlap = await routed("/classify", {"model": model, "input": [ids, [1, 2]]})
            assert (w, overlap) == (home, len(ids) // BS)
            # without special tokens: the ids vLLM runs then (this tokenizer adds none anyway: the same blocks)
            assert tok.encode_many([doc], special=False)[0] == tok.encode(doc)
            w, overlap = await routed("/v1/embeddings", {"model": model, "input": doc, "add_special_tokens": False})
            assert w == home and overlap >= full - 1
            for body in ({"input": doc, "truncate_prompt_tokens": 8}, {"input": doc, "padding": "max_length"},
                         {"messages": [{"role": "user", "content": doc}]}, {"input": [{"not": "text"}]}):
                assert (await routed("/v1/embeddings", {"model": model, **body}))[1] == 0, body
            assert (await routed("/score", {"model": model, "text_1": doc, "text_2": ["a"]}))[1] == 0
    finally:
        for e in engines:
            await e.stop()


async def test_a_tenants_token_limit_charges_an_embeddings_input_its_tokens(tiny_model_dir: Path) -> None:
    """A token limit takes embedding inputs tokenized here (for routing anyway: a batch's other texts in the same
    ``encode_many`` call; without special tokens when the body leaves them out) for their exact tokens, a batch of
    token-id lists for their lengths; what is not known here (a mixed batch, padding, a truncation) an estimate of
    the body."""
    from thunderagent.frontend.hf_tokenizer import HfTokenizer
    from thunderagent.frontend.tenant_gate import GATE_KEY

    engines = await _engines()
    text = "an input to embed, charged by its own tokens " * 5
    n = len(HfTokenizer(tiny_model_dir).encode(text))
    try:
        cfg = fake_vllm_config(engines, tiny_model_dir, BS, control={
            "api_keys": {KEY_A: "acme"}, "tenant_limits": {"acme": {"tokens_per_min": 1, "token_burst": 100000}}})
        async with running_server(cfg) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            limiter = srv.app[GATE_KEY].limiter  # type: ignore[index]

            def left() -> float:
                return limiter.tokens_left("acme", asyncio.get_running_loop().time())

            nb = len(HfTokenizer(tiny_model_dir).encode("b"))
            n_bare = len(HfTokenizer(tiny_model_dir).encode_many([text], special=False)[0])
            for body, charge in (({"input": text}, n), ({"input": [text]}, n), ({"input": [text, "b"]}, n + nb),
                                 ({"input": [[5, 6, 7], [8, 9]]}, 5), ({"input": [5, 6, 7]}, 3),
                                 ({"input": text, "add_special_tokens": False}, n_bare),
                                 ({"input": [text, [5, 6]]}, None), ({"input": text, "padding": "max_length"}, None),
                                 ({"input": text, "truncate_prompt_tokens": 8}, None)):
                before = left()
                raw = json.dumps({"model": srv.fleet.model_name, **body}).encode()
                status, _, _ = await _post(srv.base_url, "/v1/embeddings", json.loads(raw), KEY_A)
                assert status == 200
                want = charge if charge is not None else -(-len(raw) // 4)
                assert before - left() == pytest.approx(want, abs=1), body
    finally:
        for e in engines:
            await e.stop()


async def test_a_server_that_stops_leaves_the_others_to_answer(tiny_model_dir: Path) -> None:
    engines = await _engines()
    try:
        async with running_server(fake_vllm_config(engines, tiny_model_dir, BS)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            await engines[0].stop()
            for k in range(6):  # a request sent to the stopped one is routed again, never lost
                status, body, _ = await _post(srv.base_url, "/v1/embeddings", {"input": f"x{k}"})
                assert status == 200 and body["served_by"] == engines[1].url
    finally:
        await engines[1].stop()


async def test_stored_responses_are_read_where_they_are_stored_through_any_frontend(tiny_model_dir: Path) -> None:
    engines = await _engines()
    try:
        cfg = fake_vllm_config(engines, tiny_model_dir, BS)
        async with running_server(cfg) as one, running_server(cfg) as two:
            for srv in (one, two):
                await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            model = one.fleet.model_name
            made = [await one.client.responses.create(model=model, input=f"conversation {k}") for k in range(4)]
            for r in made:  # read through the frontend that relayed it: straight to its server
                got = await one.client.responses.retrieve(r.id)
                assert got.id == r.id and got.output[0].content[0].text == "ok"
            reads = sum(len(e.reads) for e in engines)
            assert reads == 4  # no search: each read went to the server storing it
            # the other frontend never saw these: it asks the servers, then remembers
            for r in made:
                assert (await two.client.responses.retrieve(r.id)).id == r.id
                follow = await two.client.responses.create(model=model, input="and then?", previous_response_id=r.id)
                owner = next(e for e in engines if r.id in e._answered)
                assert follow.id in owner._answered  # continued on the server that stored it
            # a cancel reaches the server storing it, whose refusal (not a background response) passes through
            with pytest.raises(openai.BadRequestError) as refused:
                await one.client.responses.cancel(made[0].id)
            assert "synchronous" in refused.value.body["message"]
            assert any(p.endswith(f"{made[0].id}/cancel") for e in engines for p in e.reads)
            with pytest.raises(openai.NotFoundError) as missing:
                await one.client.responses.retrieve("resp_nowhere")
            assert "resp_nowhere" in missing.value.body["message"]
            # a streamed read replays the stored events (a background response's), from starting_after on, through
            # either frontend (the official client's retrieve(stream=True) sends this query)
            for srv in (one, two):
                events = [e async for e in await srv.client.responses.retrieve(made[1].id, stream=True)]
                assert [e.type for e in events] == ["response.created", "response.output_text.delta",
                                                    "response.completed"]
                later = [e async for e in await srv.client.responses.retrieve(made[1].id, stream=True,
                                                                              starting_after=0)]
                assert [e.sequence_number for e in later] == [1, 2]
            async with aiohttp.ClientSession() as s:
                for query, param in (("stream=maybe", "stream"), ("starting_after=3", "starting_after"),
                                     ("stream=true&starting_after=-1", "starting_after"), ("include=x", "include")):
                    async with s.get(one.base_url + f"/v1/responses/{made[1].id}?{query}") as resp:
                        assert resp.status == 400 and (await resp.json())["error"]["param"] == param, query
                async with s.post(one.base_url + f"/v1/responses/{made[1].id}/cancel?stream=true") as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["param"] == "stream"
                async with s.get(one.base_url + "/v1/responses/bad%20id") as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["param"] == "response_id"
    finally:
        for e in engines:
            await e.stop()


async def test_with_api_keys_a_tenant_reads_only_its_own_responses(tiny_model_dir: Path) -> None:
    engines = await _engines()
    try:
        cfg = fake_vllm_config(engines, tiny_model_dir, BS, control={"api_keys": {KEY_A: "acme", KEY_B: "globex"}})
        async with running_server(cfg) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            model = srv.fleet.model_name
            a = openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY_A, max_retries=0)
            b = openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY_B, max_retries=0)
            try:
                r = await a.responses.create(model=model, input="acme's secret plan")
                assert (await a.responses.retrieve(r.id)).id == r.id
                reads = sum(len(e.reads) for e in engines)
                for call in (lambda: b.responses.retrieve(r.id),
                             lambda: b.responses.create(model=model, input="x", previous_response_id=r.id),
                             lambda: a.responses.retrieve("resp_from_elsewhere")):
                    with pytest.raises(openai.NotFoundError) as missing:
                        await call()
                    assert "no stored response" in missing.value.body["message"]
                assert sum(len(e.reads) for e in engines) == reads  # nothing was looked for, nothing sent
                # pooling paths count against the tenant like any request
                status, body, _ = await _post(srv.base_url, "/v1/embeddings", {"input": "x"}, KEY_A)
                assert status == 200
            finally:
                await a.close()
                await b.close()
    finally:
        for e in engines:
            await e.stop()


async def test_a_simulated_fleet_says_it_has_no_server_to_relay_to() -> None:
    async with running_server(make_config()) as srv:
        status, body, _ = await _post(srv.base_url, "/v1/embeddings", {"input": "x"})
        assert status == 404 and "has none to relay to" in body["error"]["message"]
        with pytest.raises(openai.NotFoundError) as missing:
            await srv.client.responses.retrieve("resp_1")
        assert "has none to relay to" in missing.value.body["message"]


async def test_a_vllm_fleet_whose_servers_demand_a_key(tiny_model_dir: Path, monkeypatch) -> None:
    """vLLM's ``--api-key``: the token path, the relayed paths and the polls all carry the endpoint's key."""
    monkeypatch.setenv("VLLM_KEY", "sk-vllm-0123456789")
    engines = [FakeEngine(block_size=BS, api_key="sk-vllm-0123456789")]
    await engines[0].start()
    try:
        cfg = fake_vllm_config(engines, tiny_model_dir, BS)
        data = cfg.model_dump(mode="json")
        data["execution_group"]["nodes"][0]["endpoints"][0]["api_key_env"] = "VLLM_KEY"
        from thunderagent.config import parse_config

        async with running_server(parse_config(data, "test")) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 1, 10, "the server routable")
            model = srv.fleet.model_name
            r = await srv.client.completions.create(model=model, prompt="hello there", max_tokens=3)  # token path
            assert r.usage.completion_tokens == 3 and engines[0].requests
            status, body, _ = await _post(srv.base_url, "/tokenize", {"prompt": "hi"})  # a relayed path
            assert status == 200 and engines[0].pooled == [("/tokenize", {"model": "fake-model", "prompt": "hi"})]
    finally:
        await engines[0].stop()


async def test_a_clients_trace_context_reaches_the_server_on_every_path(tiny_model_dir: Path) -> None:
    """``traceparent`` / ``tracestate`` / ``x-request-id`` go on with the token path, relayed requests and vLLM's
    other paths; a malformed ``traceparent`` does not, and no other client header does."""
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    engines = await _engines(1)
    try:
        async with running_server(fake_vllm_config(engines, tiny_model_dir, BS)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 1, 10, "the server routable")
            c, model = srv.client, srv.fleet.model_name
            traced = {"traceparent": parent, "x-request-id": "req-7"}
            await c.completions.create(model=model, prompt="hello", max_tokens=2, extra_headers=traced)  # token path
            await c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                            logprobs=True, extra_headers=traced)  # relayed (logprobs)
            async with aiohttp.ClientSession() as s:
                async with s.post(srv.base_url + "/tokenize", json={"prompt": "hi"}, headers=traced) as r:
                    assert r.status == 200
                async with s.post(srv.base_url + "/tokenize", json={"prompt": "hi"},
                                  headers={"traceparent": "not-a-parent", "x-custom": "no"}) as r:
                    assert r.status == 200
            seen = engines[0].traced
            assert seen[:3] == [("/v1/completions", parent, "req-7"), ("/v1/chat/completions", parent, "req-7"),
                                ("/tokenize", parent, "req-7")]
            assert seen[3] == ("/tokenize", None, None)
    finally:
        await engines[0].stop()
