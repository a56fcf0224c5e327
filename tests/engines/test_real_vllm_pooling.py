"""A pooling model behind ThunderAgent: a real vLLM server (CPU build) running the tiny random Llama as an
embedding model (``--runner pooling --convert embed``) that demands an API key (``--api-key``); its embeddings,
pooling and score paths answer through ThunderAgent exactly as they answer directly (ThunderAgent sends the key
from the endpoint's ``api_key_env``), and the official ``openai`` client's embeddings call works."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from support.waiting import wait_until
from tests.engines.conftest import engine_python, front_config, one_server, thunderagent
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer, cpu_binding
from thunderagent.config import parse_config
from thunderagent.frontend.hf_tokenizer import HfTokenizer
from thunderagent.kv.hashing import block_hashes, hash_seed

pytestmark = pytest.mark.real_engine
KEY = "sk-pooling-0123456789"


@pytest.fixture(scope="module")
def pooling_server(engine_tmp: Path, tiny_model_dir: Path) -> Iterator[VllmServer]:
    workdir = engine_tmp / "vllm-pooling"
    server = VllmServer("pooling", engine_python(workdir), tiny_model_dir, workdir, cpu=cpu_binding(0),
                        extra_args=("--runner", "pooling", "--convert", "embed", "--api-key", KEY))
    with one_server(server, "vLLM pooling server"):
        yield server


def _same(ours: dict, theirs: dict) -> None:
    """The same answer but for what each call makes anew (its id and time)."""
    drop = ("id", "created")
    assert {k: v for k, v in ours.items() if k not in drop} == {k: v for k, v in theirs.items() if k not in drop}


async def test_embeddings_pooling_and_scores_on_a_real_pooling_server(tiny_model_dir: Path,
                                                                      pooling_server: VllmServer, monkeypatch) -> None:
    served = str(tiny_model_dir)
    monkeypatch.setenv("POOLING_KEY", KEY)
    data = front_config(tiny_model_dir, [pooling_server]).model_dump(mode="json")
    data["execution_group"]["nodes"][0]["endpoints"][0]["api_key_env"] = "POOLING_KEY"
    keyed = {"Authorization": f"Bearer {KEY}"}
    asks = [("/v1/embeddings", {"input": ["the router", "the scheduler holds requests"]}),
            ("/pooling", {"input": "hello world"}),
            ("/score", {"text_1": "which worker holds the prefix?", "text_2": ["worker one", "worker two"]})]
    async with aiohttp.ClientSession() as s:
        async with s.post(pooling_server.url + "/v1/embeddings", json={"model": served, "input": "x"}) as r:
            assert r.status == 401  # the server demands its key
        direct = []
        for path, body in asks:
            async with s.post(pooling_server.url + path, json={"model": served, **body}, headers=keyed) as r:
                assert r.status == 200, (path, await r.text())
                direct.append(await r.json())
        async with thunderagent(parse_config(data, "test"), [pooling_server]) as front:
            for (path, body), theirs in zip(asks, direct):
                async with s.post(front.base_url + path, json={"model": front.model, **body}) as r:
                    assert r.status == 200, (path, await r.text())
                    assert r.headers["x-thunderagent-worker"] == next(iter(front.fleet.workers))
                    ours = await r.json()
                    # ThunderAgent's model name is the server's here (front_config names the model by its path)
                    _same(ours, theirs)
            # a batch's tokens as a tenant's token limit counts them: what the server says it prefilled
            from thunderagent.frontend.hf_tokenizer import HfTokenizer

            batch = asks[0][1]["input"]
            counted = sum(map(len, HfTokenizer(tiny_model_dir).encode_many(batch)))
            assert counted == direct[0]["usage"]["prompt_tokens"], (counted, direct[0]["usage"])
            bare = {"model": served, "input": batch, "add_special_tokens": False}
            async with s.post(pooling_server.url + "/v1/embeddings", json=bare, headers=keyed) as r:
                assert r.status == 200, await r.text()
                theirs_bare = (await r.json())["usage"]["prompt_tokens"]
            assert sum(map(len, HfTokenizer(tiny_model_dir).encode_many(batch, special=False))) == theirs_bare
            emb = await front.client.embeddings.create(model=front.model, input="the router",
                                                       encoding_format="float")
            assert emb.data[0].embedding == direct[0]["data"][0]["embedding"]
            bad = {"input": "the router", "dimensions": 7}  # not a matryoshka model: vLLM refuses it
            async with s.post(pooling_server.url + "/v1/embeddings", json={"model": served, **bad},
                              headers=keyed) as r:
                theirs_refusal = (r.status, await r.json())
            async with s.post(front.base_url + "/v1/embeddings", json={"model": front.model, **bad}) as r:
                assert (r.status, await r.json()) == theirs_refusal  # its own refusal, as it came
            assert theirs_refusal[0] == 400 and theirs_refusal[1]["error"]["message"]


async def test_embeddings_are_routed_on_the_pooling_servers_cache(tiny_model_dir: Path,
                                                                   pooling_server: VllmServer, monkeypatch) -> None:
    """The tiny Llama as an embedding model pools its last token, so vLLM caches its inputs' prefixes and publishes
    them in KV events: an embedding's first input, tokenized here as vLLM tokenizes it, is indexed under the very
    hashes the router computes (confirmed by the server's own events), a request sharing it is routed with those
    blocks as hits, and a token-id input is hashed as given."""
    monkeypatch.setenv("POOLING_KEY", KEY)
    data = front_config(tiny_model_dir, [pooling_server]).model_dump(mode="json")
    data["execution_group"]["nodes"][0]["endpoints"][0]["api_key_env"] = "POOLING_KEY"
    doc = "An instruction shared by every query of this retrieval job, long enough to fill some blocks. " * 4
    hashes = block_hashes(HfTokenizer(tiny_model_dir).encode(doc), BLOCK_SIZE, hash_seed())
    assert len(hashes) >= 4
    async with thunderagent(parse_config(data, "test"), [pooling_server]) as front, aiohttp.ClientSession() as s:
        home = next(iter(front.fleet.workers))
        async with s.post(front.base_url + "/v1/embeddings", json={"model": front.model, "input": [doc, "other"]}) as r:
            assert r.status == 200, await r.text()
        await wait_until(lambda: all(front.fleet.index.is_confirmed(home, h) for h in hashes), 20,
                         "the server's events to confirm the input's blocks under the router's hashes")
        async with s.post(front.base_url + "/v1/embeddings", json={"model": front.model, "input": doc + " query 2"},
                          headers={"x-thunderagent-explain": "true"}) as r:
            assert r.status == 200, await r.text()
            explained = json.loads(r.headers["x-thunderagent-explanation"])
        second = block_hashes(HfTokenizer(tiny_model_dir).encode(doc + " query 2"), BLOCK_SIZE, hash_seed())
        shared = next((k for k, (a, b) in enumerate(zip(hashes, second)) if a != b), min(len(hashes), len(second)))
        assert shared >= 3 and explained["overlap_blocks"] == shared, explained
        ids = HfTokenizer(tiny_model_dir).encode("token ids given as they are, " * 8)
        async with s.post(front.base_url + "/pooling", json={"model": front.model, "input": ids}) as r:
            assert r.status == 200, await r.text()
        ids_hashes = block_hashes(ids, BLOCK_SIZE, hash_seed())
        await wait_until(lambda: front.fleet.index.is_confirmed(home, ids_hashes[-1]), 20, "the token input indexed")
