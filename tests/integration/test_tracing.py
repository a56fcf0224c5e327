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
