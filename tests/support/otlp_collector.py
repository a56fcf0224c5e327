"""An OTLP/HTTP traces endpoint for tests (127.0.0.1, a thread of its own): it decodes each protobuf export as Jaeger
or the OpenTelemetry Collector would and keeps every span, with its attributes as a dict. Used by ThunderAgent's
tracing tests and as the collector of a real vLLM server started with ``--otlp-traces-endpoint``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Collector:
    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, body: bytes) -> None:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        for rs in msg.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    span = {"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "service": service, "kind": s.kind,
                            "error": s.status.code == 2, "attrs": {a.key: _value(a.value) for a in s.attributes},
                            "events": [e.name for e in s.events]}
                    with self._lock:
                        self.spans.append(span)

    def named(self, service: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["service"] == service]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@contextmanager
def otlp_collector() -> Iterator[Collector]:
    holder: list[Collector] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status = 200 if self.path == "/v1/traces" else 404
            if status == 200:
                holder[0].add(body)
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Collector(server))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()
