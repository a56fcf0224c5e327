"""``thunderagent top`` refuses a URL it cannot scrape and reports a server that is not ThunderAgent
with a clear error instead of a traceback."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from thunderagent.cli import app
from thunderagent.cli import top as top_mod

HEALTH = json.dumps({"status": "ok", "workers": []}).encode()


def _said(result) -> str:  # result: click's Result
    """The error box's words on one line (rich wraps them inside a frame)."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


@pytest.mark.parametrize("url", ["notaurl", "localhost:8000", "http://", "ftp://127.0.0.1:8000"])
def test_a_url_without_http_scheme_and_host_is_refused_naming_the_option(url):
    result = CliRunner().invoke(app, ["top", "--url", url, "--once"])
    assert result.exit_code == 2
    said = _said(result)
    assert "'--url'" in said and "is not an http:// or https:// URL with a host" in said
    assert "Traceback" not in result.output


def test_a_metrics_path_without_leading_slash_is_refused():
    result = CliRunner().invoke(app, ["top", "--url", "http://127.0.0.1:1", "--metrics-path", "metrics", "--once"])
    assert result.exit_code == 2
    said = _said(result)
    assert "'--metrics-path'" in said and "'metrics' must start with '/'" in said


def _serving(monkeypatch, answers: dict[str, tuple[int, bytes]]) -> None:
    def fake_get(url: str, api_key: str | None, timeout: float) -> tuple[int, bytes]:
        return answers[url]

    monkeypatch.setattr(top_mod, "fetch", fake_get)


def test_another_server_is_a_clear_error(monkeypatch):
    _serving(monkeypatch, {"http://h/health": (404, b"<!DOCTYPE HTML><title>Error response</title>")})
    with pytest.raises(top_mod.ScrapeError, match="HTTP 404, not a ThunderAgent health report"):
        top_mod.scrape("http://h", None)
    _serving(monkeypatch, {"http://h/health": (200, b"[1, 2]")})  # JSON, but not a health report
    with pytest.raises(top_mod.ScrapeError, match="not a ThunderAgent health report"):
        top_mod.scrape("http://h", None)


def test_metrics_that_are_not_prometheus_text_are_a_clear_error(monkeypatch):
    _serving(monkeypatch, {"http://h/health": (200, HEALTH), "http://h/metrics": (200, b"<html>{{oops</html>\n")})
    with pytest.raises(top_mod.ScrapeError, match="not Prometheus metrics"):
        top_mod.scrape("http://h", None)


def test_a_fleet_with_no_healthy_worker_is_still_shown(monkeypatch):
    # /health answers 503 with its usual body when no worker is healthy: still a report to show
    metrics = b"# TYPE thunderagent_requests_total counter\nthunderagent_requests_total 3.0\n"
    _serving(monkeypatch, {"http://h/health": (503, HEALTH), "http://h/metrics": (200, metrics)})
    got = top_mod.scrape("http://h", None)
    assert got.health == {"status": "ok", "workers": []}
    assert got.samples["thunderagent_requests_total"] == [({}, 3.0)]
