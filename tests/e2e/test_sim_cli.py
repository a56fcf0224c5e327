"""`thunderagent sim` as a user runs it: table, JSON and plots; calibration against Dynamo's mocker."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_serve_cli import thunderagent_cmd

ROOT = Path(__file__).resolve().parents[2]
EXCERPT = ROOT / "tests" / "data" / "mooncake_excerpt.jsonl"
SHARED_MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def have_dynamo() -> bool:
    from thunderagent.sim.dynamo import dynamo_available

    return dynamo_available()


def run_sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*thunderagent_cmd(), "sim", *args], capture_output=True, text=True, timeout=900)


def test_sim_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(EXCERPT), "--workers", "4", "--speedup", "4", "--policy", "round_robin",
                  "--policy", "kv_aware", "--json", str(out), "--plots", str(tmp_path / "plots"))
    assert res.returncode == 0, res.stderr
    assert "kv_aware" in res.stdout and "round_robin" in res.stdout and "global LRU" in res.stdout
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["runs"]] == ["round_robin", "kv_aware"]
    for r in doc["runs"]:
        assert r["system"] == "thunderagent" and r["requests"] == 200
        assert set(r["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
        assert 0 <= r["prefix_reuse"] <= doc["bounds"]["infinite_cache_reuse"] + 1e-9
        assert r["throughput_rps"] > 0 and r["wall_s"] > 0
    assert 0 < doc["bounds"]["global_lru_reuse"] <= doc["bounds"]["infinite_cache_reuse"]
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["load_kv_aware.png", "load_round_robin.png", "reuse_vs_bound.png", "ttft_cdf.png"]


def test_sim_says_which_requests_ended_without_a_token_and_which_never_ended(tmp_path):
    # 16,384 tokens per worker: the excerpt's longer prompts are refused, and one that outgrows the
    # pool while decoding is rejected then; every request ends (most of them stayed queued for good
    # behind such a request, or behind rejections the driver never collected, and the table hid it)
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(EXCERPT), "--workers", "2", "--kv-blocks", "256", "--policy", "kv_aware",
                  "--json", str(out))
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["requests"] == 200 and run["extra"]["incomplete_requests"] == 0
    assert run["extra"]["rejected_requests"] == 55  # the excerpt's prompts over 16,384 tokens
    said = " ".join(res.stdout.split())
    assert "kv_aware: of 200 requests, 55 ended without a token (refused by their worker" in said
    res = run_sim("--trace", str(EXCERPT), "--workers", "2", "--policy", "kv_aware", "--horizon", "20")
    assert res.returncode == 0, res.stderr
    assert re.search(r"kv_aware: of 200 requests, \d+ not finished by the horizon", " ".join(res.stdout.split()))


def test_sim_rejects_bad_trace(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "many", "output_length": 3, "hash_ids": [1]}\n')
    res = run_sim("--trace", str(bad))
    assert res.returncode == 2 and "input_length" in res.stderr


@pytest.mark.skipif(not have_dynamo(), reason="ai-dynamo-runtime not installed (pip install -e '.[compare]')")
def test_sim_side_by_side_with_dynamo_on_excerpt(tmp_path):
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(EXCERPT), "--workers", "4", "--speedup", "4", "--compare-dynamo",
                  "--json", str(out))
    assert res.returncode == 0, res.stderr
    runs = {(r["system"], r["policy"]): r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {("thunderagent", "round_robin"), ("dynamo", "round_robin"),
                         ("thunderagent", "kv_aware"), ("dynamo", "kv_router")}
    ours, theirs = runs["thunderagent", "round_robin"], runs["dynamo", "round_robin"]
    # same engine model, same deterministic routing: the simulators agree (DDSketch: 0.1 % on percentiles)
    assert ours["ttft_ms"]["mean"] == pytest.approx(theirs["ttft_ms"]["mean"], rel=1e-3)
    assert ours["prefix_reuse"] == pytest.approx(theirs["prefix_reuse"], rel=1e-3)


@pytest.mark.skipif(not SHARED_MOONCAKE.exists(), reason=f"shared traces folder not found ({SHARED_MOONCAKE}): "
                    "the full-trace calibration needs the Mooncake conversation trace")
@pytest.mark.skipif(not have_dynamo(), reason="ai-dynamo-runtime not installed (pip install -e '.[compare]')")
def test_round_robin_calibrated_against_dynamo_on_full_mooncake(tmp_path):
    """Issue target: our round_robin within ±15 % of Dynamo's on TTFT mean and p50 (8 workers, x4)."""
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(SHARED_MOONCAKE), "--workers", "8", "--speedup", "4", "--policy", "round_robin",
                  "--compare-dynamo", "--json", str(out))
    assert res.returncode == 0, res.stderr
    runs = {r["system"]: r for r in json.loads(out.read_text())["runs"]}
    ours, theirs = runs["thunderagent"], runs["dynamo"]
    for key in ("mean", "p50"):
        assert ours["ttft_ms"][key] == pytest.approx(theirs["ttft_ms"][key], rel=0.15), key
    assert ours["prefix_reuse"] == pytest.approx(theirs["prefix_reuse"], rel=0.05)


AGENTIC_EXCERPT = ROOT / "tests" / "data" / "kv-cache-tester"


def test_sim_closed_loop_reports_session_figures(tmp_path):
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(AGENTIC_EXCERPT), "--workers", "2", "--closed-loop", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "closed loop" in res.stdout and "steps/min" in res.stdout and "Jain fairness" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["meta"]["closed_loop"] is True
    for r in doc["runs"]:
        x = r["extra"]
        assert r["requests"] == doc["meta"]["requests"] and x["incomplete_requests"] == 0
        assert x["sessions"] == 4 and x["unissued_requests"] == 0 and x["steps_per_min"] > 0
        assert set(x["session_completion_s"]) == {"n", "mean", "p50", "p99"} and x["session_completion_s"]["n"] == 4
        assert 0 < x["jain_fairness_steps"] <= 1


def test_sim_closed_loop_refuses_compare_dynamo():
    res = run_sim("--trace", str(EXCERPT), "--closed-loop", "--compare-dynamo")
    assert res.returncode == 2 and "--closed-loop" in res.stderr and "--compare-dynamo" in res.stderr


def test_sim_scheduler_off_and_on_side_by_side(tmp_path):
    """`--scheduler off --scheduler on`: the same requests with and without the holding queue, the
    scheduler's rows labelled and carrying queue waits; nothing left held, every request served (x40
    overloads two workers, so the queue really holds requests)."""
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(EXCERPT), "--workers", "2", "--speedup", "40", "--policy", "kv_aware",
                  "--scheduler", "off", "--scheduler", "on", "--json", str(out))
    assert res.returncode == 0, res.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["kv_aware", "kv_aware+scheduler"]
    off, on = runs
    assert off["requests"] == on["requests"] == 200
    assert "queue_wait_ms" not in off["extra"]
    assert on["extra"]["held_at_end"] == 0 and on["extra"]["queue_wait_ms"]["max"] >= 0
    assert set(on["extra"]["ttft_ms_by_priority"]) == {"0"}
    bad = run_sim("--trace", str(EXCERPT), "--scheduler", "maybe")
    assert bad.returncode == 2 and "maybe" in bad.stderr


def test_sim_pacing_off_paper_ours_cached_side_by_side(tmp_path):
    """`--pacing off --pacing paper --pacing ours --pacing cached` on the agentic excerpt with a KV too
    small for its programs: the paced rows pause and resume programs, every request of every program
    is still served, and the unpaced row carries no pacing figures."""
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(AGENTIC_EXCERPT), "--workers", "2", "--kv-blocks", "1200", "--closed-loop",
                  "--think-cap", "5", "--policy", "kv_aware", "--pacing", "off", "--pacing", "paper",
                  "--pacing", "ours", "--pacing", "cached", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "pacing:" in res.stdout and "pause cycles per program" in res.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["kv_aware", "kv_aware+pacing:paper", "kv_aware+pacing:ours",
                                           "kv_aware+pacing:cached"]
    assert "pacing" not in runs[0]["extra"]
    for r in runs:
        assert r["requests"] == 22 and r["extra"]["incomplete_requests"] == 0 and r["extra"]["unissued_requests"] == 0
    for r in runs[1:]:
        pc = r["extra"]["pacing"]
        assert pc["pauses"] >= 1 and pc["resumes"] >= 1
    capped = run_sim("--trace", str(AGENTIC_EXCERPT), "--think-cap", "5")
    assert capped.returncode == 2 and "--think-cap needs --closed-loop" in capped.stderr


@pytest.mark.skipif(not have_dynamo(), reason="ai-dynamo-runtime not installed (pip install -e '.[compare]')")
def test_sim_holding_queue_beside_dynamos_router_queue(tmp_path):
    """`--scheduler off --scheduler on --compare-dynamo`: Dynamo at its defaults, and Dynamo's
    kv_router with its router queue on (the threshold and order given) beside our holding queue."""
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(EXCERPT), "--workers", "2", "--speedup", "40", "--policy", "kv_aware",
                  "--scheduler", "off", "--scheduler", "on", "--compare-dynamo", "--dynamo-queue-threshold", "1.5",
                  "--dynamo-queue-policy", "fcfs", "--json", str(out))
    assert res.returncode == 0, res.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(r["system"], r["policy"]) for r in runs] == [
        ("thunderagent", "kv_aware"), ("dynamo", "kv_router"), ("thunderagent", "kv_aware+scheduler"),
        ("dynamo", "kv_router+queue(fcfs, 1.5)")]
    queued = runs[3]["extra"]["replay_args"]["router_config"]
    assert queued == {"router_queue_threshold": 1.5, "router_queue_policy": "fcfs"}
    assert "router_config" not in runs[1]["extra"]["replay_args"] and runs[3]["requests"] == 200


def test_plots_without_the_plots_extra_is_refused_before_the_replay(tmp_path, monkeypatch):
    """matplotlib and numpy are the `plots` extra: a lean install refuses --plots with the fix."""
    import importlib.util

    from typer.testing import CliRunner

    from thunderagent.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = CliRunner().invoke(app, ["sim", "--trace", str(EXCERPT), "--workers", "2", "--plots", str(tmp_path)],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert "pip install 'thunderagent[plots]'" in result.output and "requests," not in result.output


def test_sim_generates_traffic_scaled_to_the_fleet(tmp_path):
    out = tmp_path / "out.json"
    res = run_sim("--generate", "chat", "--workers", "6", "--requests-per-worker", "10", "--rate-per-worker", "2",
                  "--policy", "kv_aware", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "generated chat: 10 requests per worker at 2/s per worker" in res.stdout
    assert "routing decision (hash, admission, route) p50" in res.stdout and "blocks per virtual second" in res.stdout
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["requests"] == 60 and doc["meta"]["workers"] == 6
    assert 0 < run["decision_us"]["p50"] <= run["decision_us"]["p99"]
    assert run["extra"]["kv_event_blocks"] > 0


@pytest.mark.parametrize("args,message", [
    ((), "give --trace or --generate"),
    (("--generate", "chat", "--trace", str(EXCERPT)), "give --trace or --generate"),
    (("--trace", str(EXCERPT), "--requests-per-worker", "5"), "acts with --generate only"),
    (("--generate", "web"), "'web' is not one of"),
])
def test_sim_refuses_traffic_options_that_would_not_act(args, message):
    res = run_sim(*args)
    assert res.returncode == 2 and message in " ".join(res.stderr.replace("│", " ").split())  # rich wraps it in a box


def test_sim_refuses_a_request_timeout(tmp_path):
    """control_plane.request_timeout_s acts on a live server only: the simulator says so instead of ignoring it."""
    cfg = tmp_path / "timeout.yaml"
    cfg.write_text("control_plane: {request_timeout_s: 30}\n")
    res = run_sim("--trace", str(EXCERPT), "--config", str(cfg))
    assert res.returncode == 2 and "control_plane.request_timeout_s acts on a live server" in res.stderr
