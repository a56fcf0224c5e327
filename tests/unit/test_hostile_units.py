"""The pieces behind hostile-input handling, without a network: the OpenAPI document matches the
app's routes, the error log is rate-limited per cause, the new limits are validated by name."""

from __future__ import annotations

import logging

import pytest

from thunderagent.config import ConfigError, parse_config
from thunderagent.frontend.app import create_app
from thunderagent.frontend.errorlog import ErrorLog
from thunderagent.frontend.openapi import openapi_document


@pytest.mark.parametrize("metrics", [True, False])
def test_openapi_document_describes_exactly_the_app_routes(metrics):
    cfg = parse_config({"metrics": {"enabled": metrics}})
    app = create_app(cfg)
    routes = {(r.resource.canonical, r.method.lower()) for r in app.router.routes() if r.method != "HEAD"}
    doc = openapi_document(cfg)
    documented = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert documented == routes
    assert doc["openapi"].startswith("3.1")
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == [cfg.model_name] and chat["logprobs"]["enum"] == [None, False]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_error_log_logs_once_per_cause_per_interval_with_the_suppressed_count(caplog):
    clock = Clock()
    errors = ErrorLog(logging.getLogger("test.errorlog"), interval_s=10.0, clock=clock)
    caplog.set_level(logging.WARNING, "test.errorlog")

    def boom() -> None:
        raise ValueError("bad")

    for _ in range(100):
        try:
            boom()
        except ValueError as exc:
            errors.exception(exc, "internal error")
        errors.warning("http:bad_http_request", "malformed request")
    assert [(r.getMessage(), bool(r.exc_info)) for r in caplog.records] == [
        ("internal error", True), ("malformed request", False)]
    caplog.clear()
    clock.t = 10.0
    errors.warning("http:bad_http_request", "malformed request")
    assert caplog.records[0].getMessage() == "malformed request [99 more like it suppressed in the last 10s]"


@pytest.mark.parametrize("field, value", [
    ("body_timeout_s", 0), ("idle_timeout_s", -1), ("max_header_bytes", 100), ("max_headers", 1),
    ("max_connections", 0), ("error_log_interval_s", 0),
])
def test_limits_are_validated_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"control_plane.{field}"):
        parse_config({"control_plane": {field: value}})
