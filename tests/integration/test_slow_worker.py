"""Slow-worker ejection on a live server (control/breaker.py through the fleet): one of four
simulated workers runs 10x slower; after a few requests it is ejected from routing (metric, /health,
the decisions' explanation name it and why), probed back half-open after its ejection time, and
ejected again for twice as long since the probe is slow too. Every request completes meanwhile."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from support.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
FLEET = {"nodes": [{"count": 3}, {"count": 1, "timing": {"speedup": 0.1}}]}  # worker-3 is the slow one
OUTLIER = {"window_s": 60.0, "factor": 3.0, "min_requests": 3, "min_itl_s": 0.004, "min_ttft_s": 10.0,
           "eject_s": 1.5, "max_eject_s": 10.0}


async def breaker(srv, wid: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{srv.base_url}/health") as r:
        body = await r.json()
    return next(w["breaker"] for w in body["workers"] if w["id"] == wid)


async def test_a_slow_worker_is_ejected_probed_and_ejected_again(server_factory):
    async with server_factory(execution_group=FLEET, simulation={"speedup": 1.0},
                              routing={"policy": "round_robin", "seed": 7},
                              control_plane={"outlier": OUTLIER}) as srv:
        async def one(i: int):
            r = await srv.client.completions.create(model=MODEL, prompt=f"request {i} " * 4, max_tokens=12,
                                                    extra_body={"explain": True})
            return r.model_extra["thunderagent"], r.choices[0].finish_reason

        first = await asyncio.gather(*(one(i) for i in range(16)))  # 4 per worker, round robin
        assert all(reason == "length" for _, reason in first)
        await wait_until(lambda: srv.fleet.outliers.breakers.blocked("worker-3") is not None, 5, "worker-3 ejected")
        assert await breaker(srv, "worker-3") == "open"
        assert [await breaker(srv, f"worker-{i}") for i in range(3)] == ["closed"] * 3
        after = [await one(100 + i) for i in range(6)]
        assert {e["worker"] for e, _ in after} <= {"worker-0", "worker-1", "worker-2"}
        why = after[0][0]["skipped"]["worker-3"]
        assert why.startswith("ejected (ITL ") and "x the fleet's median" in why
        async with aiohttp.ClientSession() as http, http.get(f"{srv.base_url}/metrics") as r:
            text = await r.text()
        assert 'thunderagent_worker_breaker_state{worker="worker-3"} 2.0' in text
        assert 'thunderagent_worker_ejections_total{worker="worker-3"} 1.0' in text
        # after its 1.5 s it is probed: one request at a time, slow again -> out for 3 s
        await wait_until(lambda: srv.fleet.outliers.breakers.blocked("worker-3") is None, 5, "worker-3 half-open")
        probes = await asyncio.gather(*(one(200 + i) for i in range(8)))
        assert sum(1 for e, _ in probes if e["worker"] == "worker-3") == 1  # one probe, not a quarter
        assert all(reason == "length" for _, reason in probes)
        await wait_until(lambda: srv.fleet.metrics.ejections.labels("worker-3")._value.get() == 2, 5,
                         "worker-3 ejected again after its slow probe")
        assert srv.fleet.outliers.breakers.blocked("worker-3").startswith("ejected (probe slow: ITL ")
