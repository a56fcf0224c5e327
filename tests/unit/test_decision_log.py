"""The decision log: sampling by request id, rotation by size, the exact line of a known decision,
its summary, its config section, and the live fleet writing it."""

from __future__ import annotations

import json
import re

import pytest

from support.clock import ManualClock
from thunderagent.config import ConfigError, DecisionLogConfig, NodeConfig, parse_config
from thunderagent.control.fleet import Fleet
from thunderagent.control.membership import StaticMembership
from thunderagent.execution.handle import WorkerCallbacks
from thunderagent.observe.decision_log import DecisionLog, decision_line, sampled
from thunderagent.observe.decision_summary import LogError, log_files, read_lines, summarise
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.types import CandidateScore, Decision, EngineRequest, HotPrefixNote
from unit.test_fleet_unavailable import Scripted


def _dispatch(rid: str = "r1", *, worker: str = "w1", overlaps: tuple[int, int] = (4, 2), busy0: bool = False,
              policy: str = "kv_aware", reason: str = "lowest cost 10.0: 2 cached blocks, 0 queued prefill tokens",
              hot: HotPrefixNote | None = None) -> Dispatch:
    cands = (CandidateScore("w0", overlaps[0], 100, 300, 50, 0.5, busy0, 400.0),
             CandidateScore("w1", overlaps[1], 200, 0, 0, 0.12345, False, 10.0))
    chosen = overlaps[0] if worker == "w0" else overlaps[1]
    dec = Decision(rid, worker, policy, reason, cands, chosen, hot)
    req = EngineRequest(rid, list(range(300)), [1, 2, 3, 4], 0, 8)
    return Dispatch(req, dec, best_known_tokens=256, predicted_tokens=chosen * 64, queue_wait=0.25)


def test_line_of_a_known_decision() -> None:
    line = decision_line(_dispatch(), 12.5, program="p7", tried=("w9",), skipped={"w9": "unavailable: down"})
    assert line == {
        "t": 12.5, "request_id": "r1", "worker": "w1", "policy": "kv_aware",
        "reason": "lowest cost 10.0: 2 cached blocks, 0 queued prefill tokens", "prompt_tokens": 300,
        "overlap_blocks": 2, "predicted_tokens": 128, "best_known_tokens": 256, "queue_wait": 0.25,
        "candidates": [
            {"worker": "w0", "overlap_blocks": 4, "busy": False, "cost": 400.0, "queued_prefill_tokens": 300,
             "kv_usage": 0.5},
            {"worker": "w1", "overlap_blocks": 2, "busy": False, "cost": 10.0, "queued_prefill_tokens": 0,
             "kv_usage": 0.1235},
        ],
        "program": "p7", "tried": ["w9"], "skipped": {"w9": "unavailable: down"},
    }


def test_sampling_is_a_function_of_the_request_id() -> None:
    ids = [f"req-{k}" for k in range(10_000)]
    assert all(sampled(r, 1.0) for r in ids) and not any(sampled(r, 0.0) for r in ids)
    quarter = {r for r in ids if sampled(r, 0.25)}
    assert 2_350 <= len(quarter) <= 2_650
    assert quarter == {r for r in ids if sampled(r, 0.25)}  # same ids every time
    assert {r for r in ids if sampled(r, 0.1)} <= quarter  # a lower rate keeps a subset


def test_writer_logs_exactly_the_sampled_requests(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    dlog = DecisionLog(DecisionLogConfig(path=str(path), sample_rate=0.5))
    ids = [f"req-{k}" for k in range(200)]
    for rid in ids:
        for _ in range(2):  # a request routed again: both decisions, or neither
            dlog.record(_dispatch(rid), 1.0)
    dlog.close()
    logged = [json.loads(x)["request_id"] for x in path.read_text().splitlines()]
    want = [r for r in ids if sampled(r, 0.5)]
    assert logged == [r for r in want for _ in range(2)] and dlog.written == 2 * len(want)


def test_rotation_by_size_keeps_backups_oldest_first(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    dlog = DecisionLog(DecisionLogConfig(path=str(path), max_bytes=2048, backups=2))
    size = len(json.dumps(decision_line(_dispatch("r-000"), 1.0), separators=(",", ":"))) + 1
    per_file = 2048 // size
    n = 4 * per_file + 1
    for k in range(n):
        dlog.record(_dispatch(f"r-{k:03d}"), 1.0)
    dlog.close()
    files = log_files([path])
    assert files == [tmp_path / "d.jsonl.2", tmp_path / "d.jsonl.1", path]
    assert all(f.stat().st_size <= 2048 for f in files)
    assert not (tmp_path / "d.jsonl.3").exists()
    got = [x["request_id"] for x in read_lines(files)]
    assert got == [f"r-{k:03d}" for k in range(n - 1 - 2 * per_file, n)]  # the newest lines, in order


def test_no_backups_starts_the_file_over(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    dlog = DecisionLog(DecisionLogConfig(path=str(path), max_bytes=1024, backups=0))
    for k in range(20):
        dlog.record(_dispatch(f"r-{k:03d}"), 1.0)
    dlog.close()
    assert log_files([path]) == [path] and path.stat().st_size <= 1024
    assert [x["request_id"] for x in read_lines([path])][-1] == "r-019"


def test_summary_classes_and_why() -> None:
    lines = [
        decision_line(_dispatch("a", worker="w0"), 0.0),  # best holder chosen: hit
        decision_line(_dispatch("b", worker="w1"), 0.0),  # w0 holds more, free: cost
        decision_line(_dispatch("c", worker="w1", busy0=True, reason="1 busy filtered; lowest cost 3.0"), 0.0),
        decision_line(_dispatch("d", worker="w1", overlaps=(0, 0), reason="cache miss everywhere: x"), 0.0),
        decision_line(_dispatch("e", worker="w1", policy="round_robin", reason="round robin"), 0.0, run="rr"),
        decision_line(_dispatch("b", worker="w1"), 0.0, tried=["w0"], skipped={"w0": "unavailable: down"}),
    ]
    runs = summarise(lines)
    assert set(runs) == {"serve", "rr"}
    s = runs["serve"]
    assert (s["decisions"], s["requests"], s["retries"]) == (5, 4, 1)
    assert s["cache"] == {"hit": 1, "elsewhere": 3, "miss": 1}
    assert s["elsewhere_why"] == {"load outweighed the cache (lower cost elsewhere)": 2,
                                  "best holder busy-filtered": 1}
    assert s["by_reason"] == {"lowest cost #: # cached blocks, # queued prefill tokens": 3,
                              "# busy filtered; lowest cost #": 1, "cache miss everywhere: x": 1}
    assert s["workers"] == {"w0": {"chosen": 1, "busy_filtered": 1, "skipped": {"unavailable: down": 1}},
                            "w1": {"chosen": 4, "busy_filtered": 0, "skipped": {}}}
    assert runs["rr"]["elsewhere_why"] == {"policy round_robin ignores the cache": 1}


def test_lines_of_another_shape_are_errors_naming_file_line_and_field(tmp_path) -> None:
    good = json.dumps(decision_line(_dispatch("a", worker="w0"), 0.0))
    assert [ln["request_id"] for ln in read_lines([_write(tmp_path / "ok.jsonl", good)])] == ["a"]
    missing = json.loads(good)
    del missing["request_id"]
    wrong = json.loads(good)
    wrong["candidates"][1]["overlap_blocks"] = "3"
    for name, bad, said in [("missing", missing, "Object missing required field `request_id`"),
                            ("wrong", wrong, "Expected `int`, got `str` - at `$.candidates[1].overlap_blocks`"),
                            ("other", {"not": "a decision"}, "Object missing required field")]:
        f = _write(tmp_path / f"{name}.jsonl", good, json.dumps(bad), good)
        with pytest.raises(LogError, match=rf"{name}\.jsonl:2: not a decision line: {re.escape(said)}"):
            list(read_lines([f]))


def _write(path, *lines: str):  # (path: a pytest tmp_path entry)
    path.write_text("".join(f"{ln}\n" for ln in lines))
    return path


def test_config_knobs_need_a_path() -> None:
    assert parse_config({"control_plane": {"decision_log": {"path": "x.jsonl", "sample_rate": 0.1}}})
    with pytest.raises(ConfigError, match="sample_rate acts only with decision_log.path"):
        parse_config({"control_plane": {"decision_log": {"sample_rate": 0.1}}})
    with pytest.raises(ConfigError, match="decision_log.sample_rate"):
        parse_config({"control_plane": {"decision_log": {"path": "x", "sample_rate": 1.5}}})


async def test_live_fleet_logs_decisions_and_skipped_workers(tmp_path) -> None:
    path = tmp_path / "live.jsonl"
    cfg = parse_config({
        "model": "/unused", "routing": {"seed": 1},
        "control_plane": {"health_check_enabled": False, "decision_log": {"path": str(path)}},
        "execution_group": {"nodes": [{"engine": "vllm", "endpoints": [{"url": "http://a"}, {"url": "http://b"}]}]},
    })

    def factory(node: NodeConfig, wid: str, k: int, cb: WorkerCallbacks) -> Scripted:
        return Scripted(wid, cb)

    fleet = Fleet(cfg, StaticMembership(cfg.execution_group, {"vllm": factory}), clock=ManualClock())
    await fleet.start()
    fleet.on_unavailable("worker-0", "unreachable")
    gen = await fleet.start_generation([1, 2, 3], 2, program_id="prog-1")
    await fleet.stop()  # flushes
    (line,) = list(read_lines([path]))
    assert line["request_id"] == gen.request_id and line["worker"] == "worker-1"
    assert line["program"] == "prog-1" and line["skipped"] == {"worker-0": "unavailable: unreachable"}
    assert [c["worker"] for c in line["candidates"]] == ["worker-1"]


def test_buffered_lines_reach_the_file_when_due(tmp_path) -> None:
    clock = ManualClock()
    path = tmp_path / "d.jsonl"
    dlog = DecisionLog(DecisionLogConfig(path=str(path)), clock=clock)
    dlog.record(_dispatch("a"), 0.0)
    dlog.flush_due()
    assert path.read_text() == ""  # buffered
    clock.advance(1.0)
    dlog.flush_due()
    assert [x["request_id"] for x in read_lines([path])] == ["a"]
    dlog.close()
