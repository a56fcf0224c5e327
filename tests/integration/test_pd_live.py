"""Prefill/decode disaggregation on a live server with simulated workers, through the official
OpenAI client: one prefill worker and two decode workers; every request with a full uncached block
prefills on worker-0 (mode always), its KV handed to the decode worker the router chose, which
streams the answer. The transfer plane's in-flight cap holds under a burst; what finds it full
prefills on its decode worker (backpressure); nothing is lost."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"


def fleet(max_inflight: int) -> dict[str, object]:
    return {"nodes": [{"role": "prefill", "count": 1,
                       "kv_cache_transfer": {"enabled": True, "max_inflight": max_inflight}},
                      {"role": "decode", "count": 2}]}


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
        assert decode.kv_imported_blocks == explain["pd"]["transfer_tokens"] // 64
        assert srv.fleet.dispatcher.disagg.plane.inflight == {}  # type: ignore[union-attr]
        # the answer is the same text a plain request gets (the simulated text depends on the prompt only)
        plain = await srv.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16)
        assert plain.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks
                                                           if c.choices)


async def test_the_plane_cap_holds_under_a_burst_and_the_rest_prefill_locally(server_factory):
    async with server_factory(execution_group=fleet(1), routing={"seed": 7, "disaggregation": {"mode": "always"}},
                              scheduler={"enabled": False}, simulation={"speedup": 2.0}) as srv:
        async def one(i: int) -> str:
            r = await srv.client.completions.create(model=MODEL, prompt=f"burst {i} " + "long prompt " * 100,
                                                    max_tokens=8)
            return r.choices[0].finish_reason

        reasons = await asyncio.gather(*(one(i) for i in range(16)))
        assert reasons == ["length"] * 16  # nothing lost
        plane = srv.fleet.dispatcher.disagg.plane  # type: ignore[union-attr]
        assert plane.stats.peak_inflight == 1 and plane.inflight == {}
        m = srv.fleet.metrics
        started, full = m.pd_started._value.get(), m.pd_fallbacks.labels("plane_full")._value.get()  # type: ignore[attr-defined]
        assert started >= 1 and full >= 1 and started + full == 16
