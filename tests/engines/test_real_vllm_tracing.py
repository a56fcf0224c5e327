"""One trace across ThunderAgent and a real vLLM server (CPU build) started with ``--otlp-traces-endpoint``: both
export to the same collector (``support/otlp_collector.py``, OTLP over HTTP), and vLLM's span of the request is a
child of ThunderAgent's, itself a child of the client's ``traceparent``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the otel extra")

from support.otlp_collector import Collector, otlp_collector  # noqa: E402
from support.waiting import wait_until  # noqa: E402
from tests.engines.conftest import engine_python, front_config, one_server, thunderagent  # noqa: E402
from tests.engines.vllm_env import VllmServer, cpu_binding  # noqa: E402

pytestmark = pytest.mark.real_engine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    with otlp_collector() as col:
        yield col


@pytest.fixture(scope="module")
def traced_server(engine_tmp: Path, tiny_model_dir: Path, collector: Collector) -> Iterator[VllmServer]:
    workdir = engine_tmp / "vllm-traced"
    server = VllmServer("traced", engine_python(workdir), tiny_model_dir, workdir, cpu=cpu_binding(1),
                        extra_args=("--otlp-traces-endpoint", collector.url),
                        extra_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    with one_server(server, "vLLM server with tracing"):
        yield server


async def test_vllm_spans_are_children_of_thunderagents(tiny_model_dir: Path, traced_server: VllmServer,
                                                         collector: Collector) -> None:
    cfg = front_config(tiny_model_dir, [traced_server])
    cp = cfg.control_plane.model_copy(update={"tracing": cfg.control_plane.tracing.model_copy(
        update={"otlp_endpoint": collector.url})})
    cfg = cfg.model_copy(update={"control_plane": cp})
    async with thunderagent(cfg, [traced_server]) as front, aiohttp.ClientSession() as s:
        for path, body in (("/v1/completions", {"prompt": "a traced request " * 8}),  # the token path
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],  # relayed
                                                     "logprobs": True})):
            async with s.post(front.base_url + path, json={"model": front.model, "max_tokens": 3, **body},
                              headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}) as r:
                assert r.status == 200, await r.text()
    # (ThunderAgent's spans are flushed when its server stops, above)
    ours = collector.named("thunderagent")
    assert [sp["attrs"]["http.route"] for sp in ours] == ["/v1/completions", "/v1/chat/completions"]
    assert all(sp["trace_id"] == TRACE_ID and sp["parent"] == CLIENT_SPAN for sp in ours)

    def requests() -> list[dict]:  # vLLM's span of each request (its start-up is traced too, in a trace of its own)
        return [sp for sp in collector.spans if sp["name"] == "llm_request" and sp["trace_id"] == TRACE_ID]

    await wait_until(lambda: len(requests()) >= 2, 30, "vLLM's request spans (its exporter batches them)")
    theirs = requests()
    assert sorted(sp["parent"] for sp in theirs) == sorted(sp["span_id"] for sp in ours), (ours, theirs)
    assert all("gen_ai.latency.time_to_first_token" in sp["attrs"] for sp in theirs)
