"""The base of every config section: strict (unknown fields are errors), validated on assignment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration file or option is invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def knob_needs_switch(model: type[BaseModel], value: object, field: str | None, switch_on: bool, switch: str) -> object:
    """A tuning knob set to anything but its default while its feature is off would not act: refuse
    it. (The default is accepted: a dumped config, defaults filled in, must load again.)"""
    assert field is not None
    if value != model.model_fields[field].default and not switch_on:
        raise ValueError(f"acts only with {switch}: true; enable it or remove this field")
    return value
