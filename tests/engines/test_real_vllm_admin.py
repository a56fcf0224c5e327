"""A real vLLM server added to a running ``serve`` (``POST /v1/admin/workers``) with its KV-event sockets: it is
routed to, its events fill the index, and a removal drains it and purges its entries (CPU build, tiny model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.waiting import wait_until
from tests.engines.conftest import front_config, thunderagent
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer
from thunderagent.config import parse_config
from thunderagent.frontend.hf_tokenizer import HfTokenizer
from thunderagent.kv.hashing import block_hashes, hash_seed

pytestmark = pytest.mark.real_engine

ADMIN = "/v1/admin/workers"
PROMPT = "The operator added this server while the frontend was serving. " * 12


def _admin_config(model_dir: Path, servers: list[VllmServer]):  # type: ignore[no-untyped-def]
    cfg = front_config(model_dir, servers)
    return cfg.model_copy(update={"control_plane": cfg.control_plane.model_copy(update={"admin_api": True})})


async def _cached_somewhere(front, model_dir: Path, prompt: str) -> tuple[list[int], str]:  # type: ignore[no-untyped-def]
    """``prompt`` sent once: its block hashes and the worker that served it, once its blocks are in the index."""
    hashes = block_hashes(HfTokenizer(model_dir).encode(prompt), BLOCK_SIZE, hash_seed())
    raw = await front.client.completions.with_raw_response.create(model=front.model, prompt=prompt, max_tokens=2)
    home = raw.headers["x-thunderagent-worker"]
    await wait_until(lambda: front.fleet.index.is_confirmed(home, hashes[-1]), 20, "the prompt's blocks indexed")
    return hashes, home


async def test_a_vllm_server_added_at_runtime_is_routed_to_indexed_and_drained(
        tiny_model_dir: Path, vllm_servers: list[VllmServer]) -> None:
    first, added = vllm_servers
    cfg = front_config(tiny_model_dir, [first])
    cfg = cfg.model_copy(update={"control_plane": cfg.control_plane.model_copy(update={"admin_api": True})})
    async with thunderagent(cfg, [first]) as front, aiohttp.ClientSession() as s:
        fleet, base = front.fleet, front.base_url
        async with s.post(base + ADMIN, json=added.endpoint()) as r:
            assert (r.status, await r.json()) == (201, {"id": "worker-1", "added": True})
        await wait_until(lambda: len(fleet.routable()) == 2, 30, "the added server to heartbeat")
        async with s.post(f"{base}{ADMIN}/worker-0/cordon") as r:
            assert r.status == 200
        raw = await front.client.completions.with_raw_response.create(
            model=front.model, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
        assert raw.headers["x-thunderagent-worker"] == "worker-1"
        hashes = block_hashes(HfTokenizer(tiny_model_dir).encode(PROMPT), BLOCK_SIZE, hash_seed())
        await wait_until(lambda: fleet.index.is_confirmed("worker-1", hashes[-1]), 20,
                         "the added server's KV events in the index")
        async with s.post(f"{base}{ADMIN}/worker-0/uncordon") as r:
            assert r.status == 200
        async with s.post(f"{base}{ADMIN}/worker-1/remove", json={"timeout_s": 30}) as r:
            assert (r.status, await r.json()) == (200, {"id": "worker-1", "removed": True, "requests_moved": 0,
                                                        "prefixes_handed_off": 0})
        assert fleet.index.num_blocks("worker-1") == 0 and sorted(fleet.workers) == ["worker-0"]
        raw = await front.client.completions.with_raw_response.create(model=front.model, prompt=PROMPT, max_tokens=2)
        assert raw.headers["x-thunderagent-worker"] == "worker-0"


async def test_a_prefix_cache_reset_reaches_the_vllm_servers(tiny_model_dir: Path,
                                                              vllm_servers: list[VllmServer]) -> None:
    """The fleet's reset on real vLLM servers (started with VLLM_SERVER_DEV_MODE=1): each answers success, the index
    is emptied, the prompt's next run finds nothing cached (vLLM's own count), and the engine's AllBlocksCleared,
    published with its next step, is applied in sequence."""
    cfg = _admin_config(tiny_model_dir, vllm_servers)
    prompt = "Before the weights change, the fleet cached this prompt on one server. " * 10
    async with thunderagent(cfg, vllm_servers) as front, aiohttp.ClientSession() as s:
        fleet, base = front.fleet, front.base_url
        hashes, home = await _cached_somewhere(front, tiny_model_dir, prompt)
        again = await front.client.completions.create(model=front.model, prompt=prompt, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        seq = fleet.index.last_seq(home)
        async with s.post(base + "/reset_prefix_cache") as r:  # vLLM's path, for the fleet
            assert (r.status, await r.json()) == (200, {"success": True, "workers": [
                {"id": "worker-0", "success": True}, {"id": "worker-1", "success": True}]})
        assert fleet.index.num_blocks(home) == 0
        raw = await front.client.completions.with_raw_response.create(model=front.model, prompt=prompt, max_tokens=2)
        assert raw.parse().usage.prompt_tokens_details.cached_tokens == 0  # vLLM's cache is empty too
        served = raw.headers["x-thunderagent-worker"]
        # the clear came with that request's step on its server (in order: the clear, then the new blocks)
        await wait_until(lambda: fleet.index.is_confirmed(served, hashes[-1]), 20, "the blocks indexed anew")
        if served == home:
            assert fleet.index.last_seq(home) > seq + 1


async def test_a_vllm_server_put_to_sleep_and_woken_through_the_fleet(tiny_model_dir: Path,
                                                                      vllm_servers: list[VllmServer]) -> None:
    """vLLM's sleep mode through ThunderAgent on real servers (VLLM_SERVER_DEV_MODE=1; on the CPU build a sleep pauses
    the scheduler and, from level 1, discards the prefix cache, while the weights stay where they are): the server
    answers as vLLM does, the index drops its entries, requests go to the awake server meanwhile, and once woken it
    serves again."""
    cfg = _admin_config(tiny_model_dir, vllm_servers)
    prompt = "An RL trainer puts this server to sleep between two rollouts. " * 10
    async with thunderagent(cfg, vllm_servers) as front, aiohttp.ClientSession() as s:
        try:
            fleet, base = front.fleet, front.base_url
            hashes, home = await _cached_somewhere(front, tiny_model_dir, prompt)
            other = next(w for w in fleet.workers if w != home)
            async with s.post(f"{base}/sleep?level=1&workers={home}") as r:
                assert (r.status, await r.json()) == (200, {"success": True, "workers": [
                    {"id": home, "success": True, "answer": {"status": "sleeping", "level": 1}}]})
            assert fleet.asleep == {home} and fleet.index.num_blocks(home) == 0
            async with s.get(base + "/is_sleeping") as r:
                got = await r.json()
            assert got["is_sleeping"] is False and {w["id"]: w["is_sleeping"] for w in got["workers"]} == {
                home: True, other: False}
            raw = await front.client.completions.with_raw_response.create(model=front.model, prompt=prompt,
                                                                          max_tokens=2, timeout=60)
            assert raw.headers["x-thunderagent-worker"] == other  # (its cache gone, the server held: the awake one)
            async with s.post(f"{base}/wake_up?workers={home}") as r:
                assert (r.status, await r.json()) == (200, {"success": True, "workers": [
                    {"id": home, "success": True, "answer": {"status": "awake", "tags": None}}]})
            assert fleet.asleep == set()
            async with s.get(base + "/is_sleeping") as r:
                assert (await r.json())["is_sleeping"] is False
            async with s.post(f"{base}{ADMIN}/{other}/cordon") as r:
                assert r.status == 200
            out = await front.client.completions.create(model=front.model, prompt=prompt, max_tokens=2)
            assert out.usage.completion_tokens == 2
            async with s.post(f"{base}/collective_rpc", json={"method": "get_model_dtype_not_a_method"}) as r:
                assert r.status == 502  # (vLLM's workers refuse an unknown method: its error comes back named)
            # put to sleep and woken behind ThunderAgent's back: vLLM's vllm:engine_sleep_state gauge tells the fleet
            server = next(v for v in vllm_servers if getattr(fleet.workers[home], "url", None) == v.url)
            async with s.post(f"{server.url}/sleep?level=0") as r:
                assert r.status == 200
            await wait_until(lambda: fleet.asleep == {home}, 20, "the fleet to read the server's sleep gauge")
            async with s.post(f"{server.url}/wake_up") as r:
                assert r.status == 200
            await wait_until(lambda: not fleet.asleep, 20, "the fleet to read the server awake")
            assert not fleet.paused  # (asleep, vLLM said it was paused too: that is the sleep mark's)
            # paused and resumed behind ThunderAgent's back: vLLM's /is_paused, read with the polls, tells the fleet
            async with s.post(f"{server.url}/pause?mode=keep&clear_cache=false") as r:
                assert r.status == 200
            await wait_until(lambda: fleet.paused == {home}, 20, "the fleet to read the server's /is_paused")
            async with s.post(f"{server.url}/resume") as r:
                assert r.status == 200
            await wait_until(lambda: not fleet.paused, 20, "the fleet to read the server resumed")
        finally:  # (the servers are shared with the tests after this one: never leave one asleep or paused)
            for v in vllm_servers:
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.post(f"{v.url}/wake_up") as r:
                        await r.read()
                    async with s.post(f"{v.url}/resume") as r:
                        await r.read()


def _held_config(model_dir: Path, servers: list[VllmServer]):  # type: ignore[no-untyped-def]
    """The servers behind the tracked gate: a server takes the next request only after the first token of the one it
    has, so with the servers paused the requests past one per server are held by ThunderAgent."""
    return parse_config({
        "model": str(model_dir), "model_name": "tiny", "routing": {"seed": 7},
        "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": 10, "admin_api": True},
        "scheduler": {"tracked_prefill_passes": 0.001},
        "execution_group": {"nodes": [{"engine": "vllm", "block_size": BLOCK_SIZE,
                                       "endpoints": [v.endpoint() for v in servers]}]},
    }, "test")


async def _abort_late_ones(s: aiohttp.ClientSession, base: str, sent: list[asyncio.Task[Any]]) -> None:
    """After a first ``/abort_requests``: vLLM's abort ends what its engine tracks, so a request still in its API
    server's preprocessing when the call came is missed and would wait out the pause (its metrics stand still while
    paused, so nothing tells when all arrived). Call again, as an operator would, until every request ended (for
    at most 30 s; nothing held is left to end)."""
    for _ in range(30):
        if not (await asyncio.wait(sent, timeout=1))[1]:
            return
        async with s.post(base + "/abort_requests", json={}) as r:
            answer = await r.json()
            assert r.status == 200 and answer["held_aborted"] == 0, answer


async def test_abort_requests_ends_the_servers_requests_and_the_held_ones_alike(
        tiny_model_dir: Path, vllm_servers: list[VllmServer]) -> None:
    """``/abort_requests`` through ThunderAgent on real vLLM servers (dev mode), paused with ``mode=keep`` so that
    requests wait in them: vLLM ends the requests it has (a relayed request's body is vLLM's own: ``finish_reason:
    abort``, nothing generated; on the token path vLLM's stream of such a request has no choice at all, read as
    aborted, not routed again), and the request ThunderAgent still held (the tracked gate holds the next one while
    each server has one before its first token) ends with the same fields."""
    cfg = _held_config(tiny_model_dir, vllm_servers)
    async with thunderagent(cfg, vllm_servers) as front, aiohttp.ClientSession() as s:
        fleet, base = front.fleet, front.base_url

        async def complete(k: int, extra: dict) -> tuple[int, dict]:
            body = {"model": front.model, "prompt": f"Request {k} waits for the weight update. " * 6,
                    "max_tokens": 8, **extra}
            async with s.post(base + "/v1/completions", json=body) as r:
                return r.status, await r.json()

        try:
            async with s.post(base + "/pause?mode=keep&clear_cache=false") as r:
                assert r.status == 200
            sent: list[asyncio.Task[tuple[int, dict]]] = []
            for k in range(4):  # until one is held (two may go to one server: routing, not the gate, picks)
                sent.append(asyncio.create_task(complete(k, {"logprobs": 1} if k == 0 else {})))  # the first: relayed
                await wait_until(lambda: fleet.dispatcher.held() + len(fleet._inflight) == len(sent), 20,
                                 "the request sent or held")
                if fleet.dispatcher.held():
                    break
            assert fleet.dispatcher.held() == 1 and not any(t.done() for t in sent)
            async with s.post(base + "/abort_requests", json={}) as r:
                answer = await r.json()
                assert r.status == 200 and answer["held_aborted"] == 1, answer
            await _abort_late_ones(s, base, sent)  # (seen in CI: the relayed one, sent a moment before the call)
            done = await asyncio.wait_for(asyncio.gather(*sent), 5)
            for status, out in done:  # vLLM's own (relayed), ThunderAgent's from vLLM's abort, and the held one
                choice = out["choices"][0]
                assert status == 200 and choice["finish_reason"] == "abort" and choice["text"] == "", out
                assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] > 20, out
                assert out["object"] == "text_completion" and out["id"].startswith("cmpl-"), out
        finally:  # (the servers are shared with the tests after this one: never leave one paused)
            for v in vllm_servers:
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.post(f"{v.url}/resume") as r:
                        await r.read()



def _events(text: str) -> list[tuple[str, dict]]:
    """An Anthropic event stream as (event, data) pairs, the message's id and model and the input counts taken out
    (compared apart)."""
    out = []
    for part in text.strip().split("\n\n"):
        head, data = part.split("\n", 1)
        doc = json.loads(data.removeprefix("data: "))
        for d in (doc, doc.get("message", {})):
            d.get("usage", {}).pop("input_tokens", None)
        doc.get("message", {}).pop("id", None)
        doc.get("message", {}).pop("model", None)
        out.append((head.removeprefix("event: "), doc))
    return out


def _openai_shape(text: str, stream: bool) -> list[tuple]:
    """What a chat or completion answer says, in order: each chunk's role / text / finish reason, a usage chunk,
    ``[DONE]`` (vLLM's bodies carry more null fields than ours; the shape and the values are what a client reads)."""
    docs = [json.loads(x[6:]) if x != "data: [DONE]" else None
            for x in text.strip().split("\n\n")] if stream else [json.loads(text)]
    out: list[tuple] = []
    for d in docs:
        if d is None:
            out.append(("done",))
            continue
        for c in d["choices"]:
            body = c.get("delta") or c.get("message") or {}
            out.append(("choice", body.get("role"), body.get("content", c.get("text")), c["finish_reason"]))
        if d.get("usage"):
            out.append(("usage", d["usage"]["completion_tokens"]))
    return out


#: (path, streamed) of every API a held request can be aborted on
_KINDS = [(path, stream) for path in ("/v1/messages", "/v1/chat/completions", "/v1/completions")
          for stream in (False, True)]


async def test_a_held_request_aborted_gets_the_answer_vllm_gives_one_it_aborted(
        tiny_model_dir: Path, vllm_servers: list[VllmServer]) -> None:
    """A request ``/abort_requests`` ends while ThunderAgent holds it gets what the real vLLM server answers for one
    it aborted while the request waited in its own queue (paused with ``mode=keep``), so that a client reads the
    same whichever queue held it: Anthropic's Messages API field for field but the id and model, chat and
    completions (relayed, as vLLM wrote them) chunk for chunk, JSON and streamed alike."""
    cfg = _held_config(tiny_model_dir, vllm_servers)
    tok = HfTokenizer(tiny_model_dir)

    def text(k: int) -> str:  # (k: prompts apart, so none is cached)
        return f"Request {k} waits for the weight update. " * 4

    def body(path: str, stream: bool, k: int, model: str) -> dict:
        if path == "/v1/completions":  # (logprobs: relayed, so the server's own answer comes back)
            return {"model": model, "prompt": text(k), "max_tokens": 8, "stream": stream, "logprobs": 1,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
        doc = {"model": model, "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": text(k)}]}
        if path == "/v1/chat/completions":
            doc.update(logprobs=True, **({"stream_options": {"include_usage": True}} if stream else {}))
        return doc

    def prompt_tokens(path: str, k: int) -> int:
        if path == "/v1/completions":
            return len(tok.encode(text(k)))
        return len(tok.apply_openai_chat({"messages": [{"role": "user", "content": text(k)}]}))

    answers: dict[tuple[bool, str, bool], tuple[int, str, int]] = {}  # (held?, path, streamed) -> status, body, k
    async with thunderagent(cfg, vllm_servers) as front, aiohttp.ClientSession() as s:
        fleet, base = front.fleet, front.base_url

        async def send(path: str, stream: bool, k: int) -> tuple[int, str]:
            async with s.post(base + path, json=body(path, stream, k, front.model)) as r:
                return r.status, await r.text()

        sent_before = 0
        for pair in (_KINDS[0:2], _KINDS[2:4], _KINDS[4:6]):  # a round each: one server takes one of each kind
            try:
                async with s.post(base + "/pause?mode=keep&clear_cache=false") as r:
                    assert r.status == 200
                sent: list[tuple[tuple[bool, str, bool], asyncio.Task[tuple[int, str]], int]] = []
                seen: set[tuple[bool, str, bool]] = set()
                while len(seen) < 4 and len(sent) < 12:  # (routing, not the gate, picks: two may go to one server)
                    path, stream = pair[len(sent) % 2]
                    before = fleet.dispatcher.held()
                    k = sent_before + len(sent)
                    task = asyncio.create_task(send(path, stream, k))
                    await wait_until(lambda n=len(sent) + 1: fleet.dispatcher.held() + len(fleet._inflight) == n, 20,
                                     "the request sent or held")
                    key = (fleet.dispatcher.held() > before, path, stream)
                    sent.append((key, task, k))
                    seen.add(key)
                assert len(seen) == 4 and not any(t.done() for _, t, _ in sent), seen
                held = fleet.dispatcher.held()
                async with s.post(base + "/abort_requests", json={}) as r:
                    assert r.status == 200 and (await r.json())["held_aborted"] == held >= 2
                await _abort_late_ones(s, base, [t for _, t, _ in sent])
                for key, task, k in sent:
                    status, answer = await asyncio.wait_for(task, 5)
                    answers.setdefault(key, (status, answer, k))
                sent_before += len(sent)
            finally:  # (the servers are shared with the tests after this one: never leave one paused)
                for v in vllm_servers:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with s.post(f"{v.url}/resume") as r:
                            await r.read()
    for path, stream in _KINDS:
        (s1, theirs, k1), (s2, ours, k2) = answers[False, path, stream], answers[True, path, stream]
        assert (s1, s2) == (200, 200), (path, stream, theirs, ours)
        if path != "/v1/messages":
            assert _openai_shape(ours, stream) == _openai_shape(theirs, stream), (path, stream, ours, theirs)
            usage = [json.loads(x) for x in (ours, theirs)] if not stream else [
                json.loads([x for x in a.split("\n\n") if '"usage":{' in x][-1][6:]) for a in (ours, theirs)]
            assert [u["usage"]["prompt_tokens"] for u in usage] == [prompt_tokens(path, k2), prompt_tokens(path, k1)]
            continue
        if stream:
            assert _events(ours) == _events(theirs), (ours, theirs)
            continue
        mine, vllms = json.loads(ours), json.loads(theirs)
        assert vllms.pop("id").startswith("chatcmpl-") and mine.pop("id").startswith("chatcmpl-")
        # vLLM names its served model (here the model's path); ThunderAgent the name the client asked for
        assert (mine.pop("model"), vllms.pop("model")) == ("tiny", str(tiny_model_dir)), (mine, vllms)
        assert (mine["usage"].pop("input_tokens"), vllms["usage"].pop("input_tokens")) == (
            prompt_tokens(path, k2), prompt_tokens(path, k1))  # each its own prompt's count
        assert mine == vllms and vllms["content"] == [{"type": "text", "text": ""}], (mine, vllms)
