"""The Grafana dashboard (``deploy/grafana/thunderagent.json``, issue 13 item 4) names only metrics the server
really exports: every PromQL expression's metric names, and the labels it groups by, are checked against a
live server's ``/metrics`` after some traffic."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "thunderagent.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# PromQL words: functions, aggregations and keywords (anything followed by "(" is a call, not a metric)
METRIC = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: label matchers, ranges, strings and numbers stripped,
    calls and keywords dropped."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
    bare = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", bare)
    return {m for m in METRIC.findall(bare) if m not in KEYWORDS and not re.fullmatch(r"[\d.e+-]+", m)}


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for label in group.split(",") if label.strip()}


def exported(text: str) -> tuple[set[str], set[str]]:
    """Sample names the exposition declares (by each family's TYPE, so a labelled family with no children
    yet still counts) and every label name seen."""
    names, labels = set(), {"le"}
    for family in text_string_to_metric_families(text):
        names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
        for sample in family.samples:
            names.add(sample.name)
            labels |= set(sample.labels)
    return names, labels


def expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_extractor_strips_functions_labels_and_ranges():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(thunderagent_ttft_seconds_bucket{worker="w-1"}[5m]))) '
            "/ clamp_min(quantile(0.5, thunderagent_worker_queue_depth), 1)")
    assert metric_names(expr) == {"thunderagent_ttft_seconds_bucket", "thunderagent_worker_queue_depth"}
    assert grouping_labels("sum by (endpoint, status) (rate(x[1m]))") == {"endpoint", "status"}


async def test_every_dashboard_expression_names_an_exported_metric(server_factory):
    # cache migration on: its series are registered only then (the transfer plane's panels name them)
    mig = {"enabled": True, "link": {"enabled": True}}
    async with server_factory(routing={"migration": mig}) as srv:
        await asyncio.gather(*(srv.client.completions.create(model="thunderagent-sim", prompt="shared prefix " * 30,
                                                              max_tokens=8) for _ in range(6)))
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"{srv.base_url}/metrics", timeout=10)
                                       .read().decode())
        # a labelled family with no children yet (no migration happened) shows no label in the text
        declared = {label for c in vars(srv.fleet.metrics).values() for label in getattr(c, "_labelnames", ())}
    names, labels = exported(text)
    labels |= declared
    exprs = expressions()
    assert len({title for title, _ in exprs}) >= 12  # one panel per seed metric plus per-worker views
    missing = {(title, m) for title, e in exprs for m in metric_names(e) if m not in names}
    assert not missing, f"dashboard names metrics /metrics does not export: {sorted(missing)}"
    unknown = {(title, label) for title, e in exprs for label in grouping_labels(e) if label not in labels}
    assert not unknown, f"dashboard groups by labels no metric carries: {sorted(unknown)}"
    used = {m for _, e in exprs for m in metric_names(e)}
    for seed in ("thunderagent_cached_tokens_total", "thunderagent_prefill_recompute_tokens_total",
                 "thunderagent_worker_queue_depth", "thunderagent_worker_kv_usage", "thunderagent_ttft_seconds_bucket",
                 "thunderagent_itl_seconds_bucket", "thunderagent_routed_total"):
        assert seed in used, seed
