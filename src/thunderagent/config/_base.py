"""The base of every config section: strict (unknown fields are errors), validated on assignment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration file or option is invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
