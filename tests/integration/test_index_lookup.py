"""A short run of ``bench/index_lookup.py``: a remote index lookup over a real NATS server answers
exactly what the owner's index holds, and the benchmark's crossover comes out of measured costs."""

from __future__ import annotations

import math

import pytest

from support.bench import load_bench

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

pytestmark = [pytest.mark.nats, pytest.mark.integration]


def test_remote_lookups_answer_what_the_owner_holds():
    res = load_bench("index_lookup").main(["--blocks", "3000", "--lookups", "150", "--concurrency", "8"])
    assert res is not None
    assert res["wrong_answers"] == 0  # every answer equals find_matches on the same index, in this process
    assert 90 <= res["answers_with_holders"] <= 110  # the 2/3 of queries that hit or partly hit
    assert 0 < res["rtt_p50_us"] <= res["rtt_p99_us"]
    assert res["lookups_s"] > 0 and res["ingest_us"] > 0
    assert math.isfinite(res["crossover_blocks_n2"]) and res["crossover_blocks_n2"] > 0
