"""Spans of a ``thunderagent worker`` process (``control_plane.tracing`` in the config it runs with; the ``otel``
extra): over NATS a request's trace shows the frontend, the worker process and the engine server, not a gap between
the frontend's span and the server's.

A request that crosses the bus with the frontend's ``traceparent`` (``frontend/tracing.py`` puts its own span's
there) gets one span here, ``thunderagent.worker generate``, a child of the frontend's, from the message's arrival to
the last output sent back; the engine server is sent *this* span's ``traceparent`` in its place (the frontend's
``tracestate`` goes with it), so a vLLM server's spans are its children. Attributes: the worker, its engine, the
request id, prompt and output tokens, cached tokens, the finish reason; an event at the first token. A request
without a trace context gets no span (the worker starts no trace of its own), one whose parent is not sampled a
non-recording one (its ``traceparent`` passed on, flags unchanged). Spans are batched and exported by
OpenTelemetry's own thread; with tracing off nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import logging
from typing import Any

from thunderagent.config.observe import TracingConfig
from thunderagent.otel import otel
from thunderagent.types import EngineRequest, FinishReason, TokenOutput

log = logging.getLogger(__name__)

SPAN_NAME = "thunderagent.worker generate"


class WorkerSpans:
    """The tracer provider of one worker process (not OpenTelemetry's global one)."""

    def __init__(self, cfg: TracingConfig, worker_id: str, engine: str) -> None:
        parts = otel(cfg, "thunderagent.worker")
        self.provider, self._tracer, self._propagator = parts.provider, parts.tracer, parts.propagator
        self._kind, self._in_context, self._error = parts.server_kind, parts.in_context, parts.error
        self._attrs = {"thunderagent.worker": worker_id, "thunderagent.engine": engine}

    def start(self, req: EngineRequest) -> Any | None:
        """The request's span (None: it came without a trace context), its ``traceparent`` put in the request's
        headers in place of the frontend's."""
        carrier = {name: value for name, value in req.headers if name in ("traceparent", "tracestate")}
        if "traceparent" not in carrier:
            return None
        span = self._tracer.start_span(SPAN_NAME, context=self._propagator.extract(carrier), kind=self._kind,
                                       attributes={**self._attrs, "thunderagent.request_id": req.request_id,
                                                   "gen_ai.usage.input_tokens": len(req.prompt_tokens)})
        ours: dict[str, str] = {}
        self._propagator.inject(ours, context=self._in_context(span))
        if "traceparent" in ours:
            req.headers = tuple((name, ours["traceparent"] if name == "traceparent" else value)
                                for name, value in req.headers)
        return span

    def outputs(self, span: Any, batch: list[TokenOutput], produced: int, started: bool) -> tuple[int, bool]:
        """Outputs sent back: the first one with content marked (a relayed request's: the server's first bytes),
        and on the last one the span ends with what the request used. Returns the tokens produced so far and
        whether the first output went."""
        for o in batch:
            if not started and (o.token_ids or o.text or o.raw):
                started = True
                span.add_event("first token")
            produced += len(o.token_ids)
            if o.finished:
                self.end(span, o.finish_reason, produced, o.cached_tokens)
        return produced, started

    def end(self, span: Any, reason: FinishReason | None, produced: int, cached: int = 0) -> None:
        if span.is_recording():
            span.set_attributes({"gen_ai.usage.output_tokens": produced, "thunderagent.cached_tokens": cached,
                                 "thunderagent.finish_reason": reason.value if reason is not None else "cut"})
            if reason is FinishReason.ERROR:
                span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporter (blocking, bounded by the exporter's timeout)."""
        self.provider.shutdown()


def make_worker_spans(cfg: TracingConfig, worker_id: str, engine: str) -> WorkerSpans | None:
    """The worker process's spans, or None when ``otlp_endpoint`` is not set."""
    return None if cfg.otlp_endpoint is None else WorkerSpans(cfg, worker_id, engine)
