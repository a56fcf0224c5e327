"""A live server with the model's tokenizer: long prompts tokenized on the tokenize pool, a conversation's next turn
reusing the previous turn's ids, both counted on ``/metrics`` (``frontend/tokenize_pool.py``, ``token_cache.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from support.server import running_server
from thunderagent.config import parse_config
from thunderagent.frontend.hf_tokenizer import HfTokenizer


def _config(model_dir: Path, tokenizer: dict) -> object:
    return parse_config({"model": str(model_dir), "model_name": "tiny", "control_plane": {"tokenizer": tokenizer},
                         "execution_group": {"nodes": [{"count": 2, "block_size": 16, "timing": {"speedup": 20.0}}]}})


def _samples(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(thunderagent_tokeni[a-z_]+) (\S+)$", text, re.M)}


@pytest.mark.parametrize("threads", [2, 0])
async def test_long_prompts_are_tokenized_on_the_pool_and_reused_by_the_next_turn(tiny_model_dir: Path,
                                                                                   threads: int) -> None:
    cfg = _config(tiny_model_dir, {"threads": threads, "offload_bytes": 1024} if threads else {"threads": 0})
    turns = [[{"role": "system", "content": "the router sends every request " * 200},
              {"role": "user", "content": "first question"}]]
    turns.append([*turns[0], {"role": "assistant", "content": "first answer"},
                  {"role": "user", "content": "second question"}])
    async with running_server(cfg) as srv:  # type: ignore[arg-type]
        for msgs in [*turns, [{"role": "user", "content": "short"}]]:
            out = await srv.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
            assert out.choices[0].finish_reason in ("stop", "length")
        async with aiohttp.ClientSession() as s, s.get(srv.base_url + "/metrics") as r:
            got = _samples(await r.text())
    first = len(HfTokenizer(tiny_model_dir, prefix_cache_bytes=0).apply_openai_chat({"messages": turns[0]}))
    mine = HfTokenizer(tiny_model_dir)  # the same two turns here: what the server's cache holds after them
    for msgs in turns:
        mine.apply_openai_chat({"messages": msgs})
    assert mine.cache is not None and len(mine.cache) == 1
    assert got == {
        "thunderagent_tokenize_offloaded_total": 2.0 if threads else 0.0,  # (the short one stays on the loop)
        "thunderagent_tokenizer_prefix_cache_enabled": 1.0,
        "thunderagent_tokenizer_prefix_lookups_total": 2.0,  # (the short prompt is tokenized whole, not looked up)
        "thunderagent_tokenizer_prefix_hits_total": 1.0,
        # the second turn reused the first's ids but its last (the newline after "<|assistant|>", now followed by
        # the answer)
        "thunderagent_tokenizer_prefix_reused_tokens_total": float(first - 1),
        "thunderagent_tokenizer_prefix_cache_bytes": float(mine.cache.nbytes),  # the second turn's text and ids
    }, got


async def test_the_cache_can_be_turned_off(tiny_model_dir: Path) -> None:
    async with running_server(_config(tiny_model_dir, {"prefix_cache_mb": 0})) as srv:  # type: ignore[arg-type]
        async with aiohttp.ClientSession() as s, s.get(srv.base_url + "/metrics") as r:
            assert _samples(await r.text()) == {"thunderagent_tokenize_offloaded_total": 0.0,
                                                "thunderagent_tokenizer_prefix_cache_enabled": 0.0}
