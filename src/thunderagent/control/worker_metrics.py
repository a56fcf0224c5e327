"""A worker process's own metrics endpoint (``thunderagent worker --metrics-port PORT``): ``GET /metrics`` in
Prometheus' text format, for a scrape of each worker sidecar (a Kubernetes pod's, beside its vLLM server).

The frontends export the fleet's view of each worker (``thunderagent_worker_*{worker}``: load as routed, health,
TTFT); this is the process's own account, under ``thunderagent_worker_process_*`` so the two never collide in
one Prometheus: the requests it took and how they ended, the KV events and heartbeats it published, the
frontends it hears, its engine's load as last reported, the operator marks it carries, a vLLM / SGLang server's
KV-event stream (``thunderagent_kv_event_batches_total{worker,outcome}``, as ``serve`` exports it for the servers
it drives itself: applied, gaps, replays, resyncs...), and, with simulated KV
bytes between processes (``kv_cache_transfer.sim_block_bytes``), the bytes it served and pulled, the checksums
verified, pull failures by cause and injected faults by kind (before: only in its log).

Everything is read at the scrape from the service's plain counters (``execution/worker_counters.py``), so a
worker without the endpoint pays nothing and one with it pays per scrape, not per request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from thunderagent.control.metrics import StreamCollector
from thunderagent.execution.kv_bytes import KvByteStats
from thunderagent.execution.kv_bytes_worker import KvBytesWorker
from thunderagent.execution.kv_stream import StreamStats
from thunderagent.execution.nats_worker import WorkerService

P = "thunderagent_worker_process_"


class WorkerProcessCollector:
    """Prometheus collector of one :class:`WorkerService` (registered on a registry of its own)."""

    def __init__(self, service: WorkerService) -> None:
        self.service = service

    def _byte_stats(self) -> KvByteStats | None:
        handle = self.service.handle
        return handle.service.stats if isinstance(handle, KvBytesWorker) else None

    def collect(self) -> Iterator[Metric]:
        s, c, w = self.service, self.service.counters, [self.service.worker_id]
        info = InfoMetricFamily(P[:-1], "this worker process", labels=["worker"])
        info.add_metric(w, {"engine": s.wire_info.engine, "role": s.wire_info.role, "instance": s.instance})
        yield info
        yield _counter("requests_accepted", "requests its engine took", w, c.requests_accepted)
        yield _by("requests_refused", "requests answered at once without running, by why", "why", w,
                  c.requests_refused)
        yield _by("requests_finished", "requests whose stream ended here, by finish reason", "reason", w,
                  c.requests_finished)
        streams, frontends, load = s.now_serving()
        yield _gauge("requests_in_flight", "requests streaming from here now", w, streams)
        yield _gauge("frontends", "frontends heard of within the lease", w, frontends)
        yield _counter("kv_event_batches", "KV event messages published", w, c.kv_batches)
        yield _counter("kv_blocks_stored", "blocks its KV events said were stored", w, c.kv_blocks_stored)
        yield _counter("kv_blocks_removed", "blocks its KV events said were evicted", w, c.kv_blocks_removed)
        yield _counter("kv_clears", "whole-cache clears its KV events said (a reset, a restart)", w, c.kv_clears)
        yield _counter("heartbeats", "heartbeats (and hellos) published", w, c.heartbeats)
        for name, doc, v in (("running", "requests its engine runs", load.running),
                             ("waiting", "requests queued in its engine", load.waiting),
                             ("kv_active_blocks", "KV blocks of running requests", load.kv_active_blocks),
                             ("kv_cached_blocks", "KV blocks holding a hash", load.kv_cached_blocks),
                             ("kv_total_blocks", "its engine's KV blocks", load.kv_total_blocks)):
            yield _gauge(f"engine_{name}", f"{doc}, as last reported", w, v)
        marks = GaugeMetricFamily(P + "mark", "operator marks it carries (1: set)", labels=["worker", "mark"])
        for mark, on in (("cordoned", s.cordoned), ("asleep", s.asleep), ("paused", s.paused)):
            marks.add_metric([*w, mark], float(on))
        yield marks
        b = self._byte_stats()
        if b is not None:
            yield _counter("kv_pulls_served", "KV offers sent whole to decode workers", w, b.pulls_served)
            yield _counter("kv_bytes_sent", "KV payload bytes sent", w, b.bytes_sent)
            yield _counter("kv_pulls_ok", "KV pulls done, every block verified", w, b.pulls_ok)
            yield _counter("kv_bytes_received", "verified KV payload bytes pulled", w, b.bytes_received)
            yield _counter("kv_checksums_verified", "KV block checksums verified", w, b.checksums_verified)
            yield _by("kv_pull_failures", "KV pulls failed, by cause", "cause", w, b.failures)
            yield _by("kv_faults_injected", "faults injected (kv_cache_transfer.sim_faults), by kind", "kind", w,
                      b.injected)


def _counter(name: str, doc: str, worker: list[str], value: int) -> CounterMetricFamily:
    m = CounterMetricFamily(P + name, doc, labels=["worker"])
    m.add_metric(worker, value)
    return m


def _gauge(name: str, doc: str, worker: list[str], value: float) -> GaugeMetricFamily:
    m = GaugeMetricFamily(P + name, doc, labels=["worker"])
    m.add_metric(worker, value)
    return m


def _by(name: str, doc: str, label: str, worker: list[str], counts: dict[str, int]) -> CounterMetricFamily:
    m = CounterMetricFamily(P + name, doc, labels=["worker", label])
    for key, n in sorted(counts.items()):
        m.add_metric([*worker, key], n)
    return m


def metrics_endpoint(host: str, port: int) -> Callable[[WorkerService], Awaitable[Callable[[], Awaitable[None]]]]:
    """``run_worker``'s ``on_started``: serve ``GET /metrics`` of the service on ``host:port`` until the worker
    stops. A port that cannot be bound fails the start before the worker joins the bus (ValueError naming it)."""

    async def start(service: WorkerService) -> Callable[[], Awaitable[None]]:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(WorkerProcessCollector(service))  # type: ignore[arg-type]

        def streams() -> dict[str, StreamStats]:  # a vLLM / SGLang server's KV-event stream, as serve exports it
            stats = getattr(service.handle, "kv_stream_stats", None)  # (EngineWorker's; simulated: none)
            return {service.worker_id: stats()} if stats is not None else {}

        registry.register(StreamCollector(streams))  # type: ignore[arg-type]

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise ValueError(f"--metrics-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        return runner.cleanup

    return start
