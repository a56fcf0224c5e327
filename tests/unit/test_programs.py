"""The agent-program table: states, steps, placement, release and idle expiry (pure)."""

from __future__ import annotations

import pytest

from thunderagent.scheduler.programs import ProgramState, ProgramTable


def test_a_program_reasons_while_a_request_runs_and_acts_between_them() -> None:
    t = ProgramTable(idle_ttl_s=60.0)
    p = t.request_started("agent-1", 10.0)
    assert p.state is ProgramState.REASONING and p.in_flight == 1
    t.request_placed("agent-1", "worker-2")
    t.request_finished("agent-1", 1500, 12.0, completed=True)
    assert (p.state, p.steps, p.context_tokens, p.worker, p.last_change) == (ProgramState.ACTING, 1, 1500, "worker-2", 12.0)
    t.request_started("agent-1", 20.0)  # the tool returned: next step
    t.request_started("agent-1", 20.5)  # a parallel sub-request
    t.request_finished("agent-1", 1800, 21.0, completed=True)
    assert p.state is ProgramState.REASONING and p.in_flight == 1  # one still running
    t.request_finished("agent-1", 0, 22.0, completed=False)  # cut off: not a step
    assert (p.state, p.steps, p.context_tokens) == (ProgramState.ACTING, 2, 1800)
    assert t.by_state() == {"reasoning": 0, "acting": 1, "paused": 0}
    assert t.snapshot(30.0) == [{"id": "agent-1", "state": "acting", "worker": "worker-2", "steps": 2, "in_flight": 0,
                                 "context_tokens": 1800, "age_s": 20.0, "in_state_s": 8.0, "pinned": None,
                                 "pause_cycles": 0, "pause_after_turn": False}]


def test_release_and_idle_expiry_terminate_programs() -> None:
    t = ProgramTable(idle_ttl_s=60.0)
    for pid, at in (("a", 0.0), ("b", 0.0), ("c", 0.0)):
        t.request_started(pid, at)
    t.request_finished("a", 10, 1.0, completed=True)
    t.request_finished("b", 10, 30.0, completed=True)  # "c" keeps reasoning: never expires
    assert t.expire(60.9) == [] and t.expire(61.0) == ["a"]
    assert t.release("b") and not t.release("b") and t.get("b") is None
    t.request_finished("b", 10, 62.0, completed=True)  # a late end of a released program: ignored
    assert len(t) == 1 and t.get("c").state is ProgramState.REASONING
    with pytest.raises(ValueError):
        ProgramTable(0)
