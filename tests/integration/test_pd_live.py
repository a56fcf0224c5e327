"""Prefill/decode disaggregation on a live server with simulated workers, through the official
OpenAI client: one prefill worker and two decode workers; every request with a full uncached block
prefills on worker-0 (mode always), its KV handed to the decode worker the router chose, which
streams the answer. The transfer plane's in-flight cap holds under a burst; what finds it full
prefills on its decode worker (backpressure); nothing is lost."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"


def fleet(max_inflight: int, block_bytes: int = 16 << 10, **faults: object) -> dict[str, object]:
    # the simulated workers move block_bytes of payload per block over TCP (the default, 8 MiB a
    # block, would spend the test's time copying)
    plane = {"enabled": True, "max_inflight": max_inflight, "sim_block_bytes": block_bytes}
    if faults:
        plane["sim_faults"] = faults
    return {"nodes": [{"role": "prefill", "count": 1, "kv_cache_transfer": plane}, {"role": "decode", "count": 2}]}


async def burst(srv, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    """``n`` long distinct completions at once; their finish reasons."""
    async def one(i: int) -> str:
        r = await srv.client.completions.create(model=MODEL, prompt=f"burst {i} " + "long prompt " * 100,
                                                max_tokens=8)
        return r.choices[0].finish_reason

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_disaggregated_requests_stream_from_the_decode_worker(server_factory):
    async with server_factory(execution_group=fleet(4), routing={"seed": 7, "disaggregation": {"mode": "always"}},
                              scheduler={"enabled": False}) as srv:
        prompt = "a long enough prompt for several full blocks " * 12
        stream = await srv.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, stream=True,
            extra_body={"explain": True})
        chunks = [c async for c in stream]
        explain = chunks[0].model_extra["thunderagent"]
        assert explain["worker"] in ("worker-1", "worker-2") and explain["pd"]["prefill_worker"] == "worker-0"
        assert explain["pd"]["transfer_tokens"] > 0
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) != ""
        assert chunks[-1].choices[0].finish_reason == "length"
        m = srv.fleet.metrics
        assert m.pd_started._value.get() == 1 and m.pd_ok._value.get() == 1  # type: ignore[attr-defined]
        decode = srv.fleet.workers[explain["worker"]].engine  # type: ignore[attr-defined]
        blocks = explain["pd"]["transfer_tokens"] // 64
        assert decode.kv_imported_blocks == blocks
        # the payload bytes crossed a real connection, each block checksummed on arrival
        stats = srv.fleet.workers["worker-0"].service.stats  # type: ignore[attr-defined]  (one per process)
        assert (stats.pulls_served, stats.bytes_sent) == (1, blocks * (16 << 10))
        assert (stats.pulls_ok, stats.bytes_received, stats.checksums_verified) == (1, blocks * (16 << 10), blocks)
        assert m.pd_pulled_bytes._value.get() == blocks * (16 << 10)  # type: ignore[attr-defined]
        assert m.pd_pull_checksums._value.get() == blocks  # type: ignore[attr-defined]
        # the link learnt from the pull's own duration, not the prefill's
        plane = srv.fleet.dispatcher.disagg.plane  # type: ignore[union-attr]
        # (a pull that took less than the link's assumed latency carries no bandwidth: then no sample;
        # on loopback that happens about one run in four)
        link = plane.links[("worker-0", explain["worker"])]
        pulled_s = m.pd_pull_seconds._sum.get()  # type: ignore[attr-defined]
        assert link.samples == (1 if pulled_s > link.latency_s else 0), (pulled_s, link)
        assert srv.fleet.dispatcher.disagg.plane.inflight == {}  # type: ignore[union-attr]
        # the answer is the same text a plain request gets (the simulated text depends on the prompt only)
        plain = await srv.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16)
        assert plain.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks
                                                           if c.choices)


async def test_the_plane_cap_holds_under_a_burst_and_the_rest_prefill_locally(server_factory):
    async with server_factory(execution_group=fleet(1), routing={"seed": 7, "disaggregation": {"mode": "always"}},
                              scheduler={"enabled": False}, simulation={"speedup": 2.0}) as srv:
        assert await burst(srv, 16) == ["length"] * 16  # nothing lost
        plane = srv.fleet.dispatcher.disagg.plane  # type: ignore[union-attr]
        assert plane.stats.peak_inflight == 1 and plane.inflight == {}
        m = srv.fleet.metrics
        started, full = m.pd_started._value.get(), m.pd_fallbacks.labels("plane_full")._value.get()  # type: ignore[attr-defined]
        assert started >= 1 and full >= 1 and started + full == 16


@pytest.mark.parametrize(("faults", "cause"), [
    ({"corrupt_p": 1.0}, "kv_checksum"),
    ({"interrupt_p": 1.0}, "kv_interrupted"),
    ({"target_full_p": 1.0}, "target_full"),
    ({"slow_link_bps": 20000.0}, "kv_timeout"),  # 320 KiB at 20 KB/s: far past the 2 s pull floor
])
async def test_a_failed_pull_prefills_on_the_decode_worker_counted_by_cause(server_factory, faults, cause):
    async with server_factory(execution_group=fleet(4, 32 << 10, **faults),
                              routing={"seed": 7, "disaggregation": {"mode": "always"}},
                              scheduler={"enabled": False}) as srv:
        prompt = "a long enough prompt for several full blocks " * 12
        stream = await srv.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True)
        chunks = [c async for c in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) != ""
        m = srv.fleet.metrics
        assert m.pd_fallbacks.labels(cause)._value.get() == 1  # type: ignore[attr-defined]
        assert m.pd_failed.labels(cause)._value.get() == 1 and m.pd_ok._value.get() == 0  # type: ignore[attr-defined]
        assert m.pd_pulled_bytes._value.get() == 0  # type: ignore[attr-defined]
        stats = srv.fleet.workers["worker-0"].service.stats  # type: ignore[attr-defined]
        assert stats.failures == {cause: 1} and stats.pulls_ok == 0
        plane = srv.fleet.dispatcher.disagg.plane  # type: ignore[union-attr]
        assert plane.inflight == {} and plane.stats.fallbacks == {cause: 1}


STRICT = {"seed": 7, "fallback_to_local": False, "disaggregation": {"mode": "always"}}


async def test_strict_a_burst_waits_for_the_plane_and_never_prefills_on_a_decode_worker(server_factory):
    """``routing.fallback_to_local: false`` with a plane cap of 1: the burst's plans wait for the plane
    instead of prefilling on their decode workers; every request is served from moved KV."""
    async with server_factory(execution_group=fleet(1), routing=STRICT, scheduler={"enabled": False},
                              simulation={"speedup": 2.0}) as srv:
        assert await burst(srv, 16) == ["length"] * 16  # nothing lost
        plane = srv.fleet.dispatcher.disagg.plane  # type: ignore[union-attr]
        assert plane.stats.peak_inflight == 1 and plane.inflight == {} and plane.stats.fallbacks == {}
        m = srv.fleet.metrics
        assert m.pd_started._value.get() == 16 and m.pd_ok._value.get() == 16  # type: ignore[attr-defined]
        assert b"\nthunderagent_pd_fallbacks_total{" not in m.render()
        decode = [srv.fleet.workers[w].engine for w in ("worker-1", "worker-2")]  # type: ignore[attr-defined]
        # each decode worker computed only its prompts' partial last blocks, the rest came over the plane
        assert sum(e.kv_imported_blocks for e in decode) > 0
        assert sum(e.prefill_tokens for e in decode) < 16 * 64


async def test_strict_failed_pulls_are_routed_again_then_refused(server_factory):
    """Every pull fails (``interrupt_p: 1``): the request goes to each decode worker in turn, never
    prefilled there, and with none left the client gets a 503; the server goes on serving."""
    async with server_factory(execution_group=fleet(4, 32 << 10, interrupt_p=1.0), routing=STRICT,
                              scheduler={"enabled": False}) as srv:
        prompt = "a long enough prompt for several full blocks " * 12
        with pytest.raises(openai.APIStatusError) as err:
            await srv.client.with_options(max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8)
        assert err.value.status_code == 503 and "no worker could take the request" in str(err.value)
        m = srv.fleet.metrics
        assert m.pd_rerouted.labels("kv_interrupted")._value.get() == 2  # type: ignore[attr-defined]
        assert m.pd_failed.labels("kv_interrupted")._value.get() == 2  # type: ignore[attr-defined]
        assert m.rerouted._value.get() == 1  # type: ignore[attr-defined]  (the second refusal: none left)
        assert b"\nthunderagent_pd_fallbacks_total{" not in m.render()
        for w in ("worker-1", "worker-2"):
            engine = srv.fleet.workers[w].engine  # type: ignore[attr-defined]
            assert engine.kv_imported_blocks == 0 and engine.prefill_tokens == 0, "never prefilled there"
        async with aiohttp.ClientSession() as http, http.get(f"{srv.base_url}/health") as health:
            assert health.status == 200


async def test_always_a_backlogged_prefill_tier_holds_requests_in_the_scheduler_with_its_429(server_factory):
    """Decode workers prefill nothing under mode always, so they look free whatever the prefill tier's queue:
    the scheduler also waits for a prefill worker with a backlog under ``engine_backlog_passes`` passes. Past
    that, requests are held (bounded: ``max_queued``, then 429 with Retry-After) instead of queueing in the
    prefill engine; every admitted request completes, disaggregated."""
    from support.waiting import wait_until

    slow_prefill = {"role": "prefill", "count": 1, "max_batch_size": 1, "max_num_batched_tokens": 64,
                    "timing": {"speedup": 0.1}, "kv_cache_transfer": {"enabled": True, "sim_block_bytes": 16 << 10}}
    group = {"nodes": [slow_prefill, {"role": "decode", "count": 2}]}
    sched = {"enabled": True, "max_queued": 2, "max_queue_delay_s": None, "max_wait_s": 60.0,
             "engine_backlog_passes": 1.0}
    async with server_factory(execution_group=group, routing={"seed": 7, "disaggregation": {"mode": "always"}},
                              scheduler=sched, simulation={"speedup": 5.0}) as srv:
        def one(i: int):  # type: ignore[no-untyped-def]
            return asyncio.create_task(srv.client.completions.create(
                model=MODEL, prompt=f"held {i} " + "long prompt " * 60, max_tokens=4))

        held = lambda: srv.fleet.health_summary()["scheduler"]["held"]  # noqa: E731
        first = [one(0)]
        await wait_until(lambda: srv.fleet.registry.loads()["worker-0"].queued_prefill_tokens >= 64, 10,
                         "the prefill worker's backlog reported")
        first += [one(i) for i in (1, 2)]
        await wait_until(lambda: held() == 2, 10, "two requests held in the scheduler")
        with pytest.raises(openai.RateLimitError) as err:
            await srv.client.with_options(max_retries=0).completions.create(model=MODEL, prompt="one too many " * 60,
                                                                            max_tokens=4)
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert err.value.response.json()["error"]["code"] == "queue_full"
        done = await asyncio.gather(*first)
        assert all(r.choices[0].finish_reason == "length" for r in done)
        m = srv.fleet.metrics
        assert m.pd_ok._value.get() == 3  # type: ignore[attr-defined]  (each prefilled on the prefill tier)
        assert m.scheduler_wait._sum.get() > 0  # type: ignore[attr-defined]
        assert held() == 0


async def test_always_a_burst_at_once_is_held_behind_the_prefill_it_started(server_factory):
    """Six requests in the same instant: the prefill halves start in tasks, after the next decisions, so the
    prefill worker is charged each plan at once (``PlaneObserver.on_planned``): the first goes, the rest are
    held in the scheduler instead of all passing its prefill gate. All complete."""
    slow_prefill = {"role": "prefill", "count": 1, "max_batch_size": 1, "max_num_batched_tokens": 64,
                    "timing": {"speedup": 0.1}, "kv_cache_transfer": {"enabled": True, "sim_block_bytes": 16 << 10}}
    group = {"nodes": [slow_prefill, {"role": "decode", "count": 2}]}
    sched = {"enabled": True, "max_queue_delay_s": None, "max_wait_s": 60.0}
    async with server_factory(execution_group=group, routing={"seed": 7, "disaggregation": {"mode": "always"}},
                              scheduler=sched, simulation={"speedup": 5.0}) as srv:
        tasks = [asyncio.create_task(srv.client.completions.create(
            model=MODEL, prompt=f"burst {i} " + "long prompt " * 60, max_tokens=4)) for i in range(6)]
        peak = 0
        while not all(t.done() for t in tasks):
            peak = max(peak, srv.fleet.health_summary()["scheduler"]["held"])
            await asyncio.sleep(0.005)
        assert all(r.choices[0].finish_reason == "length" for r in await asyncio.gather(*tasks))
        assert peak == 5, peak  # all but the first (without the charge: 3, the rest went to the engine's queue)
        assert srv.fleet.metrics.pd_ok._value.get() == 6  # type: ignore[attr-defined]


async def test_strict_a_held_request_whose_kv_never_fits_the_decode_worker_gets_503_when_it_comes_up(server_factory):
    """Strict: a request held behind the prefill tier whose KV is more than the decode worker may take even
    empty (``target_watermark`` of its pool) is refused with 503 when it comes up, not held first in line for
    good; the request behind it is served."""
    from support.waiting import wait_until

    slow_prefill = {"role": "prefill", "count": 1, "max_batch_size": 1, "max_num_batched_tokens": 64,
                    "timing": {"speedup": 0.1}, "kv_cache_transfer": {"enabled": True, "sim_block_bytes": 16 << 10}}
    group = {"nodes": [slow_prefill, {"role": "decode", "count": 1, "kv_blocks": 32}]}  # 0.7 x 32 blocks may move
    sched = {"enabled": True, "max_queue_delay_s": None, "max_wait_s": 60.0}
    async with server_factory(execution_group=group, scheduler=sched, simulation={"speedup": 5.0},
                              routing={"seed": 7, "fallback_to_local": False,
                                       "disaggregation": {"mode": "always"}}) as srv:
        def one(text: str):  # type: ignore[no-untyped-def]
            return asyncio.create_task(srv.client.with_options(max_retries=0).completions.create(
                model=MODEL, prompt=text, max_tokens=4))

        held = lambda: srv.fleet.health_summary()["scheduler"]["held"]  # noqa: E731
        first = one("first " + "long prompt " * 60)
        await wait_until(lambda: srv.fleet.registry.loads()["worker-0"].queued_prefill_tokens >= 64, 10,
                         "the prefill worker's backlog reported")
        big = one("big " + "x y " * 700)
        await wait_until(lambda: held() == 1, 10, "the big request held")
        after = one("after " + "short " * 40)
        await wait_until(lambda: held() == 2, 10, "the next one held behind it")
        with pytest.raises(openai.InternalServerError) as err:
            await big
        assert err.value.status_code == 503 and "target_full" in err.value.message
        assert "fallback_to_local is false" in err.value.message
        for r in (await first, await after):
            assert r.choices[0].finish_reason == "length"
        assert held() == 0


async def test_the_links_warm_up_at_start_with_real_bytes_and_learn_before_any_client(server_factory):
    """``warmup_tokens`` on simulated workers with byte transport: with no client request, each prefill -> decode
    link runs one handoff (``control/link_warmup.py``): its payload crosses a real connection, checksummed, and the
    link learns from the pull's own duration."""
    ex = fleet(4, block_bytes=256 << 10)
    # latency 0: every pull's seconds are its bandwidth's (else one quicker than the latency teaches nothing)
    ex["nodes"][0]["kv_cache_transfer"] |= {"warmup_tokens": 4 * 64, "latency_s": 0.0}  # type: ignore[index]
    async with server_factory(execution_group=ex, routing={"seed": 7}, scheduler={"enabled": False}) as srv:
        f = srv.fleet
        for _ in range(500):
            warm = f.health_summary().get("pd_warmup", [])
            if len(warm) == 2:
                break
            await asyncio.sleep(0.02)
        assert [(w["src"], w["dst"], w["ok"], w["cause"]) for w in warm] == [
            ("worker-0", "worker-1", True, "ok"), ("worker-0", "worker-2", True, "ok")]
        stats = f.workers["worker-0"].service.stats  # type: ignore[attr-defined]  (one per process)
        assert (stats.pulls_ok, stats.bytes_received, stats.checksums_verified) == (2, 2 * 4 * (256 << 10), 8)
        plane = f.dispatcher.disagg.plane  # type: ignore[union-attr]
        assert plane.stats.completed == 2 and plane.inflight == {}
        # each link learnt from its pull, before any client
        assert {k: link.samples for k, link in plane.links.items()} == {("worker-0", "worker-1"): 1,
                                                                      ("worker-0", "worker-2"): 1}
        assert f.metrics.pd_links_learned.labels("pull")._value.get() == 2  # type: ignore[attr-defined]
        assert f.metrics.pd_ok._value.get() == 2  # type: ignore[attr-defined]
