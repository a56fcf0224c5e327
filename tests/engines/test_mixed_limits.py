"""A fleet of vLLM servers with different ``max_model_len`` (a long-context pool beside a short one):
each server states its limit from its model card, routing sends it only what it holds, and the
frontend refuses up front what none holds. Real sockets on 127.0.0.1: two fake vLLM servers
(``support.fake_engine``) and ThunderAgent's real HTTP server with the tiny model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from integration.conftest import test_config as make_config
from support.fake_engine import FakeEngine
from support.server import Server, running_server
from support.waiting import wait_until
from thunderagent.frontend.tokenizer import ChatMessage

BS = 16


def _text(srv: Server, tokens: int, tag: str) -> tuple[str, int]:
    """The longest user message of numbered words whose chat prompt is at most ``tokens`` tokens, and
    its exact length."""
    def length(k: int) -> int:
        return len(srv.tokenizer.apply_chat_template([ChatMessage("user", words(k))]))

    def words(k: int) -> str:
        return tag + " " + " ".join(str(i) for i in range(k))

    lo, hi = 0, tokens  # a word is at least one token
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(mid) <= tokens else (lo, mid - 1)
    return words(lo), length(lo)


async def _chat(s: aiohttp.ClientSession, srv: Server, content: str, max_tokens: int | None) -> tuple[int, dict, str]:
    async with s.get(srv.base_url + "/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": content}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    async with s.post(srv.base_url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json(content_type=None), r.headers.get("x-thunderagent-worker", "")


async def test_each_server_gets_only_what_its_max_model_len_holds(tiny_model_dir: Path) -> None:
    small, big = FakeEngine(block_size=BS, max_model_len=256), FakeEngine(block_size=BS, max_model_len=4096)
    for e in (small, big):
        await e.start()
    cfg = make_config(model=str(tiny_model_dir),
                      control_plane={"heartbeat_interval": 0.1, "heartbeat_misses": 5, "default_max_tokens": 16},
                      execution_group={"nodes": [{"engine": "vllm", "block_size": BS,
                                                  "endpoints": [{"url": small.url}, {"url": big.url}]}]})
    try:
        async with running_server(cfg) as srv, aiohttp.ClientSession() as s:
            await wait_until(lambda: srv.fleet.max_context_tokens == 4096, 10, "both servers stated their limit")
            async with s.get(srv.base_url + "/health") as r:  # what an operator sees
                health = await r.json()
            assert {w["id"]: (w["max_seq_tokens"], w["max_prompt_tokens"]) for w in health["workers"]} == {
                "worker-0": (256, None), "worker-1": (4096, None)}
            seen = set()
            for i in range(12):  # short ones: both serve (first: routing balances on recent prefill traffic)
                got, answer, worker = await _chat(s, srv, f"short {i}", 4)
                assert got == 200, answer
                seen.add(worker)
            assert seen == {"worker-0", "worker-1"}
            for i in range(4):  # ~400 tokens: only the long-context server holds them
                text, n = _text(srv, 400, f"long{i}")
                assert 300 < n <= 400
                got, answer, worker = await _chat(s, srv, text, 8)
                assert got == 200 and answer["usage"]["completion_tokens"] == 8, answer
                assert worker == "worker-1"
            # no max_tokens asked: the default (16) is cut to what fits the largest server, as vLLM's default
            text, n = _text(srv, 4090, "fill")
            assert 4096 - 16 < n < 4096
            got, answer, worker = await _chat(s, srv, text, None)
            assert got == 200 and worker == "worker-1" and answer["usage"]["completion_tokens"] == 4096 - n, answer
            # asked for more than any server holds: a clear 400 before anything is sent
            sent = len(small.requests) + len(big.requests)
            got, err, _ = await _chat(s, srv, text, 200)
            assert got == 400 and err["error"]["code"] == "context_length_exceeded", err
            assert "4096" in err["error"]["message"]
            assert len(small.requests) + len(big.requests) == sent
            assert all(len(b["prompt"]) + b["max_tokens"] <= 256 for b in small.requests)
    finally:
        for e in (small, big):
            await e.stop()
