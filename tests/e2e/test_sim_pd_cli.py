"""`thunderagent sim --pd` as a user runs it: disaggregated rows side by side, faults, bad flags."""

from __future__ import annotations

import json

from tests.e2e.test_sim_cli import EXCERPT, run_sim


def test_sim_pd_rows_with_an_interrupted_link(tmp_path):
    out = tmp_path / "out.json"
    res = run_sim("--trace", str(EXCERPT), "--speedup", "4", "--policy", "kv_aware", "--pd", "1:3",
                  "--pd-mode", "always", "--pd-mode", "conditional", "--pd-mode", "never",
                  "--pd-interrupt", "0.3", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "ITL p99" in res.stdout and "kv_aware+pd1:3:always" in res.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["kv_aware+pd1:3:always", "kv_aware+pd1:3:conditional",
                                           "kv_aware+pd1:3:never"]
    for r in runs:
        assert r["requests"] == 200 and r["extra"]["incomplete_requests"] == 0
    always = runs[0]["extra"]["pd"]
    assert always["plane"]["fallbacks"]["interrupted"] == always["plane"]["failures"]["interrupted"] > 0
    assert runs[2]["extra"]["pd"]["remote_prefills"] == 0


def test_sim_pd_flags_are_checked():
    res = run_sim("--trace", str(EXCERPT), "--pd", "4")
    assert res.returncode == 2 and "--pd takes P:D" in res.stderr
    res = run_sim("--trace", str(EXCERPT), "--pd-mode", "always")
    assert res.returncode == 2 and "need --pd P:D" in res.stderr
