"""A pooling model behind ThunderAgent: a real vLLM server (CPU build) running the tiny random Llama as an
embedding model (``--runner pooling --convert embed``) that demands an API key (``--api-key``); its embeddings,
pooling and score paths answer through ThunderAgent exactly as they answer directly (ThunderAgent sends the key
from the endpoint's ``api_key_env``), and the official ``openai`` client's embeddings call works."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.engines.conftest import engine_python, front_config, one_server, thunderagent
from tests.engines.vllm_env import VllmServer, cpu_binding
from thunderagent.config import parse_config

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
