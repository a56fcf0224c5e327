"""Overload (issue 11 item 6): `thunderagent serve` with 2 simulated workers at 3x what they sustain.

Runs ``bench/overload.py``'s code for a short window (``THUNDERAGENT_OVERLOAD_S``, default 8 s; the
bench runs 60 s) against a real server process with the default admission (the scheduler's bounded
holding queue, dispatching into free sequence slots, ``admit_ttft_factor`` 2), and again with the
latency gate (``scheduler.prefills_in_flight: 1``): no worker falsely marked
unhealthy, nothing purged from the index, the excess refused with 429 + Retry-After, admitted
requests' TTFT p99 near an unloaded run's, the server's RSS bounded and back near its baseline,
healthy and serving right after.

The TTFT check has a margin for a loaded 2-core CI machine (see the asserts and README "Overload")."""

from __future__ import annotations

import os

import pytest

from support.bench import load_bench

pytestmark = [pytest.mark.integration, pytest.mark.reliability]


def _check_liveness(rep, seconds: float) -> str:  # type: ignore[no-untyped-def]
    """What every overload run must show, timing aside; returns the run's report."""
    report = "\n".join(rep.lines())
    ov = rep.overload
    assert rep.capacity_rps > 2, report
    # liveness: nobody falsely declared dead, nothing purged
    assert rep.counters["lease_expired"] == 0 and rep.counters["index_purged"] == 0, report
    assert rep.unhealthy_seen == 0, report
    # the excess is refused with 429 + Retry-After; what is admitted completes
    assert ov.count(429) > 0.3 * len(ov.shots), report
    assert all(s.retry_after and int(s.retry_after) >= 1 for s in ov.shots if s.status == 429), report
    assert set(s.status for s in ov.shots) <= {200, 429}, report
    assert ov.count(200) >= 0.6 * rep.capacity_rps * seconds, report
    # memory bounded during the load and back near its baseline after
    assert rep.rss_peak_mb < rep.rss_base_mb * 1.5 + 20, report
    assert rep.rss_after_mb < rep.rss_base_mb * 1.2 + 10, report
    # healthy and serving right after
    assert rep.health_after[0] == 200 and rep.health_after[1]["healthy_workers"] == 2, report
    assert rep.served_after == 200, report
    return report


@pytest.mark.parametrize("gate", [False, True], ids=["defaults", "prefills_in_flight_1"])
async def test_three_times_capacity_is_refused_not_fatal(tmp_path, gate):
    seconds = float(os.environ.get("THUNDERAGENT_OVERLOAD_S", "8"))
    # admitted requests' TTFT stays near an unloaded fleet's: they go into free slots, none waits long.
    # p90 carries the tight check (defaults, the gate engaged by the refusals: ~1.5x; before that gate
    # 2-2.5x; the admission bound off: ~11x, the one-per-pass engine gate instead of free slots: ~6x);
    # on a shared 2-core machine one stall of the event loop lands in the p99 of a few hundred
    # samples, so p99 gets a loose bound (off: 6-12x). With the latency gate
    # (``scheduler.prefills_in_flight: 1``) a request is sent only to a worker with no prefill of ours
    # in flight: it waits at most for a decode pass, never for another's prefill (60 s bench: p90
    # 1.5x, p99 1.5x; defaults 2.3x / 1.9-2.5x).
    p90_bound = 2.0 if gate else 3.0
    reports = []
    for attempt in range(2):
        rep = await load_bench("overload").run(seconds, 3.0, unloaded_s=2.0, capacity_s=4.0, settle_s=2.0,
                                 log_path=tmp_path / f"serve{attempt}.log",
                                 extra_config="scheduler: {prefills_in_flight: 1}" if gate else "")
        ov = rep.overload
        if attempt == 0 and ov.count(429) <= 0.3 * len(ov.shots) and rep.ttft_ratio(0.5) < 1.2:
            # Few refused at "3x" and the admitted ones served without waiting: the capacity phase under-measured
            # (a stall of the shared machine during its 4 s: one CI run measured 3.0/s, then served all 71
            # requests of the "3x" phase at 1.5x unloaded TTFT; another 3.7/s, then 81 of 89 at 1.00x), so the
            # offered load was no overload. Measured again, as a timing miss is below.
            reports.append("\n".join(rep.lines()))
            continue
        reports.append(_check_liveness(rep, seconds))
        if rep.ttft_ratio(0.9) < p90_bound and rep.ttft_ratio_p99 < 8.0:
            return
        # A timing miss is measured once more before it fails: these ratios are taken on a shared
        # 2-core machine (quiet: 1.4-1.6x in 8 of 8 runs; a CI run under a load average of 2.8 saw
        # 3.9x with the gate), and the liveness checks above hold in every run.
    joined = "\n--- measured again ---\n".join(reports)
    raise AssertionError(f"admitted TTFT p90 >= {p90_bound}x unloaded or p99 >= 8x, or capacity under-measured, "
                         f"in two runs:\n{joined}")


@pytest.mark.parametrize("speedup", [1.0, 0.5])
async def test_a_burst_of_100_streams_on_3_workers_is_all_admitted(server_factory, speedup):
    """An ordinary burst is not overload: 100 concurrent streams on 3 workers (256 sequence slots each)
    with the default admission all get 200, on workers at real speed and slowed down (a previous tight
    time bound refused some of these with 429)."""
    import asyncio

    import aiohttp

    body = {"model": "thunderagent-sim", "max_tokens": 120, "stream": True}

    async def stream(s: aiohttp.ClientSession, base: str, i: int) -> tuple[int, int]:
        async with s.post(base + "/v1/completions",
                          json={**body, "prompt": f"request {i}: tell me about the river. " * 4}) as r:
            events = 0
            async for line in r.content:
                events += line.startswith(b"data: {")
            return r.status, events

    cfg = {"execution_group": {"nodes": [{"count": 3}]}, "simulation": {"speedup": speedup}}
    async with server_factory(**cfg) as srv:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            # two bursts back to back (as the migration tests send them): the first measures the
            # service time and the dispatch gap the second is judged by
            for burst in range(2):
                got = await asyncio.wait_for(
                    asyncio.gather(*(stream(s, srv.base_url, 100 * burst + i) for i in range(100))), 90)
                assert [st for st, _ in got] == [200] * 100, f"burst {burst}"
                assert all(n >= 1 for _, n in got)
