"""OpenTelemetry spans of ThunderAgent's own (``control_plane.tracing``, off by default; the ``otel`` extra).

Each inference request (the token path, relayed requests, vLLM's other paths) gets one server span, a child of the
client's ``traceparent`` when it sent one, else the root of a new trace. The engine server is sent *our* span's
``traceparent`` (``frontend/trace_context.py``), so a vLLM or SGLang server started with
``--otlp-traces-endpoint`` makes its spans children of ours: one trace shows the client, ThunderAgent's routing and
queueing, and the engine. The span carries what the router decided (worker, reason, cached blocks it expected, time
held in the scheduler, migrations) and what the request used (prompt and completion tokens), under OpenTelemetry's
HTTP and GenAI attribute names where they exist, ``thunderagent.*`` otherwise.

Spans are batched and exported over OTLP/HTTP by the SDK's own thread (the event loop never waits on the
collector); a collector that is down loses spans, never requests. Sampling: a client's ``traceparent`` decides
(sampled or not), a new trace is recorded with probability ``sample_ratio``. With tracing off nothing of
OpenTelemetry is imported and requests pay nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from thunderagent.config import ConfigError
from thunderagent.config.observe import TracingConfig
from thunderagent.frontend.tenant_gate import GENERATION
from thunderagent.frontend.trace_context import OUR_PARENT

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Collection

log = logging.getLogger(__name__)

TRACING_KEY = web.AppKey("tracing", object)
#: an export's deadline, retries included (the SDK's default is 10 s): a collector that is down holds back the
#: frontend's shutdown (the last batch is flushed) no longer than this
EXPORT_TIMEOUT_S = 2.0


class Tracing:
    """The tracer provider of one frontend (not OpenTelemetry's global one: ours is built here, passed in)."""

    def __init__(self, cfg: TracingConfig, paths: Collection[str]) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ConfigError("control_plane.tracing.otlp_endpoint needs OpenTelemetry: pip install "
                              "'thunderagent[otel]'") from exc
        assert cfg.otlp_endpoint is not None
        self.provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint,
                                                                             timeout=EXPORT_TIMEOUT_S)))
        self._tracer = self.provider.get_tracer("thunderagent")
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._in_context = SpanKind.SERVER, set_span_in_context
        self._error = Status(StatusCode.ERROR)
        self._paths = frozenset(paths)
        log.info("tracing: spans of %s exported to %s (sample ratio %g)", cfg.service_name, cfg.otlp_endpoint,
                 cfg.sample_ratio)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        route = request.match_info.route.resource
        path = route.canonical if route is not None else request.path
        if path not in self._paths:
            return await handler(request)
        span = self._tracer.start_span(f"{request.method} {path}", context=self._propagator.extract(request.headers),
                                       kind=self._kind, attributes={"http.request.method": request.method,
                                                                    "http.route": path})
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(span))
        if "traceparent" in carrier:
            request[OUR_PARENT] = carrier["traceparent"]
        status = 500  # (an exception past the error middleware: the server's own failure)
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if span.is_recording():
                _annotate(span, request.get(GENERATION), status)
                if status >= 500:
                    span.set_status(self._error)
            span.end()

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporter (blocking, bounded by the exporter's timeout)."""
        self.provider.shutdown()


def _annotate(span: Any, gen: Any, status: int) -> None:
    """The request's routing and use (``gen``: its :class:`~thunderagent.control.generation.Generation`, if it
    started)."""
    span.set_attribute("http.response.status_code", status)
    if gen is None:
        return
    d = gen.decision
    span.set_attributes({
        "thunderagent.request_id": gen.request_id, "thunderagent.worker": d.worker_id,
        "thunderagent.route.reason": d.reason, "thunderagent.route.cached_blocks": d.overlap_blocks,
        "thunderagent.queue_wait_s": gen.dispatch.queue_wait, "thunderagent.migrations": gen.migrations,
        "gen_ai.usage.input_tokens": gen.prompt_tokens, "gen_ai.usage.output_tokens": len(gen.produced),
    })
    if gen.program_id is not None:
        span.set_attribute("thunderagent.program_id", gen.program_id)


def make_tracing(cfg: TracingConfig, paths: Collection[str]) -> Tracing | None:
    """The frontend's tracing, or None when ``otlp_endpoint`` is not set."""
    return None if cfg.otlp_endpoint is None else Tracing(cfg, paths)
