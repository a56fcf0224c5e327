"""Smoke test of the benchmark scripts (bench/): they import and run on tiny sizes.

Only the in-process benchmarks (route decision, index ingest); no network, no subprocess. The Dynamo
comparison parts are skipped when ``dynamo`` (ai-dynamo-runtime, the ``compare`` extra) is missing.
"""

from __future__ import annotations

import math
import sys

import pytest

from support.bench import BENCH, load_bench


def _has_dynamo() -> bool:
    try:
        import dynamo.llm  # noqa: F401, PLC0415
    except Exception:
        return False
    return True


needs_dynamo = pytest.mark.skipif(
    not _has_dynamo(), reason="dynamo (ai-dynamo-runtime, 'compare' extra) is not importable"
)


def _positive(res: dict[str, float], keys: list[str]) -> None:
    for k in keys:
        assert k in res, k
        assert math.isfinite(res[k]) and res[k] > 0, (k, res[k])


def test_route_decision_ours_only() -> None:
    rd = load_bench("route_decision")
    res = rd.run(n_blocks=400, n_workers=4, n_queries=30, seed=3, with_peer=False)
    _positive(res, ["entries", "ours_hash_us", "ours_match_us", "ours_hash_match_us", "ours_full_us",
                    "ours_route_us", "ours_score_us"])
    assert res["entries"] >= 400
    assert "peer_hash_match_us" not in res


@needs_dynamo
def test_route_decision_with_dynamo() -> None:
    rd = load_bench("route_decision")
    res = rd.run(n_blocks=400, n_workers=4, n_queries=30, seed=3, with_peer=True)
    _positive(res, ["ours_full_us", "peer_hash_us", "peer_match_us", "peer_hash_match_us"])
    # both indexes hold the same content: per-worker overlaps agree on every query
    assert res["match_agreement"] == 1.0


def test_route_scale_runs_small() -> None:
    rs = load_bench("route_scale")
    rows = rs.run(at_1000=40_000, queries=30, seed=3, sizes=(8, 64))
    assert [r["workers"] for r in rows] == [8, 64]
    for r in rows:
        _positive(r, ["entries", "p50_us", "p99_us", "set_load_us"])  # RSS may not move at this size
    assert rows[1]["entries"] >= 2_560  # filled in proportion to the fleet
    _rows, fleets = rs.run(at_1000=40_000, queries=10, seed=3, sizes=(64,), keep=True)
    _positive(rs.one_out(fleets[0], 10), ["view_p50_us", "view_p99_us", "list_p50_us", "list_p99_us"])


def test_index_ingest_ours_only() -> None:
    ii = load_bench("index_ingest")
    res = ii.run(n_events=40, n_workers=4, rounds=1, seed=3, with_peer=False)
    _positive(res, ["blocks", "ours_bps", "ours_build_bps"])
    assert res["ours_entries"] == res["blocks"]  # random 64-bit hashes: every block is a new entry
    assert "peer_bps" not in res


@needs_dynamo
def test_index_ingest_with_dynamo() -> None:
    ii = load_bench("index_ingest")
    res = ii.run(n_events=40, n_workers=4, rounds=2, seed=3, with_peer=True)
    _positive(res, ["ours_bps", "peer_bps", "peer_encode_bps"])
    assert res["peer_check"] == 1.0


def test_fake_backend_builds() -> None:
    """The proxy benchmark's fake backend is importable and routes what sglang-router probes."""
    fb = load_bench("fake_backend")
    app = fb.create_backend()
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert {"/v1/completions", "/v1/chat/completions", "/health", "/server_info", "/model_info"} <= paths


def test_scheduler_overhead_bench_runs(monkeypatch, capsys) -> None:
    """bench/scheduler_overhead.py: one held-queue step per request keeps the queue at its size."""
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling _common
    mod = load_bench("scheduler_overhead")
    monkeypatch.setattr(mod, "PROGRAMS", 50)
    monkeypatch.setattr(mod, "HELD", 20)
    monkeypatch.setattr(sys, "argv", ["scheduler_overhead.py", "--quick"])
    mod.main()
    out = capsys.readouterr().out
    assert "scheduler path p99" in out and "held: prepare + submit + pump" in out


def test_hot_prefix_bench_runs(monkeypatch, capsys) -> None:
    """bench/hot_prefix.py: both arms on the same requests, the ratio line printed."""
    monkeypatch.syspath_prepend(str(BENCH))
    mod = load_bench("hot_prefix")
    monkeypatch.setattr(sys, "argv", ["hot_prefix.py", "--requests", "300", "--seeds", "0"])
    mod.main()
    out = capsys.readouterr().out
    assert "TTFT p99 plain/hot" in out and "target >= 1.2x" in out
    assert out.count("\n  0  ") == 2  # one row per arm


def test_migration_skew_bench_runs(monkeypatch, capsys) -> None:
    """bench/migration_skew.py: off and on on the same requests, the ratio line printed."""
    monkeypatch.syspath_prepend(str(BENCH))
    mod = load_bench("migration_skew")
    monkeypatch.setattr(sys, "argv", ["migration_skew.py", "--shapes", "pileup", "--seeds", "0", "--prefixes", "2",
                                      "--prefix-tokens", "8192", "--burst-s", "2"])
    mod.main()
    out = capsys.readouterr().out
    assert "pileup: TTFT p99 off/on" in out and out.count("pileup     0") == 2  # one row per arm


def test_pd_disagg_runs_on_the_excerpt(capsys, monkeypatch) -> None:
    pd = load_bench("pd_disagg")
    excerpt = BENCH.parent / "tests" / "data" / "mooncake_excerpt.jsonl"
    monkeypatch.setattr(sys, "argv", ["pd_disagg.py", "--trace", str(excerpt), "--limit", "40", "--splits", "1:3",
                                      "--modes", "conditional"])
    pd.main()
    out = capsys.readouterr().out
    assert "aggregated kv_aware 8" in out and "conditional 1:3" in out and "ITL p99 gain" in out


def test_program_table_in_process() -> None:
    pt = load_bench("program_table")
    res = pt.measure(sizes=(50, 500), steps=20)
    for n in ("50", "500"):
        _positive(res[n], ["step_us", "tick_us"])


def test_relay_reader_times_every_apis_stream() -> None:
    rr = load_bench("relay_reader")
    res = rr.measure(3)
    _positive(res, [f"{api}|{cut}" for api in ("chat", "messages", "responses")
                    for cut in ("one event per read", "one read")] + ["chat body|parsed by the frontend"])


def test_tokenize_prefix_measures_a_small_conversation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tp = load_bench("tokenize_prefix")
    tp.build_tokenizer(tmp_path)
    cached, plain = tp.HfTokenizer(tmp_path), tp.HfTokenizer(tmp_path, prefix_cache_bytes=0)
    docs = tp.conversation(20_000, plain)
    rows = tp.per_turn(docs, cached, plain)  # (it stops on ids that differ)
    assert len(rows) == len(docs) >= 3 and rows[-1][0] >= 20_000
    assert cached.cache is not None and cached.cache.hits == len(docs) - 1
    assert all(len(t) == len(d["messages"]) for t, d in zip(tp.plain_turns(docs), docs, strict=True))
