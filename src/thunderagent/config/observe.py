"""The decision log's config section (``control_plane.decision_log``; ``observe/decision_log.py``)."""

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
