"""Dynamo mocker adapter (thunderagent.sim.dynamo).

Most of these tests need the optional ``ai-dynamo-runtime`` wheel and skip without it.
The expected numbers come from shared/reference/dynamo-mocker.md (§3, §6) and were
checked against ai-dynamo-runtime 1.6.1.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from thunderagent.sim import dynamo as dyn
from thunderagent.sim.results import RunResult

_SKIP_REASON = "ai-dynamo-runtime not installed (optional [compare] extra)"

# pf(T) = 4.209989e-7*T^2 + 1.518344e-2*T + 16.50142, as Dynamo reports it (ns-rounded)
PF_64 = 17.474885
PF_512 = 24.385704
PF_1024 = 32.490712


@pytest.fixture
def core() -> object:
    return pytest.importorskip("dynamo._core", reason=_SKIP_REASON)


def _trace(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(path: Path, workers: int, router_mode: str = "round_robin", speedup: float = 1.0) -> RunResult:
    return dyn.run_dynamo(
        str(path), workers=workers, kv_blocks=16384, block_size=64, speedup=speedup, router_mode=router_mode
    )


# Four requests sharing trace block 0: arrival k goes to worker k % 2 under round_robin.
_SHARED_ROWS: list[dict[str, object]] = [
    {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 2000, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [0]},
]
_SHARED_INPUT = 3 * 1024 + 512


def test_absent_dynamo_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "dynamo._core", None)  # makes the import fail
    assert dyn.dynamo_available() is False
    with pytest.raises(RuntimeError, match="dynamo replay failed: ai-dynamo-runtime is not usable"):
        _run(_trace(tmp_path, _SHARED_ROWS), workers=1)


def test_available_and_version(core: object) -> None:
    assert dyn.dynamo_available() is True
    assert dyn.dynamo_version() is not None


def test_single_request_matches_reference(core: object, tmp_path: Path) -> None:
    path = _trace(tmp_path, [{"timestamp": 0, "input_length": 512, "output_length": 100, "hash_ids": [0]}])
    res = _run(path, workers=1)
    assert (res.system, res.policy, res.requests) == ("dynamo", "round_robin", 1)
    for value in (res.ttft_ms.mean, res.ttft_ms.p50, res.ttft_ms.p90, res.ttft_ms.p99):
        assert value == pytest.approx(PF_512, abs=1e-6)
    assert res.e2e_ms.mean == pytest.approx(595.510770, abs=1e-6)
    assert res.e2e_ms.p99 == pytest.approx(595.510770, abs=1e-6)
    assert res.itl_ms.mean == pytest.approx(5.768940, abs=1e-6)  # (595.510770 - 24.385704) / 99
    assert res.prefix_reuse == 0.0
    assert math.isnan(res.prefill_recompute_rate)
    assert "prefill_recompute_rate_note" in res.extra
    assert res.throughput_rps == pytest.approx(1000.0 / 595.510770, rel=1e-9)
    assert res.wall_s >= 0.0
    # raw summary fields and the call are kept
    assert res.extra["mean_ttft_ms"] == res.ttft_ms.mean
    assert res.extra["kv_eviction_policy"] == "lru"
    args = res.extra["replay_args"]
    assert isinstance(args, dict)
    assert args["extra_engine_args"] == {"engine": {"block_size": 64, "num_gpu_blocks": 16384}}
    assert (args["router_mode"], args["replay_mode"], args["trace_block_size"]) == ("round_robin", "offline", 512)
    json.dumps(res.to_json())  # serializable


def test_round_robin_two_workers(core: object, tmp_path: Path) -> None:
    res = _run(_trace(tmp_path, _SHARED_ROWS), workers=2)
    # w0: 1024 cold, then 1024 reusing 960 (cap floor(1023/64)=15 blocks) -> pf(64)
    # w1: 1024 cold, then 512 reusing 448 (cap floor(511/64)=7 blocks) -> pf(64)
    assert res.requests == 4
    assert res.prefix_reuse == pytest.approx((960 + 448) / _SHARED_INPUT, abs=1e-12)
    assert res.ttft_ms.mean == pytest.approx((2 * PF_1024 + 2 * PF_64) / 4, abs=1e-6)
    assert res.ttft_ms.p50 == pytest.approx(PF_1024, abs=1e-6)  # upper median, rank round(1.5)=2
    assert res.ttft_ms.p99 == pytest.approx(PF_1024, abs=1e-6)
    # last arrival at 3000 ms finishes its single token after pf(64)
    assert res.throughput_rps == pytest.approx(4 / ((3000 + PF_64) / 1000), rel=1e-9)


def test_arrival_speedup_compresses_gaps(core: object, tmp_path: Path) -> None:
    res = _run(_trace(tmp_path, _SHARED_ROWS), workers=2, speedup=2.0)
    assert res.throughput_rps == pytest.approx(4 / ((1500 + PF_64) / 1000), rel=1e-9)


def test_kv_router_keeps_shared_prefix_on_one_worker(core: object, tmp_path: Path) -> None:
    res = _run(_trace(tmp_path, _SHARED_ROWS), workers=2, router_mode="kv_router")
    assert res.policy == "kv_router"
    # the first request's worker is a random tie-break; the rest follow the overlap
    assert res.prefix_reuse == pytest.approx((960 + 960 + 448) / _SHARED_INPUT, abs=1e-12)
    assert res.ttft_ms.mean == pytest.approx((PF_1024 + 3 * PF_64) / 4, abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"router_mode": "bogus"}, "router_mode"),
        ({"workers": 0}, "at least one worker"),
    ],
)
def test_bad_arguments_become_runtime_errors(
    core: object, tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"workers": 1, "kv_blocks": 16384, "block_size": 64, "speedup": 1.0}
    args["router_mode"] = "round_robin"
    args.update(kwargs)
    with pytest.raises(RuntimeError, match=f"dynamo replay failed: .*{message}"):
        dyn.run_dynamo(str(_trace(tmp_path, _SHARED_ROWS)), **args)  # type: ignore[arg-type]


def test_missing_trace_becomes_runtime_error(core: object, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="dynamo replay failed: .*failed to open trace file"):
        _run(tmp_path / "missing.jsonl", workers=1)
