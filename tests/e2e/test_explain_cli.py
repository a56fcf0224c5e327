"""`thunderagent sim --decision-log` then `thunderagent explain --log` as a user runs them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.e2e.test_serve_cli import thunderagent_cmd
from tests.e2e.test_sim_cli import EXCERPT, run_sim

ROOT = Path(__file__).resolve().parents[2]


def test_sim_decision_log_explained(tmp_path) -> None:
    log = tmp_path / "decisions.jsonl"
    res = run_sim("--trace", str(EXCERPT), "--workers", "2", "--decision-log", str(log))
    assert res.returncode == 0, res.stderr
    assert "wrote 400 decisions to" in res.stderr  # (rich wraps the path)
    out = subprocess.run([*thunderagent_cmd(), "explain", "--log", str(log), "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["files"] == [str(log)] and set(doc["runs"]) == {"round_robin", "kv_aware"}
    for s in doc["runs"].values():
        assert s["decisions"] == s["requests"] == 200 and s["retries"] == 0
        assert sum(s["cache"].values()) == 200 and sum(s["by_reason"].values()) == 200
        assert sum(s["elsewhere_why"].values()) == s["cache"]["elsewhere"]
        assert sum(w["chosen"] for w in s["workers"].values()) == 200 and set(s["workers"]) == {"worker-0", "worker-1"}
    assert doc["runs"]["round_robin"]["by_reason"] == {"round robin": 200}
    table = subprocess.run([*thunderagent_cmd(), "explain", "--log", str(log)], capture_output=True, text=True,
                           timeout=120)
    assert table.returncode == 0 and "kv_aware: 200 decisions, 200 requests" in table.stdout


def test_requests_sent_ahead_for_their_cache_are_logged_and_counted(tmp_path) -> None:
    """The holding queue's cache-affinity picks (scheduler/affinity.py) under overload: each is marked in the
    decision log, and `explain` counts exactly the dispatches the replay reports."""
    log, out = tmp_path / "decisions.jsonl", tmp_path / "out.json"
    res = run_sim("--trace", str(EXCERPT), "--workers", "2", "--speedup", "16", "--policy", "kv_aware",
                  "--scheduler", "on", "--config", str(ROOT / "configs" / "scheduler-wspt.yaml"),
                  "--decision-log", str(log), "--json", str(out))
    assert res.returncode == 0, res.stderr
    picks = json.loads(out.read_text())["runs"][0]["extra"]["affinity_dispatches"]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    ahead = [x for x in lines if x.get("affinity")]
    assert picks > 0 and len(ahead) == picks and all(x["queue_wait"] > 0 for x in ahead)
    doc = json.loads(subprocess.run([*thunderagent_cmd(), "explain", "--log", str(log), "--json"], capture_output=True,
                                    text=True, timeout=120, check=True).stdout)
    (run,) = doc["runs"].values()
    assert run["decisions"] == 200 and run["queue_wait_s"]["sent_ahead_for_cache"] == picks
