"""The decision log's config section (``control_plane.decision_log``; ``observe/decision_log.py``) and the tracing
one (``control_plane.tracing``; ``frontend/tracing.py``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from thunderagent.config._base import _Strict


class DecisionLogConfig(_Strict):
    path: str | None = Field(None, description="JSON-lines file of routing decisions; null: no log")
    sample_rate: float = Field(
        1.0, ge=0.0, le=1.0, description="share of requests logged, chosen by request id (a request's decisions "
        "are all logged or none)",
    )
    max_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="the file is rotated when it would grow past this")
    backups: int = Field(
        3, ge=0, le=100, description="rotated files kept (path.1 newest ... path.N); 0: the file starts over when full",
    )

    @model_validator(mode="after")
    def _knobs_need_path(self) -> DecisionLogConfig:
        # every knob acts only with a file: refuse one set while the log is off (defaults pass: a dump reloads)
        if self.path is None:
            for name in ("sample_rate", "max_bytes", "backups"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"{name} acts only with decision_log.path set; set path or remove {name}")
        return self


class TracingConfig(_Strict):
    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces endpoint of a collector (Jaeger, Tempo, the OpenTelemetry Collector), e.g. "
        "http://127.0.0.1:4318/v1/traces: each request gets a server span, parent of the engine server's (needs the "
        "otel extra); null: no spans of ours (a client's traceparent is still passed on)",
    )
    service_name: str = Field("thunderagent", min_length=1, description="the spans' service.name")
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="share of the traces started here that are recorded; a request whose "
        "traceparent says sampled or not is recorded as it says",
    )

    @model_validator(mode="after")
    def _knobs_need_endpoint(self) -> TracingConfig:
        if self.otlp_endpoint is None:
            for name in ("service_name", "sample_ratio"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"{name} acts only with tracing.otlp_endpoint set; set it or remove {name}")
        elif not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be an http:// or https:// URL (OTLP over HTTP), got "
                             f"{self.otlp_endpoint!r}")
        return self
