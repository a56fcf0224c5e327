"""``scheduler.pacing.resume_order``: arrival order (nobody passes the head) against the paper
proxy's smallest-first order (a program that does not fit is passed over)."""

from __future__ import annotations

import pytest

from thunderagent.config import ConfigError, PacingConfig, ResumeOrder, parse_config
from thunderagent.kv.index import KvIndex
from thunderagent.scheduler.pacing import ProgramPacer
from thunderagent.scheduler.programs import ProgramTable
from thunderagent.types import LoadReport, WorkerState

BS = 16


def paused_programs(order: ResumeOrder) -> tuple[ProgramPacer, ProgramTable]:
    cfg = PacingConfig(enabled=True, work_conserving=False, pause_threshold=0.9, resume_threshold=0.5,
                       resume_order=order, max_pause_s=1000.0)
    table = ProgramTable(600.0)
    pacer = ProgramPacer(cfg, table, KvIndex(prediction_ttl=120.0), BS)
    table.request_started("running", 0.0, [1], 300)  # a turn running on w0: 300 tokens
    table.request_placed("running", "w0")
    for pid, tokens, at in (("big", 900, 1.0), ("mid", 500, 2.0), ("small", 200, 3.0)):
        prog = table.request_started(pid, at, [hash(pid)], tokens)
        table.pause(prog, at)  # new programs held at admission, in this order
    return pacer, table


def test_arrival_order_stops_at_a_head_that_does_not_fit() -> None:
    pacer, _ = paused_programs(ResumeOrder.arrival)
    worker = WorkerState("w0", BS, 2048, 8, LoadReport("w0", 0.0, 1, 0, 0, 0, 0, 0, 100))
    # room: 0.5 x 1,600 - 300 = 500 tokens; "big" (900) is first and does not fit: nobody passes it
    assert pacer.tick([worker], 10.0) == []


def test_smallest_first_admits_the_smallest_and_passes_over_what_does_not_fit() -> None:
    pacer, table = paused_programs(ResumeOrder.smallest)
    worker = WorkerState("w0", BS, 2048, 8, LoadReport("w0", 0.0, 1, 0, 0, 0, 0, 0, 100))
    # smallest first: "small" (200) fits in 500; "mid" (500) no longer does and is passed over, as is "big"
    assert pacer.tick([worker], 10.0) == ["small"]
    assert [p.program_id for p in table if p.state.value == "paused"] == ["big", "mid"]


def test_resume_order_needs_pacing_on() -> None:
    with pytest.raises(ConfigError, match="resume_order"):
        parse_config({"scheduler": {"pacing": {"resume_order": "smallest"}}}, "test")
    cfg = parse_config({"scheduler": {"pacing": {"enabled": True, "resume_order": "smallest"}}}, "test")
    assert cfg.scheduler.pacing.resume_order is ResumeOrder.smallest
    with pytest.raises(ConfigError, match="resume_order"):
        parse_config({"scheduler": {"pacing": {"enabled": True, "resume_order": "largest"}}}, "test")
