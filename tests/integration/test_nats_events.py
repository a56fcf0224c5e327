"""A short run of ``bench/nats_events.py``: worker processes publish KV events through the real
worker publishing path while workers leave, crash and join; afterwards both frontend replicas'
indexes equal each other and every worker's own cache (a digest per worker: sorted hashes and
last seq)."""

from __future__ import annotations

import pytest

from support.bench import load_bench

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

pytestmark = [pytest.mark.nats, pytest.mark.integration]


def test_replicas_agree_after_churn():
    res = load_bench("nats_events").main(["--quick", "--json", "--settle", "20"])
    assert res is not None
    assert len(res["truth"]) == 5, res["truth"]  # 4 workers, 2 stopped, 1 crashed and back, 3 joined
    for name, state in res["states"].items():
        assert {w: s["digest"] for w, s in state.items()} == res["truth"], f"{name}: {state} vs {res['truth']}"
    assert res["agreement"]
    assert min(res["total"].values()) > 0
