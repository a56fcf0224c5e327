"""Prefill/decode disaggregation on real vLLM: real KV moved by NIXL between two CPU servers.

Two servers with a NixlConnector in ``kv_role: kv_both`` (either side of a transfer; earlier runs of this
suite used ``kv_producer`` / ``kv_consumer``, which work the same for prefill/decode), UCX over TCP on
loopback, each pinned to one core, started once for this module (they are not the session's two servers):
``worker-0`` is the prefill server, ``worker-1`` the decode server. ThunderAgent runs in front of both; the disaggregation decision is not what is tested
here, so every request is planned by hand (prefill on ``worker-0``, decode on ``worker-1``) and runs
the live flow (``control.disagg_flow``): the prefill server computes the prompt and answers with its
``kv_transfer_params``, the decode server pulls the KV and streams the completion.

Evidence of a real transfer is the decode server's own ``/metrics``: its external prefix-cache hits
and NIXL bytes grow by the prompt's full blocks. The output must equal a greedy run of the same
prompt computed locally on the decode server (a fresh ``cache_salt`` keeps its cache out of it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.waiting import wait_until_blocking

from tests.engines.conftest import Front, engine_python, front_config, note, thunderagent, wait_until
from tests.engines.tiny_model import _WORDS
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer, VllmSetupError, cpu_binding, start_ready
from thunderagent.config import Config, parse_config
from thunderagent.control.fleet import Fleet
from thunderagent.frontend.hf_tokenizer import HfTokenizer
from thunderagent.kv.hashing import block_hashes, hash_seed
from thunderagent.types import EngineRequest, KvTransfer, PdPlan, Sampling

pytestmark = pytest.mark.real_engine

MAX_TOKENS = 12
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4  # one KV block of the tiny model (float32)
METRICS_TIMEOUT_S = 30  # one /metrics read (seen over 10 s on CI right after a failed pull)
METRICS_ATTEMPTS = 3
#: the first transfer between two servers pays the NIXL handshake (~20 s seen); later ones are quick
HANDSHAKE_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def pd_pair(engine_tmp: Path, tiny_model_dir: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    workdir = engine_tmp / "vllm-pd"
    python = engine_python(workdir)
    # kv_both: a cache migration copies either way (test_a_cache_migration_copy_moves_real_kv)
    pre = VllmServer("prefill", python, tiny_model_dir, workdir, cpu=cpu_binding(0), kv_role="kv_both")
    dec = VllmServer("decode", python, tiny_model_dir, workdir, cpu=cpu_binding(1), kv_role="kv_both")
    try:
        t0 = time.monotonic()
        start_ready([pre, dec])
        ready = time.monotonic() - t0
        t0 = time.monotonic()
        warm = text_prompt(tiny_model_dir, 99, 40)  # pays the handshake once, outside the tests' timing
        ids, _ = direct_pd(pre, dec, tiny_model_dir, warm)
        assert ids, "the warm-up transfer produced nothing"
        note(f"NIXL prefill+decode vLLM servers ready in {ready:.0f}s; first transfer (handshake) "
             f"{time.monotonic() - t0:.0f}s")
        yield pre, dec
    except VllmSetupError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        pre.stop()
        dec.stop()


def pd_config(model: Path, servers: list[VllmServer]) -> Config:
    """A 30 s lease instead of 5 s: a NIXL pull on 2 shared cores (CI) kept the decode server's
    ``/metrics`` silent for over 10 s of on-time loop, the lease expired mid-transfer and the request
    was rerouted, which is right for a fleet but not what these tests look at."""
    return front_config(model, servers, heartbeat_misses=60)


def groups_config(model: Path, pre: VllmServer, dec: VllmServer, plane: dict[str, Any]) -> Config:
    """A fleet with a prefill group (``pre``, its transfer plane ``plane``) and a decode group (``dec``), with
    pd_config's lease."""
    return parse_config({
        "model": str(model), "model_name": "tiny", "routing": {"seed": 7},
        "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": 60},
        "execution_group": {"nodes": [
            {"engine": "vllm", "role": "prefill", "block_size": BLOCK_SIZE, "endpoints": [pre.endpoint()],
             "kv_cache_transfer": plane},
            {"engine": "vllm", "role": "decode", "block_size": BLOCK_SIZE, "endpoints": [dec.endpoint()]}]},
    }, "test")


def text_prompt(model: Path, seed: int, words: int) -> list[int]:
    """Token ids of a text prompt (not random ids: see test_real_vllm_migration.prompts)."""
    rng = random.Random(seed)
    return HfTokenizer(model).encode(f"{seed}: " + " ".join(rng.choice(_WORDS) for _ in range(words)))


def post(url: str, body: dict[str, Any], timeout: float = HANDSHAKE_TIMEOUT_S) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def direct_pd(pre: VllmServer, dec: VllmServer, model: Path, prompt: list[int]) -> tuple[list[int], dict]:
    """vLLM's own disaggregation protocol by hand (no ThunderAgent): prefill, then decode."""
    first = post(f"{pre.url}/v1/completions", {
        "model": str(model), "prompt": prompt, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    assert first.get("kv_transfer_params"), first
    out = post(f"{dec.url}/v1/completions", {
        "model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, "kv_transfer_params": first["kv_transfer_params"]})
    return out["choices"][0]["token_ids"], first["kv_transfer_params"]


def local(server: VllmServer, model: Path, prompt: list[int], salt: str) -> tuple[list[int], str]:
    """A greedy run computed on ``server`` alone (``salt``: none of its cached blocks apply): its
    token ids and text."""
    out = post(f"{server.url}/v1/completions", {
        "model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, "cache_salt": salt})
    return out["choices"][0]["token_ids"], out["choices"][0]["text"]


_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.MULTILINE)


def _read_metrics(server: VllmServer) -> str:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=METRICS_TIMEOUT_S) as r:
        return r.read().decode()


async def metrics(server: VllmServer) -> dict[str, float]:
    """The server's vLLM counters, read in a thread (ThunderAgent shares the test's event loop). A
    slow answer is waited for and a timed-out one asked again (noted): once on CI the decode server's
    ``/metrics`` took over 10 s to answer right after a failed NIXL pull."""
    t0 = time.monotonic()
    for attempt in range(METRICS_ATTEMPTS):
        try:
            text = await asyncio.to_thread(_read_metrics, server)
            break
        except OSError:  # a timeout, or a refused connection
            if attempt == METRICS_ATTEMPTS - 1:
                raise
    if attempt or time.monotonic() - t0 > 10:
        note(f"{server.name} /metrics answered after {time.monotonic() - t0:.1f}s, {attempt + 1} tries")
    out: dict[str, float] = {}
    for name, v in _METRIC.findall(text):
        out[name] = out.get(name, 0.0) + float(v)
    return out


def grown(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def plan_every_request(fleet: Fleet) -> None:
    """Force the plan the disaggregation decision would make: prefill on worker-0, decode on worker-1.
    A remote prefill may be silent 30 s instead of 4 s (half the stall bound): one on CI's 2 loaded
    cores was silent longer, and ThunderAgent prefilled on the decode server instead (``prefill_silent``),
    which is right for a fleet but not what these tests look at."""
    fleet.disagg.silence_s = 30.0
    submit = fleet.dispatcher.submit

    def planned(req, key, workers, now, program=None, tenant=None, pin=None):  # type: ignore[no-untyped-def]
        d = submit(req, key, [w for w in workers if w.worker_id == "worker-1"], now, program, tenant, pin)
        if d is not None:
            n = len(req.prompt_tokens) // BLOCK_SIZE * BLOCK_SIZE
            d.pd = PdPlan("worker-0", n, 0, 0.0, 0.0, "test: forced")
        return d

    fleet.dispatcher.submit = planned  # type: ignore[method-assign]


async def stream_via(front: Front, prompt: list[int]) -> tuple[list[dict], str]:
    """One streamed completion through ThunderAgent: its SSE chunks and the worker header."""
    chunks: list[dict] = []
    async with aiohttp.ClientSession() as s, s.post(f"{front.base_url}/v1/completions", json={
        "model": front.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }, timeout=aiohttp.ClientTimeout(total=HANDSHAKE_TIMEOUT_S)) as r:
        assert r.status == 200, await r.text()
        worker = r.headers["x-thunderagent-worker"]
        async for line in r.content:
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks, worker


async def test_prompt_kv_moves_from_prefill_to_decode_server(pd_pair: tuple[VllmServer, VllmServer],
                                                             tiny_model_dir: Path) -> None:
    pre, dec = pd_pair
    prompt = text_prompt(tiny_model_dir, 1, 90)
    full = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    assert full >= 3 * BLOCK_SIZE
    expected = local(dec, tiny_model_dir, prompt, salt="reference")
    async with thunderagent(pd_config(tiny_model_dir, [pre, dec]), [pre, dec]) as front:
        plan_every_request(front.fleet)
        before = await metrics(dec)
        chunks, worker = await stream_via(front, prompt)
        after = await metrics(dec)
        m = front.fleet.metrics
        started, ok = m.pd_started._value.get(), m.pd_ok._value.get()  # type: ignore[attr-defined]
        assert started == 1 and ok == 1, (f"{started:g} transfer(s) started, {ok:g} done; our loop's longest "
                                          f"lag {front.fleet.loop_lag.max_lag:.1f}s")
    assert worker == "worker-1"
    # one normal stream: one finish reason, usage last, the text of a local greedy run
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes in (["length"], ["stop"]), chunks
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == len(prompt) and 1 <= usage["completion_tokens"] <= MAX_TOKENS
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected[1]
    assert usage["completion_tokens"] == len(expected[0])
    # a real transfer, per the decode server itself
    hits = grown(before, after, "vllm:external_prefix_cache_hits_total")
    moved = grown(before, after, "vllm:nixl_bytes_transferred_sum")
    note(f"NIXL transfer: prompt {len(prompt)} tokens, {hits:.0f} external hits, {moved:.0f} bytes on the decode "
         "server")
    # vLLM pulls every block the prefill filled, the last partial one too, and counts each prompt token
    # as an external hit; the tiny model's block is 2 layers x K,V x 32 tokens x 2 heads x 64 x 4 bytes
    assert hits == len(prompt) >= full
    assert moved == -(-len(prompt) // BLOCK_SIZE) * BLOCK_BYTES
    assert grown(before, after, "vllm:nixl_num_failed_transfers_total") == 0


async def test_the_decode_servers_nixl_metrics_teach_the_transfer_plane(pd_pair: tuple[VllmServer, VllmServer],
                                                                         tiny_model_dir: Path) -> None:
    """A fleet with a prefill group (the transfer plane on): each load poll reads the decode server's NIXL sums, and
    what grew with a transfer is a sample of the link from the prefill worker whose plan landed there
    (``control/pd_plane.py``): ``/health`` shows the link at the rate the server measured (``ewma_alpha`` 1 and no
    latency here, so the estimate is that rate), and the plan's own duration, prefill included, taught nothing."""
    pre, dec = pd_pair
    plane = {"enabled": True, "bandwidth_gbps": 400.0, "latency_s": 0.0, "ewma_alpha": 1.0}
    cfg = groups_config(tiny_model_dir, pre, dec, plane)
    async with thunderagent(cfg, [pre, dec]) as front:
        plan_every_request(front.fleet)
        before = await metrics(dec)
        chunks, worker = await stream_via(front, text_prompt(tiny_model_dir, 3, 90))
        after = await metrics(dec)
        assert worker == "worker-1" and chunks

        def learned() -> list[dict]:
            return [x for x in front.fleet.health_summary().get("pd_links", []) if x["samples"]]  # type: ignore[union-attr]

        await wait_until(lambda: bool(learned()), 30, "the link learned from the decode server's metrics")
        links = learned()
    moved = grown(before, after, "vllm:nixl_bytes_transferred_sum")
    secs = grown(before, after, "vllm:nixl_xfer_time_seconds_sum")
    note(f"NIXL link learned: {links}; the decode server moved {moved:.0f} bytes in {secs:.4f} s")
    assert [(x["src"], x["dst"]) for x in links] == [("worker-0", "worker-1")]
    transfers = grown(before, after, "vllm:nixl_xfer_time_seconds_count")
    assert moved > 0 and secs > 0 and transfers >= 1
    # one transfer read by one poll: one sample, the server's own rate (a poll between the bytes' and the seconds'
    # updates of a transfer would split it in two samples)
    if links[0]["samples"] == 1 and transfers == 1:
        assert links[0]["bandwidth_gbps"] == pytest.approx(moved / secs * 8 / 1e9, rel=1e-3)
    assert links[0]["bandwidth_gbps"] < 400.0  # (loopback TCP on a shared core: far below the configured default)
    assert front.fleet.metrics.pd_links_learned.labels("server")._value.get() >= 1  # type: ignore[attr-defined]


async def test_greedy_output_equals_a_single_servers(pd_pair: tuple[VllmServer, VllmServer],
                                                     tiny_model_dir: Path) -> None:
    pre, dec = pd_pair
    for seed in (2, 3):
        prompt = text_prompt(tiny_model_dir, seed, 70)
        ids, _ = direct_pd(pre, dec, tiny_model_dir, prompt)
        assert ids == local(dec, tiny_model_dir, prompt, salt=f"ref-{seed}")[0]


async def test_missing_or_garbled_transfer_falls_back_to_local_prefill(pd_pair: tuple[VllmServer, VllmServer],
                                                                      tiny_model_dir: Path) -> None:
    """The decode worker given a transfer it cannot use (no params, not JSON) computes the prompt
    itself: same greedy output, no external hits."""
    pre, dec = pd_pair
    prompt = text_prompt(tiny_model_dir, 4, 70)
    expected, _ = local(dec, tiny_model_dir, prompt, salt="ref-4")
    async with thunderagent(pd_config(tiny_model_dir, [pre, dec]), [pre, dec]) as front:
        handle = front.fleet.workers["worker-1"]
        for k, params in enumerate((None, "{garbled")):
            before = await metrics(dec)
            req = EngineRequest(f"fallback-{k}", prompt, [], 0, MAX_TOKENS, cache_salt=f"fresh-{k}",
                                sampling=Sampling(temperature=0.0),
                                kv_from=KvTransfer("worker-0", len(prompt), (), params))
            q = handle.submit(req)
            outs = []
            while not outs or not outs[-1].finished:
                outs.append(await q.get())
            assert [t for o in outs for t in o.token_ids] == expected
            assert grown(before, await metrics(dec), "vllm:external_prefix_cache_hits_total") == 0


async def test_prefill_server_gone_falls_back_and_the_client_sees_one_stream(
        pd_pair: tuple[VllmServer, VllmServer], tiny_model_dir: Path) -> None:
    """A plan naming a prefill server that no longer answers: the request prefills on the decode
    server, counted as a fallback, and streams normally."""
    pre, dec = pd_pair
    prompt = text_prompt(tiny_model_dir, 5, 60)
    expected = local(dec, tiny_model_dir, prompt, salt="ref-5")
    dead = VllmServer("dead", pre.python, tiny_model_dir, pre.workdir)  # never started: refuses connections
    async with thunderagent(pd_config(tiny_model_dir, [dead, dec]), [dead, dec], wait_healthy=False) as front:
        plan_every_request(front.fleet)
        decode = front.fleet.workers["worker-1"]
        await wait_until(lambda: getattr(decode, "_reachable", None) is True, 30, "decode worker polled")
        chunks, worker = await stream_via(front, prompt)
        m = front.fleet.metrics
        samples = m.pd_fallbacks.collect()[0].samples
        fallbacks = {s.labels["cause"]: s.value for s in samples if s.name.endswith("_total")}
    assert worker == "worker-1"
    assert fallbacks == {"prefill_unavailable": 1.0}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected[1]


async def test_mismatched_transfer_is_refused_and_prefilled_on_the_decode_server(
        pd_pair: tuple[VllmServer, VllmServer], tiny_model_dir: Path) -> None:
    """A transfer naming an engine the decode server cannot reach: vLLM fails the pull (its failed
    transfers grow) and answers HTTP 500; ThunderAgent prefills the request on the same decode server,
    counted as ``decode_refused_transfer``, and the client sees one normal stream with the right text."""
    pre, dec = pd_pair
    prompt = text_prompt(tiny_model_dir, 6, 70)
    expected = local(dec, tiny_model_dir, prompt, salt="ref-6")
    async with thunderagent(pd_config(tiny_model_dir, [pre, dec]), [pre, dec]) as front:
        plan_every_request(front.fleet)
        flow = front.fleet.disagg
        prefill = flow._prefill

        async def mismatched(a, req, relay):  # type: ignore[no-untyped-def]
            transfer, cause = await prefill(a, req, relay)
            assert transfer is not None, cause
            params = json.loads(transfer.engine_params or "")
            params["remote_engine_id"] = "no-such-engine"
            return dataclasses.replace(transfer, engine_params=json.dumps(params)), cause

        flow._prefill = mismatched  # type: ignore[method-assign]
        before = await metrics(dec)
        chunks, worker = await stream_via(front, prompt)
        after = await metrics(dec)
        samples = front.fleet.metrics.pd_fallbacks.collect()[0].samples
        fallbacks = {s.labels["cause"]: s.value for s in samples if s.name.endswith("_total")}
        rerouted = front.fleet.metrics.rerouted._value.get()  # type: ignore[attr-defined]
    # vLLM either answers 500 (ThunderAgent prefills on the same server: counted) or, seen once under
    # CI load, recovers the failed pull itself and computes the prompt (nothing for us to count); either
    # way the pull failed on the decode server and the client got one normal stream with the right text
    assert worker == "worker-1" and rerouted == 0
    assert fallbacks in ({"decode_refused_transfer": 1.0}, {}), fallbacks
    # vLLM's own count of the failed pull: 1, or 2 when it counted the failed handshake and the read
    # apart (seen once in CI); 0 would mean no pull was tried
    assert grown(before, after, "vllm:nixl_num_failed_transfers_total") >= 1
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected[1]


async def test_a_cache_migration_copy_moves_real_kv_between_two_servers(pd_pair: tuple[VllmServer, VllmServer],
                                                                         tiny_model_dir: Path) -> None:
    """``routing.migration`` on vLLM servers (``control/cache_migration.py``): under injected skew (the prefix's
    holder made to look busy to the migrator) the health-tick driver copies the prefix to the other server in
    the two halves of a handoff: the holder's one-token ``remote_decode`` job, the other's one-token pull over
    NIXL. Evidence from the target itself: its external hits and NIXL bytes grow by the prefix, its own KV
    events confirm the prefix's blocks in the index, and a request for the prefix sent straight to it finds
    them in its local prefix cache (``cached_tokens``), under the tenant's cache salt. The copies' link learns
    the target's measured NIXL rate (``/health`` ``migration_links``)."""
    pre, dec = pd_pair
    # demand_half_life_s an hour: on CI the requests and the /metrics read before the look took over 10 s once, and
    # the prefix's one request of demand had decayed under min_demand by then (nothing planned, nothing refused)
    mig = {"enabled": True, "min_prefix_tokens": 3 * BLOCK_SIZE, "min_demand": 0.5, "sustain_s": 0.0,
           "demand_half_life_s": 3600.0, "link": {"enabled": True, "bandwidth_gbps": 400.0, "latency_s": 0.0}}
    cfg = parse_config({
        "model": str(tiny_model_dir), "model_name": "tiny", "routing": {"seed": 7, "migration": mig},
        "scheduler": {"enabled": False},
        "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": 60},  # (pd_config's lease)
        "execution_group": {"nodes": [{"engine": "vllm", "block_size": BLOCK_SIZE,
                                       "endpoints": [pre.endpoint(), dec.endpoint()]}]},
    }, "test")
    prefix = text_prompt(tiny_model_dir, 11, 150)
    salt = "migration-test"  # the prefix's own cache key on both servers: the copy must carry it
    async with thunderagent(cfg, [pre, dec]) as front:
        fleet, flow = front.fleet, front.fleet.cache_migration
        assert flow is not None
        # a first request on a NIXL-enabled server was once silent 26 s on CI's loaded cores (past the 8 s stall
        # bound): cut and continued on the other server, which then held the prefix too (nothing to copy)
        fleet.stall_timeout = 60.0

        async def ask(tail: list[int]) -> dict:
            async with aiohttp.ClientSession() as s, s.post(f"{front.base_url}/v1/completions", json={
                "model": front.model, "prompt": prefix + tail, "max_tokens": 2, "temperature": 0, "explain": True,
                "cache_salt": salt}, timeout=aiohttp.ClientTimeout(total=HANDSHAKE_TIMEOUT_S)) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["thunderagent"]  # type: ignore[no-any-return]

        first = await ask([11, 12])
        holder = first["worker"]
        blocks = len(prefix) // BLOCK_SIZE
        hashes = block_hashes(prefix, BLOCK_SIZE, hash_seed(salt))  # as the frontend hashes the prompt
        await wait_until(lambda: all(fleet.index.is_confirmed(holder, h) for h in hashes), 30,
                         "the holder's KV events")
        second = await ask([21, 22])  # finds the prefix: demand
        assert second["worker"] == holder and second["overlap_blocks"] >= blocks - 1, second
        target = next(w for w in fleet.workers if w != holder)
        server = {"worker-0": pre, "worker-1": dec}[target]
        before = await metrics(server)
        states = [dataclasses.replace(w, load=dataclasses.replace(w.load, waiting=w.queue_depth_threshold))
                  if w.worker_id == holder else w for w in fleet.routable()]
        flow.tick(states, fleet.now() + 1.0)  # past any look the health tick just had
        tasks = list(flow._tasks.values())
        assert len(tasks) == 1, flow.migrator.refusals
        await asyncio.wait_for(asyncio.gather(*tasks), HANDSHAKE_TIMEOUT_S)
        after = await metrics(server)
        assert flow.migrator.completed == 1 and flow.failures == {}, flow.health()
        copied = flow.migrator.blocks_moved

        def learned() -> list[dict]:  # the copies' own plane: its link learns from the target's NIXL metrics
            return [x for x in fleet.health_summary().get("migration_links", []) if x["samples"]]  # type: ignore[union-attr]
        await wait_until(lambda: learned() != [], 30, "the copy's link learning from the target server's NIXL reads")
        assert [(x["src"], x["dst"]) for x in learned()] == [(holder, target)]
        assert learned()[0]["bandwidth_gbps"] != 400.0  # (the configured estimate moved)
        # both servers' prefill figures are read with their load polls (their measured rates follow once they
        # computed MIN_PREFILL_SAMPLE_TOKENS more: more than this test sends)
        assert set(flow.migrator._prefill_seen) == {"worker-0", "worker-1"}
        await wait_until(lambda: all(fleet.index.is_confirmed(target, h) for h in hashes[:copied]), 30,
                         "the target's own KV events for the copied blocks")
        # straight to the target: its local prefix cache holds the prefix now
        direct = post(f"{server.url}/v1/completions", {"model": str(tiny_model_dir), "prompt": prefix + [31, 32],
                                                       "max_tokens": 1, "cache_salt": salt})
        # the target's measured prefill rate (what not_worth_it weighs a copy against): prompts computed straight
        # on it, 1,024 new tokens or more since the last reading counted make a sample
        pre_load = await metrics(server)
        # the migrator's baseline: the server's sums at its last reading that made no sample (a window takes in
        # every request since, the copy's pull and ``direct`` too: on CI's loaded cores their one-pass prefills
        # once weighed 4x the three prompts' time, so the window's rate, not the prompts' alone, is the reference)
        base = flow.migrator._prefill_seen[target]
        for k in range(3):
            await asyncio.to_thread(post, f"{server.url}/v1/completions", {
                "model": str(tiny_model_dir), "prompt": text_prompt(tiny_model_dir, 40 + k, 500), "max_tokens": 1})
        await wait_until(lambda: target in flow.migrator.prefill_tps, 30, "the target's measured prefill rate")
        tps = flow.migrator.prefill_tps[target]
        reading = flow.migrator._prefill_seen[target]  # the reading that made the sample (the new baseline)
        post_load = await metrics(server)
    computed = grown(pre_load, post_load, "vllm:request_prefill_kv_computed_tokens_sum")
    own_rate = computed / grown(pre_load, post_load, "vllm:request_prefill_time_seconds_sum")
    hits = grown(before, after, "vllm:external_prefix_cache_hits_total")
    moved = grown(before, after, "vllm:nixl_bytes_transferred_sum")
    cached = direct["usage"]["prompt_tokens_details"]["cached_tokens"]
    note(f"cache migration {holder} -> {target}: {copied} blocks, {hits:.0f} external hits, {moved:.0f} NIXL bytes "
         f"on the target; then {cached} of {len(prefix) + 2} prompt tokens cached there; its measured prefill "
         f"rate {tps:,.0f} tokens/s (its own figures over the prompts sent: {own_rate:,.0f})")
    assert copied >= 3 and hits >= copied * BLOCK_SIZE and moved >= copied * BLOCK_BYTES
    assert cached >= copied * BLOCK_SIZE
    # the sample is the server's own figures over the migrator's window: its two readings are the server's sums
    # (bracketed by the test's reads around the prompts), at least MIN_PREFILL_SAMPLE_TOKENS apart, and the rate is
    # their growth's ratio (a first sample: no EWMA yet)
    tok, sec = "vllm:request_prefill_kv_computed_tokens_sum", "vllm:request_prefill_time_seconds_sum"
    assert computed >= 1024 and base[0] <= pre_load[tok] and base[1] <= pre_load[sec], (base, pre_load)
    assert pre_load[tok] < reading[0] <= post_load[tok] and pre_load[sec] < reading[1] <= post_load[sec]
    assert reading[0] - base[0] >= 1024 and tps == pytest.approx((reading[0] - base[0]) / (reading[1] - base[1]))


async def test_the_links_warm_up_before_any_client(pd_pair: tuple[VllmServer, VllmServer], tiny_model_dir: Path) -> None:
    """``kv_cache_transfer.warmup_tokens`` (``control/link_warmup.py``): with no client request at all, the fleet
    runs one handoff on the link worker-0 -> worker-1 once both are routable: the decode server pulls its KV over
    NIXL (its own metrics), ``/health`` shows the warm-up ok, and the link has learned the server's measured rate
    (a fresh pair would also pay its NIXL handshake there, not on a client's first request)."""
    pre, dec = pd_pair
    plane = {"enabled": True, "bandwidth_gbps": 400.0, "latency_s": 0.0, "ewma_alpha": 1.0,
             "warmup_tokens": 3 * BLOCK_SIZE}
    cfg = groups_config(tiny_model_dir, pre, dec, plane)
    before = await metrics(dec)
    async with thunderagent(cfg, [pre, dec], wait_healthy=False) as front:
        front.fleet.disagg.silence_s = 30.0  # (as plan_every_request: CI's loaded cores)

        def warmed() -> list[dict]:
            return front.fleet.health_summary().get("pd_warmup", [])  # type: ignore[return-value]

        await wait_until(lambda: bool(warmed()), HANDSHAKE_TIMEOUT_S, "the link's warm-up")
        result = warmed()
        assert [(x["src"], x["dst"], x["ok"], x["cause"]) for x in result] == [("worker-0", "worker-1", True, "ok")]

        def learned() -> list[dict]:
            return [x for x in front.fleet.health_summary().get("pd_links", []) if x["samples"]]  # type: ignore[union-attr]

        await wait_until(lambda: bool(learned()), 30, "the link learned from the warm-up's pull")
        links = learned()
    after = await metrics(dec)
    hits = grown(before, after, "vllm:external_prefix_cache_hits_total")
    moved = grown(before, after, "vllm:nixl_bytes_transferred_sum")
    note(f"link warm-up: {result}; the decode server: {hits:.0f} external hits, {moved:.0f} NIXL bytes; "
         f"learned {links}")
    assert hits >= 3 * BLOCK_SIZE and moved >= 3 * BLOCK_BYTES
    assert [(x["src"], x["dst"]) for x in links] == [("worker-0", "worker-1")] and links[0]["bandwidth_gbps"] < 400.0


def test_nixl_handoffs_behind_nats_worker_processes(pd_pair: tuple[VllmServer, VllmServer], tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    """The NATS deployment: nats-server, a ``thunderagent worker`` process on each server (``--node 0`` the prefill
    group, ``--node 1`` the decode group) and a ``thunderagent frontend``, disaggregation mode ``always``. vLLM's
    ``kv_transfer_params`` cross the bus twice (the prefill worker's answer, the decode worker's request:
    ``engine_params``), the decode server pulls the prompt's KV over NIXL (its own metrics), the client gets the
    text of a greedy run on the decode server alone, and the frontend's plane learns the link from the decode
    server's readings, passed on in its worker process's heartbeats."""
    pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")
    from openai import OpenAI

    from tests.integration.nats_cluster import Cluster

    pre, dec = pd_pair
    cfg = {"model": str(tiny_model_dir), "model_name": "tiny",
           "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": 60},  # (pd_config's lease)
           "routing": {"seed": 7, "disaggregation": {"mode": "always", "min_uncached_tokens": 0}},
           "scheduler": {"enabled": False},
           "execution_group": {"nodes": [
               {"engine": "vllm", "role": "prefill", "block_size": BLOCK_SIZE, "endpoints": [pre.endpoint()],
                "kv_cache_transfer": {"enabled": True, "bandwidth_gbps": 400.0, "latency_s": 0.0,
                                      "ewma_alpha": 1.0}},
               {"engine": "vllm", "role": "decode", "block_size": BLOCK_SIZE, "endpoints": [dec.endpoint()]}]}}
    cluster = Cluster(tmp_path)
    path = tmp_path / "pd-nats.json"
    path.write_text(json.dumps(cfg))
    prompt = text_prompt(tiny_model_dir, 13, 90)
    expected = local(dec, tiny_model_dir, prompt, salt="ref-13")
    try:
        cluster.start_nats()
        cluster.start_worker("p0", "--node", "0", config=path)
        cluster.start_worker("d1", "--node", "1", config=path)
        cluster.start_frontend("f", config=path)

        def listed() -> bool:
            for name in ("nats", "p0", "d1", "f"):
                if cluster.exited(name):
                    pytest.fail(f"{name} exited ({cluster.procs[name].returncode}):\n{cluster.logs()}")
            return cluster.workers("f") == {"p0", "d1"}

        wait_until_blocking(listed, 90, "the frontend to list both worker processes")
        before = asyncio.run(metrics(dec))
        client = OpenAI(base_url=f"http://127.0.0.1:{cluster.ports['f']}/v1", api_key="unused", max_retries=0,
                        timeout=HANDSHAKE_TIMEOUT_S)
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                         temperature=0)
        out = raw.parse()
        after = asyncio.run(metrics(dec))
        health = cluster.health("f")

        def learned() -> list[dict]:
            return [x for x in cluster.health("f").get("pd_links", []) if x["samples"]]

        wait_until_blocking(lambda: bool(learned()), 30, "the link learned from the decode worker's heartbeats")
        links = learned()
    finally:
        cluster.close()
        logs = cluster.logs()
    hits = grown(before, after, "vllm:external_prefix_cache_hits_total")
    moved = grown(before, after, "vllm:nixl_bytes_transferred_sum")
    note(f"NIXL behind NATS workers: {hits:.0f} external hits, {moved:.0f} bytes on the decode server; learned {links}")
    assert raw.headers["x-thunderagent-worker"] == "d1", logs
    assert out.choices[0].text == expected[1], logs
    assert hits == len(prompt) and moved == -(-len(prompt) // BLOCK_SIZE) * BLOCK_BYTES, (health, logs)
    assert [(x["src"], x["dst"]) for x in links] == [("p0", "d1")] and links[0]["bandwidth_gbps"] < 400.0
