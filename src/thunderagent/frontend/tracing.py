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

from thunderagent.config.observe import TracingConfig
from thunderagent.frontend.tenant_gate import GENERATION
from thunderagent.frontend.trace_context import OUR_PARENT
from thunderagent.otel import otel

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Collection

log = logging.getLogger(__name__)

TRACING_KEY = web.AppKey("tracing", object)


class Tracing:
    """The tracer provider of one frontend (not OpenTelemetry's global one: ours is built here, passed in)."""

    def __init__(self, cfg: TracingConfig, paths: Collection[str]) -> None:
        parts = otel(cfg, "thunderagent")
        self.provider, self._tracer, self._propagator = parts.provider, parts.tracer, parts.propagator
        self._kind, self._in_context, self._error = parts.server_kind, parts.in_context, parts.error
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
