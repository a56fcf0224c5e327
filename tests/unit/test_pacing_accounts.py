"""The pacer's incremental per-worker accounts (scheduler/accounts.py) against a from-scratch recount
(the tick's former walk over every program's blocks) on random operation sequences."""

from __future__ import annotations

import random
from bisect import bisect_left
from collections import Counter

import pytest

from thunderagent.config import PacingAccounting, PacingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.scheduler.accounts import REBASE_HALF_LIVES, ProgramAccounts
from thunderagent.scheduler.pacing import ProgramPacer
from thunderagent.scheduler.programs import ProgramState, ProgramTable
from thunderagent.types import LoadReport, WorkerState

BS = 16
HALF_LIFE = 30.0
WORKERS = ["w0", "w1", "w2"]


def recount(table: ProgramTable, shared: bool, now: float) -> dict[str, tuple[float, float]]:
    """Per worker ``(demand, resume_demand)`` the way the tick computed them before the accounts:
    every counted program's blocks into a Counter, then one bisection per program."""
    counts: dict[str, Counter[int]] = {}
    placed = []
    for prog in table:
        key = prog.pinned or prog.worker
        if key is None or prog.state is ProgramState.PAUSED:
            continue
        c = counts.setdefault(key, Counter())
        if shared:
            c.update(prog.blocks)
        placed.append((prog, key))
    out: dict[str, tuple[float, float]] = {}
    for prog, key in placed:
        tokens: float = prog.context_tokens
        if shared and prog.blocks:
            c, blocks = counts[key], prog.blocks
            k = bisect_left([c[b] < 2 for b in blocks], True)
            tokens = max(0, prog.context_tokens - k * BS) + sum(1.0 / c[blocks[i]] for i in range(k)) * BS
        w = 0.5 ** ((now - prog.last_change) / HALF_LIFE) if prog.state is ProgramState.ACTING else 1.0
        d, r = out.get(key, (0.0, 0.0))
        out[key] = (d + tokens, r + tokens * w)
    return out


def blocks_for(rng: random.Random, pid: str, turn: int, last: list[int]) -> list[int]:
    """Chained-looking hashes: a block fixes every block before it (shared system prompts of three
    families, then the program's own tail); half the time the next turn extends the last prompt."""
    if last and rng.random() < 0.5:
        return [*last, *(hash((pid, turn, "next", i)) for i in range(rng.randrange(0, 3)))]
    family, k = rng.randrange(3), rng.randrange(0, 6)
    own = rng.randrange(0, 5)
    return [hash(("sys", family, i)) for i in range(k)] + [hash((pid, turn, family, k, i)) for i in range(own)]


def check(acc: ProgramAccounts, table: ProgramTable, now: float) -> None:
    want = recount(table, acc.shared, now)
    for wid in set(want) | set(acc.accounts):
        got = acc.totals(acc.account(wid), now)
        assert acc.account(wid).members or got == (0, 0)
        exp = want.get(wid, (0.0, 0.0))
        assert got == pytest.approx(exp, rel=1e-9, abs=1e-6), (wid, now)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_incremental_accounts_equal_a_recount_after_every_operation(shared: bool, seed: int) -> None:
    rng = random.Random(seed)
    table = ProgramTable(idle_ttl_s=50.0)
    acc = ProgramAccounts(shared, BS, HALF_LIFE)
    table.watcher = acc
    now, turns = 1000.0, Counter[str]()
    for _ in range(400):
        now += rng.choice((0.0, 0.5, 3.0, 20.0))
        pid = f"p{rng.randrange(12)}"
        op = rng.randrange(8)
        prog = table.get(pid)
        if op <= 1 or prog is None:
            turns[pid] += 1
            blocks = blocks_for(rng, pid, turns[pid], list(prog.blocks) if prog is not None else [])
            # mostly real contexts (>= the blocks' tokens); sometimes shorter, to exercise the clamp
            tokens = len(blocks) * BS + rng.randrange(0, 40) - (rng.randrange(0, 3 * BS) if rng.random() < 0.15 else 0)
            table.request_started(pid, now, blocks, max(1, tokens))
        elif op == 2:
            table.request_placed(pid, rng.choice(WORKERS))
        elif op == 3:
            table.request_finished(pid, prog.context_tokens + rng.randrange(0, 50), now, completed=rng.random() < 0.8)
        elif op == 4 and prog.state is not ProgramState.PAUSED:
            table.pause(prog, now)
        elif op == 5 and prog.state is ProgramState.PAUSED:
            table.resume(prog, rng.choice([*WORKERS, None]), now)
        elif op == 6 and rng.random() < 0.2:
            table.release(pid)
        else:
            table.expire(now)
        check(acc, table, now)
        assert set(acc.paused) == {p.program_id for p in table if p.state is ProgramState.PAUSED}
    # past many half-lives: the reference time moves (everything re-added), totals unchanged
    later = now + (REBASE_HALF_LIVES + 1) * HALF_LIFE
    before = {w: acc.totals(a, later) for w, a in acc.accounts.items()}
    acc.start_tick(later)
    assert acc.base == later
    for w, a in acc.accounts.items():
        assert acc.totals(a, later) == pytest.approx(before[w], rel=1e-9, abs=1e-6)
    check(acc, table, later)


def test_changes_during_a_deferral_apply_at_flush() -> None:
    table = ProgramTable(idle_ttl_s=600.0)
    acc = ProgramAccounts(True, BS, HALF_LIFE)
    table.watcher = acc
    table.request_started("a", 0.0, [1, 2], 40)
    table.request_placed("a", "w0")
    acc.defer()
    table.pause(table.get("a"), 1.0)  # type: ignore[arg-type]
    assert acc.totals(acc.account("w0"), 1.0) == (40, 40) and list(acc.paused) == ["a"]
    acc.flush()
    assert acc.totals(acc.account("w0"), 1.0) == (0, 0)


def test_a_tick_reads_the_accounts_and_never_walks_the_program_table() -> None:
    cfg = PacingConfig(enabled=True, accounting=PacingAccounting.shared, work_conserving=False,
                       pause_threshold=0.9, resume_threshold=0.5)
    table = ProgramTable(600.0)
    pacer = ProgramPacer(cfg, table, KvIndex(prediction_ttl=120.0), BS)
    for k in range(50):
        table.request_started(f"p{k}", 0.0, [hash(("sys", i)) for i in range(4)] + [k], 5 * BS)
        table.request_placed(f"p{k}", f"w{k % 2}")
        table.request_finished(f"p{k}", 5 * BS + 10, 1.0, completed=True)

    def walk() -> None:
        raise AssertionError("the tick walked the program table")

    table.__class__ = type("NoWalk", (ProgramTable,), {"__iter__": lambda self: walk()})
    workers = [WorkerState(w, BS, 2048, 8, LoadReport(w, 0.0, 1, 0, 0, 0, 0, 0, 100)) for w in ("w0", "w1")]
    assert pacer.tick(workers, 5.0) == []  # 25 x (90 - 64) + 64 (the prefix once) = 714 tokens each: under 1,440
    assert pacer.pauses == 0
