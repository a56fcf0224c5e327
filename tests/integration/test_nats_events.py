"""A short run of ``bench/nats_events.py``: worker processes publish KV events through the real
worker publishing path while workers leave, crash and join; afterwards both frontend replicas'
indexes equal each other and every worker's own cache (a digest per worker: sorted hashes and
last seq)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

pytestmark = [pytest.mark.nats, pytest.mark.integration]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "nats_events.py"


def test_replicas_agree_after_churn():
    spec = importlib.util.spec_from_file_location("_bench_nats_events", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    res = bench.main(["--quick", "--json", "--settle", "20"])
    assert res is not None
    assert len(res["truth"]) == 5, res["truth"]  # 4 workers, 2 stopped, 1 crashed and back, 3 joined
    for name, state in res["states"].items():
        assert {w: s["digest"] for w, s in state.items()} == res["truth"], f"{name}: {state} vs {res['truth']}"
    assert res["agreement"]
    assert min(res["total"].values()) > 0
