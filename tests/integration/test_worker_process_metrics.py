"""``thunderagent worker --metrics-port``: what a vLLM sidecar's endpoint serves, and the refusals (what it serves
under real traffic is checked in ``test_nats_pd_bytes.py``: requests, KV blocks and bytes on both sides of a
transfer between worker processes, injected faults)."""

from __future__ import annotations

import re
import socket
from types import SimpleNamespace

import aiohttp
import pytest
from typer.testing import CliRunner

from support.waiting import free_port
from thunderagent.cli import app
from thunderagent.control.worker_metrics import metrics_endpoint
from thunderagent.execution.kv_stream import StreamStats
from thunderagent.execution.worker_counters import WorkerCounters
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored, FinishReason, LoadReport

pytestmark = pytest.mark.integration


def test_metrics_host_without_a_port_is_refused() -> None:
    r = CliRunner().invoke(app, ["worker", "--nats", "nats://127.0.0.1:9", "--metrics-host", "0.0.0.0"])
    assert r.exit_code == 2 and "--metrics-host needs --metrics-port" in r.output


def test_a_metrics_port_in_use_stops_the_worker_before_it_joins_the_bus() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the bus address is unreachable: a worker that tried to join it would fail with a bus error (exit 1)
        r = CliRunner().invoke(app, ["worker", "--nats", "nats://127.0.0.1:9", "--id", "w0",
                                     "--metrics-port", str(port)])
    assert r.exit_code == 2, r.output
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in r.output


async def test_a_vllm_sidecar_exports_its_servers_kv_event_stream_and_its_marks() -> None:
    # A stand-in for the worker service (what the endpoint reads of it) around a vLLM adapter's stream counters:
    # over NATS the adapter runs in the sidecar, so its stream's series come from there, named as serve names them.
    class Handle:
        def kv_stream_stats(self) -> StreamStats:
            return StreamStats(batches=7, gaps=1, replays=1, resyncs=0)

    counters = WorkerCounters(requests_accepted=3)
    counters.finished(FinishReason.STOP)
    counters.published([BlockStored("w0", 0, (1, 2, 3)), BlockRemoved("w0", 1, (1,)), AllBlocksCleared("w0", 2)])
    service = SimpleNamespace(worker_id="w0", instance="i1", wire_info=SimpleNamespace(engine="vllm", role="both"),
                              handle=Handle(),
                              counters=counters, cordoned=True, asleep=False, paused=False,
                              now_serving=lambda: (2, 1, LoadReport("w0", 0.0, 2, 1, 0, 0, 5, 9, 100)))
    port = free_port()
    stop = await metrics_endpoint("127.0.0.1", port)(service)  # type: ignore[arg-type]
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            text = await r.text()
    finally:
        await stop()
    series = dict(re.findall(r"^(thunderagent_\S+) (\S+)$", text, re.MULTILINE))
    expect = {
        'thunderagent_kv_event_batches_total{outcome="applied",worker="w0"}': "7.0",
        'thunderagent_kv_event_batches_total{outcome="gap",worker="w0"}': "1.0",
        'thunderagent_worker_process_info{engine="vllm",instance="i1",role="both",worker="w0"}': "1.0",
        'thunderagent_worker_process_requests_accepted_total{worker="w0"}': "3.0",
        'thunderagent_worker_process_requests_finished_total{reason="stop",worker="w0"}': "1.0",
        'thunderagent_worker_process_requests_in_flight{worker="w0"}': "2.0",
        'thunderagent_worker_process_frontends{worker="w0"}': "1.0",
        'thunderagent_worker_process_kv_blocks_stored_total{worker="w0"}': "3.0",
        'thunderagent_worker_process_kv_blocks_removed_total{worker="w0"}': "1.0",
        'thunderagent_worker_process_kv_clears_total{worker="w0"}': "1.0",
        'thunderagent_worker_process_engine_waiting{worker="w0"}': "1.0",
        'thunderagent_worker_process_engine_kv_cached_blocks{worker="w0"}': "9.0",
        'thunderagent_worker_process_mark{mark="cordoned",worker="w0"}': "1.0",
        'thunderagent_worker_process_mark{mark="paused",worker="w0"}': "0.0",
    }
    assert {k: series.get(k) for k in expect} == expect
    assert not any("kv_bytes" in k for k in series)  # no simulated KV bytes in this process
