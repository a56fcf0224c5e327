"""LoRA adapters by name against a real vLLM server (CPU build, tiny random Llama, a random rank-4 adapter
made here): ThunderAgent lists the server's adapter, serves it as a model name, and its prompts hash apart
from the base model's exactly as vLLM keys its cache (the server's KV events for the adapter's blocks match
the router's hashes; the base model's request with the same prompt matches nothing)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest

from support.waiting import wait_until
from tests.engines.conftest import engine_python, front_config, one_server, thunderagent
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer, cpu_binding
from thunderagent.frontend.hf_tokenizer import HfTokenizer
from thunderagent.kv.hashing import block_hashes, hash_seed

pytestmark = pytest.mark.real_engine

ADAPTER = "sql-lora"


def build_adapter(out: Path, model_dir: Path, rank: int = 4) -> Path:
    """A PEFT LoRA adapter of random weights on q_proj / v_proj of every layer of the tiny model."""
    from safetensors.numpy import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(layers):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) * 0.01).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((hidden, rank)) * 0.01).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": str(model_dir)}))
    return out


@pytest.fixture(scope="module")
def lora_server(engine_tmp: Path, tiny_model_dir: Path) -> Iterator[VllmServer]:
    workdir = engine_tmp / "vllm-lora"
    python = engine_python(workdir)
    adapter = build_adapter(workdir / ADAPTER, tiny_model_dir)
    server = VllmServer("lora", python, tiny_model_dir, workdir, cpu=cpu_binding(0), extra_args=(
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}"),
        extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})  # (adapters loaded through ThunderAgent: below)
    with one_server(server, "vLLM server with a LoRA adapter"):
        yield server


async def test_lora_adapter_by_name_on_real_vllm(tiny_model_dir: Path, lora_server: VllmServer) -> None:
    async with thunderagent(front_config(tiny_model_dir, [lora_server]), [lora_server]) as front:
        c, fleet = front.client, front.fleet
        listed = [m.id for m in (await c.models.list()).data]
        assert listed == [front.model, ADAPTER]
        prompt = "the router sends every request to the worker that already holds the longest cached prefix " * 6

        async def ask(model: str) -> tuple[int, int]:
            raw = await c.completions.with_raw_response.create(
                model=model, prompt=prompt, max_tokens=2, extra_headers={"x-thunderagent-explain": "1"},
                extra_body={"ignore_eos": True})
            out = raw.parse()
            cached = out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0
            return json.loads(raw.headers["x-thunderagent-explanation"])["overlap_blocks"], cached or 0

        assert await ask(ADAPTER) == (0, 0)  # first time: nothing cached for the adapter
        hashes = block_hashes(HfTokenizer(tiny_model_dir).encode(prompt), BLOCK_SIZE, hash_seed(None, ADAPTER))
        worker = next(iter(fleet.workers))
        await wait_until(lambda: fleet.index.is_confirmed(worker, hashes[-1]), 20,
                         "vLLM's events of the adapter's blocks, under the adapter's hashes")
        overlap, cached = await ask(ADAPTER)
        assert overlap == len(hashes) and cached == overlap * BLOCK_SIZE, (overlap, cached)  # as vLLM holds them
        assert await ask(front.model) == (0, 0)  # the base model shares nothing with the adapter's cache


async def test_an_adapter_loaded_and_unloaded_at_runtime_through_the_fleet(engine_tmp: Path, tiny_model_dir: Path,
                                                                           lora_server: VllmServer) -> None:
    """vLLM's ``/v1/load_lora_adapter`` through ThunderAgent (admin API on): the server loads it, the fleet serves
    its name at once and routes to the server holding it; unloaded, the name is refused again."""
    adapter = build_adapter(engine_tmp / "vllm-lora" / "runtime-lora", tiny_model_dir, rank=2)
    cfg = front_config(tiny_model_dir, [lora_server])
    cfg = cfg.model_copy(update={"control_plane": cfg.control_plane.model_copy(update={"admin_api": True})})
    async with thunderagent(cfg, [lora_server]) as front:
        c = front.client
        async with aiohttp.ClientSession() as s:
            async with s.post(front.base_url + "/v1/load_lora_adapter",
                              json={"lora_name": "runtime-lora", "lora_path": str(adapter)}) as r:
                assert (r.status, await r.json()) == (200, {"success": True, "workers": [
                    {"id": "worker-0", "success": True}]})
            assert [m.id for m in (await c.models.list()).data] == [front.model, *sorted([ADAPTER, "runtime-lora"])]
            out = await c.completions.create(model="runtime-lora", prompt="a runtime adapter", max_tokens=2)
            assert out.usage.completion_tokens == 2
            async with s.post(front.base_url + "/v1/load_lora_adapter",  # vLLM's refusal, passed on
                              json={"lora_name": "runtime-lora", "lora_path": str(adapter)}) as r:
                body = await r.json()
                assert r.status == 502 and "already been loaded" in body["workers"][0]["error"], body
            async with s.post(front.base_url + "/v1/unload_lora_adapter", json={"lora_name": "runtime-lora"}) as r:
                assert r.status == 200
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="runtime-lora", prompt="gone", max_tokens=2)
