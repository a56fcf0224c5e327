"""ThunderAgent's own spans (``control_plane.tracing``) exported over OTLP/HTTP to a collector the test runs on
127.0.0.1 (``support/otlp_collector.py``: it decodes the protobuf export): a span per request,
child of the client's traceparent; the engine server is sent a traceparent whose parent is that span."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from support.openai_backend import MODEL as OPENAI_MODEL
from support.openai_backend import OpenAIBackend
from support.server import running_server
from support.waiting import wait_until
from thunderagent.config import ConfigError, parse_config
from thunderagent.frontend.app import create_app

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the otel extra")
from support.otlp_collector import otlp_collector  # noqa: E402

pytestmark = pytest.mark.integration

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def _flush(app: web.Application) -> None:
    from thunderagent.frontend.tracing import TRACING_KEY
    app[TRACING_KEY].provider.force_flush()  # type: ignore[attr-defined]


async def test_spans_of_relayed_requests_are_children_of_the_clients_and_parents_of_the_servers() -> None:
    backend = OpenAIBackend("a")
    await backend.start()
    try:
        with otlp_collector() as col:
            cfg = parse_config({
                "model_name": OPENAI_MODEL,
                "control_plane": {"heartbeat_interval": 0.1, "heartbeat_misses": 5,
                                  "tracing": {"otlp_endpoint": col.url, "service_name": "router-a"}},
                "execution_group": {"nodes": [{"engine": "openai", "block_size": 16,
                                               "endpoints": [{"url": backend.url}]}]},
            }, "test")
            async with running_server(cfg) as srv, aiohttp.ClientSession() as s:
                await wait_until(lambda: len(srv.fleet.routable()) == 1, 10, "the server heartbeats")
                chat = {"model": OPENAI_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                parent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
                async with s.post(srv.base_url + "/v1/chat/completions", json=chat,
                                  headers={"traceparent": parent, "tracestate": "vendor=1"}) as r:
                    assert r.status == 200
                sent = backend.headers[-1]
                async with s.post(srv.base_url + "/v1/chat/completions", json=chat) as r:  # no trace of the client's
                    assert r.status == 200
                untraced = backend.headers[-1]
                unsampled = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
                async with s.post(srv.base_url + "/v1/chat/completions", json=chat,
                                  headers={"traceparent": unsampled}) as r:
                    assert r.status == 200
                quiet = backend.headers[-1]
                async with s.get(srv.base_url + "/health") as r:  # not an inference path: no span
                    assert r.status == 200
                await asyncio.to_thread(_flush, srv.app)
            spans = col.spans
            assert [sp["name"] for sp in spans] == ["POST /v1/chat/completions"] * 2  # the unsampled one: none
            first, second = spans
            # a child of the client's span, in its trace
            assert (first["trace_id"], first["parent"], first["service"]) == (TRACE_ID, CLIENT_SPAN, "router-a")
            assert first["kind"] == 2 and not first["error"]  # SERVER
            # the server got our span as its parent, with the client's tracestate
            assert sent["traceparent"] == f"00-{TRACE_ID}-{first['span_id']}-01"
            assert sent["tracestate"] == "vendor=1"
            a = first["attrs"]
            assert a["http.response.status_code"] == 200 and a["http.route"] == "/v1/chat/completions"
            assert a["thunderagent.worker"] == "worker-0" and a["gen_ai.usage.input_tokens"] > 0
            assert a["gen_ai.usage.output_tokens"] == 3 and a["thunderagent.queue_wait_s"] >= 0
            # a request without a traceparent: a new trace rooted here, passed on
            assert second["parent"] == "" and second["trace_id"] != TRACE_ID
            assert untraced["traceparent"][:-2] == f"00-{second['trace_id']}-{second['span_id']}-"
            assert int(untraced["traceparent"][-2:], 16) & 1  # sampled (03: its trace id is random too, W3C level 2)
            assert "tracestate" not in untraced
            # the client said "not sampled": nothing recorded, and the server is told so under a span of ours
            assert quiet["traceparent"].startswith(f"00-{TRACE_ID}-") and quiet["traceparent"].endswith("-00")
            assert quiet["traceparent"] != unsampled
    finally:
        await backend.stop()


async def test_token_path_spans_and_errors(server_factory) -> None:
    with otlp_collector() as col:
        async with server_factory(control_plane={"tracing": {"otlp_endpoint": col.url}},
                                  execution_group={"nodes": [{"count": 2}]}) as srv, aiohttp.ClientSession() as s:
            body = {"model": "thunderagent-sim", "prompt": "a traced prompt " * 20, "max_tokens": 4}
            async with s.post(srv.base_url + "/v1/completions", json=body) as r:
                assert r.status == 200
                worker = r.headers["x-thunderagent-worker"]
            async with s.post(srv.base_url + "/v1/completions", json={**body, "model": "nope"}) as r:
                assert r.status == 404
            await asyncio.to_thread(_flush, srv.app)
        ok, refused = col.spans
        assert ok["service"] == "thunderagent" and ok["attrs"]["thunderagent.worker"] == worker
        assert ok["attrs"]["gen_ai.usage.output_tokens"] == 4 and ok["attrs"]["thunderagent.route.reason"]
        assert refused["attrs"]["http.response.status_code"] == 404 and "thunderagent.worker" not in refused["attrs"]
        assert not refused["error"]  # a client's mistake is not the server's error


async def test_a_collector_that_is_down_costs_no_request(server_factory) -> None:
    """Spans to a closed port: the requests are served; the export fails off the loop."""
    async with server_factory(control_plane={"tracing": {"otlp_endpoint": "http://127.0.0.1:9/v1/traces"}}) as srv:
        for i in range(3):
            r = await srv.client.completions.create(model="thunderagent-sim", prompt=f"p{i}", max_tokens=2)
            assert r.choices[0].finish_reason in ("length", "stop")


def test_tracing_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="sample_ratio acts only with tracing.otlp_endpoint"):
        parse_config({"control_plane": {"tracing": {"sample_ratio": 0.5}}}, "t")
    with pytest.raises(ConfigError, match="otlp_endpoint must be an http"):
        parse_config({"control_plane": {"tracing": {"otlp_endpoint": "grpc://x:4317"}}}, "t")
    create_app(parse_config({}, "t"))  # off: nothing of OpenTelemetry built


@pytest.mark.nats
async def test_over_nats_the_worker_process_spans_between_the_frontend_and_the_server(tmp_path) -> None:
    """A frontend process and a worker process on NATS, both exporting: the worker's span is a child of the
    frontend's (whose parent is the client's), the server is sent the worker's span as its parent, and the span says
    which worker and engine served it, with its first output marked."""
    pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")
    import signal

    from integration.nats_cluster import Cluster

    backend = OpenAIBackend("a")
    await backend.start()
    cluster = Cluster(tmp_path)
    fast = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # (export each batch within 50 ms)
    try:
        with otlp_collector() as col:
            cluster.config.write_text(
                f"model_name: {OPENAI_MODEL}\ncontrol_plane: {{heartbeat_interval: 0.2, heartbeat_misses: 5, "
                f"tracing: {{otlp_endpoint: \"{col.url}\", service_name: fleet-a}}}}\nexecution_group:\n  nodes:\n"
                f"    - {{engine: openai, block_size: 16, endpoints: [{{url: \"{backend.url}\"}}]}}\n")
            cluster.start_nats()
            cluster.start_worker("w0", env=fast)
            cluster.start_frontend("fa", env=fast)
            client = cluster.client("fa")

            def ask() -> int:
                try:
                    raw = client.chat.completions.with_raw_response.create(
                        model=OPENAI_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
                except Exception:  # (not up yet)
                    return 0
                return raw.http_response.status_code

            for _ in range(300):  # the frontend up and the worker met (60 s at most)
                if await asyncio.to_thread(ask) == 200:
                    break
                assert not any(cluster.exited(p) for p in ("fa", "w0")), cluster.logs()
                await asyncio.sleep(0.2)
            sent = backend.headers[-1]
            for name in ("fa", "w0"):  # (SIGTERM: each flushes what is batched on its way out)
                cluster.kill(name, signal.SIGTERM)

            def both() -> list[dict]:
                spans = col.named("fleet-a")
                return spans if {"POST /v1/chat/completions", "thunderagent.worker generate"} <= {
                    s["name"] for s in spans} else []

            spans = await wait_until(both, 10, "the frontend's and the worker's spans")
        front = next(s for s in spans if s["name"] == "POST /v1/chat/completions")
        worker = [s for s in spans if s["name"] == "thunderagent.worker generate"][-1]
        assert (front["trace_id"], front["parent"]) == (TRACE_ID, CLIENT_SPAN)
        assert (worker["trace_id"], worker["parent"], worker["kind"]) == (TRACE_ID, front["span_id"], 2)
        assert sent["traceparent"] == f"00-{TRACE_ID}-{worker['span_id']}-01"  # the server's parent: the worker's
        a = worker["attrs"]
        assert (a["thunderagent.worker"], a["thunderagent.engine"], a["thunderagent.finish_reason"]) == (
            "w0", "openai", "length") and a["gen_ai.usage.input_tokens"] > 0 and not worker["error"]
        assert worker["events"] == ["first token"]
    finally:
        cluster.close()
        await backend.stop()


def test_worker_spans_only_for_traced_requests_and_unsampled_ones_pass_on() -> None:
    """``execution/worker_spans.py`` alone: a request without a trace context gets no span and keeps its headers; an
    unsampled parent gives a span that records nothing, and the server is still told (flags unchanged); a refused
    request's span ends as an error."""
    from thunderagent.config.observe import TracingConfig
    from thunderagent.execution.worker_spans import WorkerSpans
    from thunderagent.types import EngineRequest, FinishReason, TokenOutput

    with otlp_collector() as col:
        spans = WorkerSpans(TracingConfig(otlp_endpoint=col.url, service_name="w"), "w0", "vllm")

        def req(*headers: tuple[str, str]) -> EngineRequest:
            r = EngineRequest("r1", [1, 2, 3], [], 0, 4)
            r.headers = headers
            return r

        plain = req(("x-request-id", "abc"))
        assert spans.start(plain) is None and plain.headers == (("x-request-id", "abc"),)
        quiet = req(("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-00"))
        span = spans.start(quiet)
        assert span is not None and not span.is_recording()
        assert dict(quiet.headers)["traceparent"].startswith(f"00-{TRACE_ID}-") and \
            dict(quiet.headers)["traceparent"].endswith("-00")
        spans.outputs(span, [TokenOutput("r1", [7], 0.0, 3, 0, True, FinishReason.STOP)], 0, False)
        failed = req(("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01"), ("tracestate", "v=1"))
        span = spans.start(failed)
        assert dict(failed.headers)["tracestate"] == "v=1"  # (kept with our traceparent)
        spans.end(span, FinishReason.ERROR, 0)
        spans.shutdown()
        got = col.named("w")
    assert len(got) == 1 and got[0]["error"] and got[0]["parent"] == CLIENT_SPAN
    assert got[0]["attrs"]["thunderagent.finish_reason"] == "error"
