"""OpenTelemetry's parts as ThunderAgent's spans use them (``control_plane.tracing``; the ``otel`` extra): one tracer
provider per process (a frontend's: ``frontend/tracing.py``; a NATS worker process's: ``execution/worker_spans.py``),
not OpenTelemetry's global one. Imported only when tracing is on: with it off nothing of OpenTelemetry loads.

Spans are batched and exported over OTLP/HTTP by the SDK's own thread (the event loop never waits on the collector);
an export gives up after :data:`EXPORT_TIMEOUT_S`, retries included, so a collector that is down loses spans, never
requests, and holds back a shutdown (the last batch flushed) no longer than that. Sampling: a parent's decision is
kept (a client's ``traceparent``, the frontend's over the bus); a trace started here is recorded with probability
``sample_ratio``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thunderagent.config import ConfigError
from thunderagent.config.observe import TracingConfig

#: an export's deadline, retries included (the SDK's default is 10 s)
EXPORT_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Otel:
    provider: Any  # TracerProvider (shutdown() flushes and stops the exporter)
    tracer: Any
    propagator: Any  # W3C trace context
    server_kind: Any  # SpanKind.SERVER
    in_context: Any  # set_span_in_context
    error: Any  # Status(StatusCode.ERROR)


def otel(cfg: TracingConfig, tracer_name: str) -> Otel:
    """A tracer provider exporting to ``cfg.otlp_endpoint``; ConfigError when the ``otel`` extra is missing."""
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
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint,
                                                                    timeout=EXPORT_TIMEOUT_S)))
    return Otel(provider, provider.get_tracer(tracer_name), TraceContextTextMapPropagator(), SpanKind.SERVER,
                set_span_in_context, Status(StatusCode.ERROR))
