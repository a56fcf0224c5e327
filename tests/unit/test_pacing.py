"""Program pacing (pure): who is paused, when, in which order programs resume, and where."""

from __future__ import annotations

import random

from thunderagent.config import (IdleResume, PacingAccounting, PacingConfig, ResumeOrder, ResumePlacement,
                                 RoutingConfig, SchedulerConfig)
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.scheduler.pacing import ProgramPacer
from thunderagent.scheduler.programs import ProgramState, ProgramTable
from thunderagent.scheduler.queue import Held
from thunderagent.types import EngineRequest, LoadReport, WorkerState

BS = 16


def worker(wid: str, kv_blocks: int = 100, running: int = 1) -> WorkerState:
    return WorkerState(wid, BS, 2048, 8, LoadReport(wid, 0.0, running, 0, 0, 0, 0, 0, kv_blocks))


def pacer(**kw: object) -> tuple[ProgramPacer, ProgramTable, KvIndex]:
    cfg = PacingConfig(enabled=True, **{"work_conserving": False, **kw})  # type: ignore[arg-type]
    table, index = ProgramTable(600.0), KvIndex(prediction_ttl=120.0)
    return ProgramPacer(cfg, table, index, BS), table, index


def start(table: ProgramTable, pid: str, blocks: list[int], tokens: int, worker_id: str, now: float,
          *, finish: bool = True) -> None:
    """A program whose request ran on ``worker_id``; ``finish``: it is ACTING afterwards."""
    table.request_started(pid, now, blocks, tokens)
    table.request_placed(pid, worker_id)
    if finish:
        table.request_finished(pid, tokens, now + 1.0, completed=True)


def held(rid: str, pid: str) -> Held:
    return Held(EngineRequest(rid, [1] * 4, [], 0, 4), "", 0, 0.0, 0, pid)


def test_over_the_threshold_acting_programs_pause_smallest_first_and_reasoning_ones_after_their_turn() -> None:
    p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5)
    # worker w0: 1,600 tokens of KV; four programs with distinct blocks: 600 + 500 + 400 + 300 = 1,800
    start(t, "big", [1], 600, "w0", 0.0)
    start(t, "mid", [2], 500, "w0", 0.0, finish=False)  # still reasoning
    start(t, "small", [3], 400, "w0", 0.0)
    start(t, "tiny", [4], 300, "w0", 0.0, finish=False)
    assert p.tick([worker("w0")], 5.0) == []
    # over by 360 tokens: the smallest ACTING program ("small", 400) is enough
    assert [(x.program_id, x.state, x.pause_after_turn) for x in t] == [
        ("big", ProgramState.ACTING, False), ("mid", ProgramState.REASONING, False),
        ("small", ProgramState.PAUSED, False), ("tiny", ProgramState.REASONING, False)]
    assert (p.pauses, t.get("small").pause_cycles, p.recent[-1].action) == (1, 1, "pause")


def test_a_reasoning_program_is_never_cut_mid_turn_it_pauses_when_its_turn_ends() -> None:
    p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5)
    start(t, "a", [1], 1000, "w0", 0.0, finish=False)
    start(t, "b", [2], 900, "w0", 0.0, finish=False)
    p.tick([worker("w0")], 5.0)
    b = t.get("b")
    assert b.state is ProgramState.REASONING and b.pause_after_turn and t.get("a").state is ProgramState.REASONING
    t.request_finished("b", 950, 6.0, completed=True)
    assert (b.state, b.paused_since, b.pause_cycles, b.steps) == (ProgramState.PAUSED, 6.0, 1, 1)
    # its next request arrives while paused: the program stays paused (the request is held)
    t.request_started("b", 7.0, [2, 5], 1100)
    assert b.state is ProgramState.PAUSED and b.in_flight == 1


def test_shared_prefix_is_counted_once_with_shared_accounting_and_in_full_with_the_papers() -> None:
    prefix = list(range(100, 150))  # 50 blocks = 800 tokens shared by both programs
    for accounting, paused in ((PacingAccounting.shared, []), (PacingAccounting.paper, ["b"])):
        p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5, accounting=accounting)
        start(t, "a", [*prefix, 1], 900, "w0", 0.0)
        start(t, "b", [*prefix, 2], 900, "w0", 0.5)  # equal sizes: the newest pauses
        # shared: 800 + 100 + 100 = 1,000 <= 0.9 * 1,600; paper: 1,800 > 1,440
        p.tick([worker("w0")], 5.0)
        assert [x.program_id for x in t if x.state is ProgramState.PAUSED] == paused, accounting


def test_resume_order_is_held_requests_then_new_programs_then_idle_ones_and_nobody_is_skipped() -> None:
    p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5, max_pause_s=1000.0)
    for pid, blocks in (("idle", [1]), ("waiting", [2])):
        start(t, pid, blocks, 300, "w0", 0.0)
        t.pause(t.get(pid), 1.0)
    t.request_started("waiting", 2.0, [2, 3], 350)  # its next request is held
    p.hold("waiting", held("r1", "waiting"))
    fresh = t.request_started("fresh", 3.0, [9], 300)
    t.pause(fresh, 3.0)  # a new program held at admission (never dispatched)
    # room for 800 tokens (0.5 * 1,600) on an empty worker: "waiting" (350) + "fresh" (300) fit, "idle" does not
    assert p.tick([worker("w0")], 10.0) == ["waiting", "fresh"]
    assert t.get("idle").state is ProgramState.PAUSED
    assert (t.get("waiting").state, t.get("waiting").pinned) == (ProgramState.REASONING, "w0")
    assert t.get("fresh").state is ProgramState.REASONING
    assert [h.req.request_id for h in p.take_held("waiting")] == ["r1"]


def test_a_program_paused_past_max_pause_is_resumed_whatever_the_pressure() -> None:
    p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5, max_pause_s=60.0, min_run_s=0.0)
    start(t, "hog", [1], 1500, "w0", 0.0, finish=False)  # reasoning: cannot be paused now
    start(t, "old", [2], 400, "w0", 0.0)
    t.pause(t.get("old"), 1.0)
    assert p.tick([worker("w0")], 30.0) == []  # no room: 1,500 > 800
    assert p.tick([worker("w0")], 61.0) == ["old"]
    assert (p.forced_resumes, p.recent[-1].reason) == (1, "paused past max_pause_s")


def test_a_just_resumed_program_is_not_paused_again_within_min_run() -> None:
    p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5, min_run_s=10.0)
    start(t, "a", [1], 1000, "w0", 0.0)
    start(t, "b", [2], 700, "w0", 0.0)
    t.resume(t.get("b"), "w0", 4.0)
    p.tick([worker("w0")], 5.0)  # over: "b" is smaller but spared, "a" goes
    assert [x.program_id for x in t if x.state is ProgramState.PAUSED] == ["a"]


def test_cached_placement_resumes_where_the_index_holds_the_blocks_most_free_where_there_is_most_room() -> None:
    for placement, where in ((ResumePlacement.cached, "w1"), (ResumePlacement.most_free, "w0")):
        p, t, index = pacer(pause_threshold=0.9, resume_threshold=0.5, placement=placement)
        start(t, "busy", [7], 200, "w1", 0.0, finish=False)
        start(t, "x", [1, 2, 3], 300, "w1", 0.0)
        t.pause(t.get("x"), 1.0)
        index.add_worker("w1")
        index.predict("w1", [1, 2, 3], 1.0)
        assert p.tick([worker("w0"), worker("w1")], 2.0) == ["x"]
        assert t.get("x").pinned == where, placement


def test_work_conserving_resumes_on_an_idle_worker_whatever_the_demand() -> None:
    for conserving, resumed in ((False, []), (True, ["x"])):
        p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5, work_conserving=conserving)
        start(t, "y", [5], 1000, "w0", 0.0)  # ACTING: its blocks still count
        start(t, "x", [1], 1000, "w0", 0.0)
        t.pause(t.get("x"), 1.0)
        assert p.tick([worker("w0", running=0)], 2.0) == resumed, conserving


def test_a_new_program_waits_for_room_and_is_admitted_when_it_comes() -> None:
    p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5)
    start(t, "a", [1], 700, "w0", 0.0, finish=False)
    p.tick([worker("w0")], 1.0)  # room: 800 - 700 = 100 tokens
    b = t.request_started("b", 2.0, [2], 400)
    assert p.must_hold(b, 400, 2.0) and b.state is ProgramState.PAUSED and b.pause_cycles == 0
    p.hold("b", held("rb", "b"))
    c = t.request_started("c", 2.0, [3], 50)
    assert p.must_hold(c, 50, 2.0)  # it would fit, but b waits ahead of it: admission in arrival order
    assert p.recent[-1].reason == "new program: 1 new program(s) wait for room ahead of it"
    p.hold("c", held("rc", "c"))
    t.request_finished("a", 800, 3.0, completed=True)
    t.release("a")
    assert p.tick([worker("w0")], 4.0) == ["b", "c"] and p.held_count() == 2  # in arrival order
    assert p.cancel("rb") and p.held_count() == 1 and not p.cancel("rb")


def test_smallest_first_admission_lets_a_newcomer_that_fits_pass_a_waiting_program() -> None:
    p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5, resume_order=ResumeOrder.smallest)
    start(t, "a", [1], 700, "w0", 0.0, finish=False)
    p.tick([worker("w0")], 1.0)  # room: 800 - 700 = 100 tokens
    b = t.request_started("b", 2.0, [2], 400)
    assert p.must_hold(b, 400, 2.0)
    c = t.request_started("c", 2.0, [3], 50)
    assert not p.must_hold(c, 50, 2.0)  # the paper's order: a program that fits is not held behind b


def test_a_rollout_group_sharing_a_long_prefix_is_admitted_together_with_shared_accounting() -> None:
    prefix = list(range(100, 130))  # 30 blocks = 480 tokens shared by the group
    for accounting, admitted in ((PacingAccounting.shared, ["g0", "g1", "g2"]), (PacingAccounting.paper, ["g0"])):
        p, t, _ = pacer(pause_threshold=0.9, resume_threshold=0.5, accounting=accounting)
        p.tick([worker("w0")], 0.0)  # an empty worker: 800 tokens of room
        got = []
        for k in range(3):
            prog = t.request_started(f"g{k}", 1.0, [*prefix, 900 + k], 500)
            if not p.must_hold(prog, 500, 1.0):
                got.append(prog.program_id)
        # shared: 500 for the first, then 20 tokens each (their own last block); paper: 500 each
        assert got == admitted, accounting


def test_idle_resume_cached_gives_an_idle_worker_the_paused_program_holding_its_blocks_out_of_order() -> None:
    """``head`` sends the head of the order to the idle worker; ``cached`` gives the idle worker the
    paused program whose blocks it holds, and the head (nothing cached there) waits its turn."""
    for mode, resumed, pinned in ((IdleResume.head, ["old"], "w1"), (IdleResume.cached, ["cached"], "w1")):
        p, t, index = pacer(pause_threshold=0.9, resume_threshold=0.5, work_conserving=True, idle_resume=mode)
        start(t, "busy", [9], 1000, "w0", 0.0, finish=False)  # w0 is full and running
        start(t, "old", [1, 2], 1000, "w0", 0.0)
        start(t, "cached", [5, 6, 7], 1000, "w1", 0.0)
        start(t, "tool", [8], 300, "w1", 0.0)  # ACTING on w1: its demand leaves no room for 1,000 more
        t.pause(t.get("old"), 1.0)  # paused first: the head of the order
        t.pause(t.get("cached"), 2.0)
        for wid in ("w0", "w1"):
            index.add_worker(wid)
        index.predict("w1", [5, 6, 7], 2.0)  # w1 still holds "cached"'s blocks
        busy_w0 = worker("w0", kv_blocks=100)
        idle_w1 = worker("w1", kv_blocks=40, running=0)  # 640 tokens: nobody fits under 0.5 x 640
        assert p.tick([busy_w0, idle_w1], 3.0) == resumed, mode
        assert t.get(resumed[0]).pinned == pinned
        left = ({"old", "cached"} - set(resumed)).pop()
        assert t.get(left).state is ProgramState.PAUSED, mode
        if mode is IdleResume.cached:
            assert "w1 idle, holds 3 of its blocks" in p.recent[-1].reason


def test_idle_resume_cached_leaves_an_idle_worker_without_cached_programs_idle_until_forced() -> None:
    p, t, index = pacer(pause_threshold=0.9, resume_threshold=0.5, work_conserving=True,
                        idle_resume=IdleResume.cached, max_pause_s=30.0)
    start(t, "busy", [9], 1000, "w0", 0.0, finish=False)
    start(t, "x", [1, 2], 1000, "w0", 0.0)
    start(t, "tool", [8], 300, "w1", 0.0)
    t.pause(t.get("x"), 1.0)
    index.add_worker("w1")
    workers = [worker("w0"), worker("w1", kv_blocks=40, running=0)]
    assert p.tick(workers, 2.0) == []  # nothing of x's on the idle w1: x waits for room, or ...
    assert p.tick(workers, 31.0) == ["x"]  # ... until max_pause_s forces it


def test_a_resumed_programs_pin_holds_for_its_resumed_turn_only_unless_sticky() -> None:
    # w0 is busy (8 running, 6 waiting), w1 idle, nothing cached anywhere: the router alone picks w1. A program
    # resumed on w0 sends its held turn there; its next turn is routed by load (w1), or stays on w0 when sticky
    # (the paper's proxy: pinned until paused again, so a pinned program cannot leave a busy worker; measured:
    # RL rollout group makespans 1.44x -> 1.27x of kv_aware's with the pin for one turn, README "Program pacing").
    busy = WorkerState("w0", BS, 2048, 8, LoadReport("w0", 0.0, 8, 6, 0, 0, 0, 0, 100))
    ws = [busy, worker("w1", running=0)]
    for sticky, second in ((False, "w1"), (True, "w0")):
        index = KvIndex(prediction_ttl=60.0)
        for w in ws:
            index.add_worker(w.worker_id)
        d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), BS, SchedulerConfig(
            enabled=False, pacing=PacingConfig(enabled=True, sticky=sticky)))
        t = d.programs
        start(t, "p", [], 64, "w0", 0.0)
        prog = t.get("p")
        t.pause(prog, 2.0)
        t.resume(prog, "w0", 3.0)
        turns = []
        for k, now in enumerate((4.0, 6.0)):
            t.request_started("p", now)
            req = d.prepare(f"r{k}", [k + 1] * 64, 4)
            turns.append(d.dispatch(req, ws, now, program="p").decision.worker_id)
            t.request_finished("p", 64, now + 1.0, completed=True)
        assert turns == ["w0", second], sticky
        assert t.get("p").pinned == ("w0" if sticky else None)
