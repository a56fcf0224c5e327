"""LoRA adapters by name against a real vLLM server (CPU build, tiny random Llama, a random rank-4 adapter
made here): ThunderAgent lists the server's adapter, serves it as a model name, and its prompts hash apart
from the base model's exactly as vLLM keys its cache (the server's KV events for the adapter's blocks match
the router's hashes; the base model's request with the same prompt matches nothing)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
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
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}"))
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
