"""A vLLM server run with ``--data-parallel-size 2``, listed once per rank (``data_parallel_rank``): each rank is a
worker of its own (its own prefix cache, fed by its own KV-event sockets), every request to a rank names it in
``X-data-parallel-rank`` (vLLM sends it to that engine), each rank's load is read from the metrics labelled with
it, and an operator's call on the servers reaches the server once for both ranks.

Real sockets on 127.0.0.1: a fake data-parallel vLLM server (``support.fake_dp``: two fake engines behind one HTTP
port, as vLLM's API server fronts its engine cores) and ThunderAgent's real HTTP server."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from support.fake_dp import FakeDpServer
from support.fake_engine import FakeEngine
from support.server import running_server
from support.waiting import wait_until
from thunderagent.config import ConfigError, parse_config
from thunderagent.frontend.hf_tokenizer import HfTokenizer

BS = 16


def _config(dp: FakeDpServer, model_dir: Path) -> object:
    from integration.conftest import test_config

    return test_config(
        model=str(model_dir), routing={"seed": 3},
        control_plane={"heartbeat_interval": 0.1, "heartbeat_misses": 5, "default_max_tokens": 16,
                       "admin_api": True},
        execution_group={"nodes": [{"engine": "vllm", "block_size": BS, "endpoints": dp.endpoints()}]})


async def test_each_rank_is_a_worker_named_on_its_requests_and_read_from_its_metrics(tiny_model_dir: Path) -> None:
    dp = FakeDpServer([FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)])
    await dp.start()
    try:
        async with running_server(_config(dp, tiny_model_dir)) as srv:
            fleet = srv.fleet
            await wait_until(lambda: len(fleet.routable()) == 2, 10, "both ranks routable")
            w0, w1 = sorted(fleet.workers)
            # each rank's load from its own samples (rank 1 runs 5, rank 0 none)
            dp.ranks[1].running = 5
            await wait_until(lambda: {w: fleet.workers[w].load().running for w in (w0, w1)} == {w0: 0, w1: 5}, 10,
                             "each rank's load read from its engine label")
            dp.ranks[1].running = 0
            # a prompt rank 1 holds: routed to its worker, and the server sends it to rank 1
            prompt = "a long shared system prompt that rank one has cached already " * 4
            ids = HfTokenizer(tiny_model_dir).encode(prompt)
            dp.ranks[1].cache_prompt(ids[: len(ids) // BS * BS])
            await wait_until(lambda: fleet.index.num_blocks(w1) >= len(ids) // BS, 10, "rank 1's events indexed")
            assert fleet.index.num_blocks(w0) == 0
            served = len(dp.ranks[1].requests)
            for k in range(3):
                raw = await srv.client.completions.with_raw_response.create(model=fleet.model_name,
                                                                            prompt=prompt + f" q{k}", max_tokens=2)
                assert raw.headers["x-thunderagent-worker"] == w1
            assert len(dp.ranks[1].requests) == served + 3
            posted = [rank for method, path, rank in dp.calls if path == "/v1/completions"]
            assert posted[-3:] == ["1", "1", "1"]
            # relayed (a field the token path lacks): the header goes with the client's body
            raw = await srv.client.completions.with_raw_response.create(
                model=fleet.model_name, prompt=prompt + " relayed", max_tokens=2, extra_body={"logprobs": 1})
            assert raw.headers["x-thunderagent-worker"] == w1
            assert [rank for _, path, rank in dp.calls if path == "/v1/completions"][-1] == "1"
            # an operator's pause: one call on the server for both ranks, each worker answered
            async with aiohttp.ClientSession() as s, s.post(srv.base_url + "/pause?mode=keep&clear_cache=false") as r:
                body = await r.json()
            assert r.status == 200 and [w["id"] for w in body["workers"]] == [w0, w1]
            assert [c for c in dp.calls if c[1].startswith("/pause")] == [("POST", "/pause?mode=keep&clear_cache=false",
                                                                           "0")]
            assert fleet.paused == {w0, w1}
            async with aiohttp.ClientSession() as s, s.post(srv.base_url + "/resume") as r:
                assert r.status == 200
            assert len([c for c in dp.calls if c[1] == "/resume"]) == 1 and not fleet.paused
    finally:
        await dp.stop()


@pytest.mark.parametrize(("endpoints", "message"), [
    ([{"url": "http://127.0.0.1:9"}, {"url": "http://127.0.0.1:9/"}], "is already execution_group.nodes.0.endpoints.0"),
    ([{"url": "http://127.0.0.1:9", "data_parallel_rank": 0}, {"url": "http://127.0.0.1:9"}],
     "listed with and without data_parallel_rank"),
    ([{"url": "http://127.0.0.1:9", "data_parallel_rank": 1}, {"url": "http://127.0.0.1:9", "data_parallel_rank": 1}],
     "rank 1 is already"),
])
def test_a_server_is_listed_once_or_once_per_rank(endpoints: list[dict], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"model": "/m", "execution_group": {"nodes": [{"engine": "vllm", "endpoints": endpoints}]}})
    with pytest.raises(ConfigError, match="data_parallel_rank: vLLM's"):
        parse_config({"model": "/m", "execution_group": {"nodes": [{"engine": "sglang", "endpoints": [
            {"url": "http://127.0.0.1:9", "data_parallel_rank": 0}]}]}})


async def test_a_rank_added_at_runtime_and_kept_across_a_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``POST /v1/admin/workers`` takes ``data_parallel_rank``: the rank joins as a worker of its own (its requests
    carry the header), a rank or a server already in the fleet is refused naming ``url``, and the state file keeps
    the rank for the next start."""
    dp = FakeDpServer([FakeEngine(block_size=BS) for _ in range(2)])
    await dp.start()
    state = tmp_path / "admin-state.json"
    rank0, rank1 = dp.endpoints()
    try:
        from integration.conftest import test_config

        cfg = test_config(model=str(tiny_model_dir), routing={"seed": 3},
                          control_plane={"heartbeat_interval": 0.1, "heartbeat_misses": 5, "admin_api": True,
                                         "default_max_tokens": 16, "admin_state_file": str(state)},
                          execution_group={"nodes": [{"engine": "vllm", "block_size": BS, "endpoints": [rank0]}]})
        for attempt in range(2):  # the second start restores the added rank from the state file
            async with running_server(cfg) as srv, aiohttp.ClientSession() as s:
                fleet = srv.fleet
                if attempt == 0:
                    async with s.post(srv.base_url + "/v1/admin/workers", json=rank1) as r:
                        assert (r.status, (await r.json())["id"]) == (201, "worker-1")
                    for body, words in ((rank1, "rank 1 is already worker worker-1"),
                                        ({**rank0, "data_parallel_rank": None}, "with and without data_parallel_rank")):
                        async with s.post(srv.base_url + "/v1/admin/workers", json=body) as r:
                            err = (await r.json())["error"]
                        assert r.status == 400 and err["param"] == "url" and words in err["message"], err
                await wait_until(lambda: len(fleet.routable()) == 2, 10, "both ranks routable")
                assert fleet.registry.info("worker-1").server == dp.url
                async with s.get(srv.base_url + "/v1/admin/workers") as r:
                    listed = {w["id"]: (w["url"], w["data_parallel_rank"]) for w in (await r.json())["data"]}
                assert listed == {"worker-0": (dp.url, 0), "worker-1": (dp.url, 1)}
                await s.post(srv.base_url + "/v1/admin/workers/worker-0/cordon")
                raw = await srv.client.completions.with_raw_response.create(model=fleet.model_name, prompt="hi",
                                                                            max_tokens=2)
                assert raw.headers["x-thunderagent-worker"] == "worker-1"
                assert [rank for _, path, rank in dp.calls if path == "/v1/completions"][-1] == "1"
                await s.post(srv.base_url + "/v1/admin/workers/worker-0/uncordon")
    finally:
        await dp.stop()


@pytest.mark.nats
async def test_over_nats_each_rank_is_a_worker_process_and_a_call_reaches_the_server_once(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each rank run by a ``thunderagent worker`` process of its own (``--endpoint K``): both join with their server
    named, a request goes to the rank that holds its prompt with the rank header, and a pause through a frontend
    process reaches the server once for both ranks (the frontend reads the shared server in the workers' hellos)."""
    pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")
    import asyncio
    import json as jsonlib
    import urllib.request

    from integration.nats_cluster import Cluster

    dp = FakeDpServer([FakeEngine(block_size=BS, dev_mode=True) for _ in range(2)])
    await dp.start()
    cluster = Cluster(tmp_path)
    cfg = tmp_path / "dp.yaml"
    cfg.write_text(jsonlib.dumps({"model": str(tiny_model_dir), "routing": {"seed": 3},
                                  "control_plane": {"admin_api": True, "heartbeat_interval": 0.2,
                                                    "heartbeat_misses": 5},
                                  "execution_group": {"nodes": [{"engine": "vllm", "block_size": BS,
                                                                 "endpoints": dp.endpoints()}]}}))
    try:
        cluster.start_nats()
        for k in range(2):
            cluster.start_worker(f"rank{k}", "--endpoint", str(k), config=cfg)
        port = cluster.start_frontend("fa", config=cfg)

        def healthy() -> set[str]:
            try:
                return {w["id"] for w in cluster.health("fa")["workers"] if w["health"] == "healthy"}
            except OSError:
                return set()

        for _ in range(600):
            if await asyncio.to_thread(healthy) == {"rank0", "rank1"}:
                break
            assert not any(cluster.exited(p) for p in cluster.procs if p != "nats"), cluster.logs()
            await asyncio.sleep(0.1)
        assert await asyncio.to_thread(healthy) == {"rank0", "rank1"}, cluster.logs()
        prompt = "a prompt that rank one has cached already, long enough for blocks " * 3
        ids = HfTokenizer(tiny_model_dir).encode(prompt)
        dp.ranks[1].cache_prompt(ids[: len(ids) // BS * BS])
        await asyncio.sleep(1.0)  # (the events reach the frontend through rank1's process)
        raw = await asyncio.to_thread(cluster.client("fa").completions.with_raw_response.create,
                                      model="thunderagent-sim", prompt=prompt + " and a question", max_tokens=2)
        assert raw.headers["x-thunderagent-worker"] == "rank1"
        assert [rank for _, path, rank in dp.calls if path == "/v1/completions"][-1] == "1"

        def post(path: str) -> tuple[int, dict]:
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST", data=b"{}",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.status, jsonlib.load(resp)

        status, body = await asyncio.to_thread(post, "/pause?mode=keep&clear_cache=false")
        assert status == 200 and [w["id"] for w in body["workers"]] == ["rank0", "rank1"], body
        assert len([c for c in dp.calls if c[1].startswith("/pause")]) == 1
        assert (await asyncio.to_thread(post, "/resume"))[0] == 200
        assert len([c for c in dp.calls if c[1] == "/resume"]) == 1
    finally:
        cluster.close()
        await dp.stop()
