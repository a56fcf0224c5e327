"""Program-aware pacing: pause agent programs between turns under KV pressure, resume them with
hysteresis (after the ThunderAgent paper, arXiv 2602.13692). Pure and clock-free.

Why: an agent program alternates model turns (REASONING) and tool calls (ACTING). When the programs
placed on a worker need more KV than it has, each tool call lets the others' turns evict the idle
program's blocks, and every turn recomputes its whole context. Pausing a few programs between turns
keeps the rest's caches whole; the paused ones wait instead of thrashing.

Each tick (``tick_s``), per worker, its **demand** is the KV tokens of the programs placed there and
not paused: ``paper`` accounting sums their contexts; ``shared`` accounting counts a prefix several
of them share once, from their prompts' block hashes (chained hashes: two programs share block ``i``
only if they share every block before it, so a program's shared prefix is found by bisection). The
per-worker sums are kept as programs change (:mod:`thunderagent.scheduler.accounts`), so a tick
costs O(workers + paused programs), not O(programs x blocks).

- **Pause** (demand over ``pause_threshold`` of the worker's KV tokens): ACTING programs smallest
  first; if that is not enough, REASONING programs are marked to pause when their turn ends (a
  running decode is never preempted). A program resumed less than ``min_run_s`` ago is spared.
- **Resume** (per candidate, while its target worker stays under ``resume_threshold``): programs
  with a request held first, then new programs, then idle ones; oldest pause first within each, and
  the order is not skipped (a large program is never passed over by smaller ones forever);
  ``resume_order: smallest`` is the paper proxy's order instead: fewest tokens first within each
  class, and one that does not fit is passed over. An idle (ACTING) program's tokens count for less
  on the resume side, halving every ``acting_half_life_s``: its cache is the first to go anyway. Anything paused ``max_pause_s`` is
  resumed whatever the pressure; with ``work_conserving`` a worker with nothing to run takes the next
  paused program whatever its demand (``idle_resume: head``: the head of the order; ``cached``: the
  paused program holding most blocks there). Placement: ``most_free`` (the paper) or ``cached`` (where the index
  holds most of its blocks, if there is room there). A resumed program's turn is pinned to its worker; its
  later turns are routed as any request (``sticky``, the paper's: pinned until it is paused again).
- **Admission**: a new program's first request goes when some worker has room for it (or nothing
  is known yet); otherwise the program waits as NEW in the resume order above.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from thunderagent.config import IdleResume, PacingAccounting, PacingConfig, ResumeOrder, ResumePlacement
from thunderagent.kv.index import KvIndex
from thunderagent.scheduler.accounts import ProgramAccounts, WorkerAccount, shared_prefix
from thunderagent.scheduler.programs import Program, ProgramState, ProgramTable
from thunderagent.scheduler.queue import Held
from thunderagent.types import WorkerState

#: pacing decisions kept for explanations (``GET /v1/programs``)
RECENT_EVENTS = 256


@dataclass(slots=True, frozen=True)
class PacingEvent:
    time: float
    program_id: str
    action: str  # pause | pause_after_turn | resume | hold
    worker: str | None
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {"time": round(self.time, 3), "program": self.program_id, "action": self.action,
                "worker": self.worker, "reason": self.reason}


class _Load:
    """One worker at a tick: its account (the programs counted there, kept by
    :class:`~thunderagent.scheduler.accounts.ProgramAccounts`), the blocks of programs resumed or
    admitted there since the tick began (``extra``), and the demand as the tick's decisions move it."""

    __slots__ = ("account", "cap", "demand", "extra", "idle", "resume_demand")

    def __init__(self, cap: int, idle: bool, account: WorkerAccount, demand: float, resume_demand: float) -> None:
        self.cap = cap
        self.idle = idle  # nothing running or waiting on the worker
        self.account = account
        self.extra: Counter[int] = Counter()
        self.demand = demand  # full, for pausing
        self.resume_demand = resume_demand  # idle programs decayed, for resuming


class ProgramPacer:
    def __init__(self, cfg: PacingConfig, table: ProgramTable, index: KvIndex, block_size: int) -> None:
        self.cfg = cfg
        self.table = table
        self.index = index
        self.block_size = block_size
        self._held: dict[str, list[Held]] = {}  # program -> its requests held while paused
        self._room: dict[str, float] = {}  # per worker, resume-side room after the last tick
        self._last: dict[str, _Load] = {}  # the last tick's per-worker loads (admissions add to them)
        self.next_tick = 0.0
        self.pauses = 0
        self.resumes = 0
        self.forced_resumes = 0
        self.recent: deque[PacingEvent] = deque(maxlen=RECENT_EVENTS)
        # per-worker demand kept as programs change, so a tick is O(workers + paused), not O(all blocks)
        self.accounts = ProgramAccounts(cfg.accounting is PacingAccounting.shared, block_size, cfg.acting_half_life_s)
        for prog in table:  # (a table is normally empty here)
            self.accounts.changed(prog)
        table.watcher = self.accounts

    # -- requests ------------------------------------------------------------------------------
    def must_hold(self, prog: Program, tokens: int, now: float) -> bool:
        """Whether a request of ``prog`` (just started in the table) waits: its program is paused,
        or it is a new program no worker has room for."""
        if prog.state is ProgramState.PAUSED:
            return True
        if prog.admitted or prog.in_flight > 1 or not self._last:
            return False
        if self.cfg.resume_order is not ResumeOrder.smallest:
            # new programs are admitted in arrival order: a newcomer that fits never passes one
            # already waiting for room (else small programs arriving together fill every worker and
            # the large ones wait for whole small programs to end: the starvation issue 9 names)
            ahead = sum(1 for p in self.accounts.paused.values() if not p.admitted)
            if ahead:
                return self._hold_new(prog, now, f"new program: {ahead} new program(s) wait for room ahead of it")
        # the worker with the most room for what this program adds there: with shared accounting a
        # program sharing a long prefix with programs already there (an RL rollout group arriving
        # together) adds only its own tail, so such a group is admitted together
        need = {w: self._tokens(prog, ld, 1) for w, ld in self._last.items()}
        best = max(self._last, key=lambda w: self._room[w] - need[w])
        if self._room[best] >= need[best]:
            self._room[best] -= need[best]
            if self.cfg.accounting is PacingAccounting.shared:
                self._last[best].extra.update(prog.blocks)
            return False
        return self._hold_new(prog, now, f"new program: no worker has room for {tokens} tokens")

    def _hold_new(self, prog: Program, now: float, reason: str) -> bool:
        self.table.pause(prog, now)
        prog.pause_cycles -= 1  # waiting for admission is not a pause cycle
        self._event(now, prog, "hold", None, reason)
        return True

    def hold(self, program_id: str, held: Held) -> None:
        self._held.setdefault(program_id, []).append(held)

    def cancel(self, request_id: str) -> bool:
        for pid, reqs in self._held.items():
            for k, h in enumerate(reqs):
                if h.req.request_id == request_id:
                    del reqs[k]
                    if not reqs:
                        del self._held[pid]
                    return True
        return False

    def held_count(self) -> int:
        return sum(map(len, self._held.values()))

    def take_held(self, program_id: str) -> list[Held]:
        return self._held.pop(program_id, [])

    # -- ticks -------------------------------------------------------------------------------
    def tick(self, workers: Sequence[WorkerState], now: float) -> list[str]:
        """One pacing decision: pauses and resumes. Returns the programs resumed (their held
        requests can go, pinned to ``Program.pinned``)."""
        self.next_tick = now + self.cfg.tick_s
        self.accounts.start_tick(now)
        loads = self._loads(workers, now)
        if not loads:
            self._last, self._room = {}, {}
            return []
        self.accounts.defer()  # the decisions below see the accounts as the tick found them
        try:
            for wid, load in loads.items():
                if load.demand > self.cfg.pause_threshold * load.cap:
                    self._pause_on(wid, load, now)
            resumed = self._resume(loads, now)
        finally:
            self.accounts.flush()
        self._room = {wid: self.cfg.resume_threshold * ld.cap - ld.resume_demand for wid, ld in loads.items()}
        self._last = loads
        return resumed

    def _tokens(self, prog: Program, load: _Load, least: int) -> int:
        """KV tokens ``prog`` adds to ``load``: all of them (paper), or those not shared with
        ``least - 1`` other programs there (shared)."""
        if self.cfg.accounting is PacingAccounting.paper or not prog.blocks:
            return prog.context_tokens
        shared = shared_prefix(prog.blocks, load.account.counts, least, load.extra)
        return max(0, prog.context_tokens - shared * self.block_size)

    def _weight(self, prog: Program, now: float) -> float:
        if prog.state is ProgramState.ACTING:
            return 0.5 ** ((now - prog.last_change) / self.cfg.acting_half_life_s)
        return 1.0

    def _loads(self, workers: Sequence[WorkerState], now: float) -> dict[str, _Load]:
        loads = {}
        for w in workers:
            if w.load.kv_total_blocks > 0:
                acc = self.accounts.account(w.worker_id)
                demand, resume_demand = self.accounts.totals(acc, now)
                loads[w.worker_id] = _Load(w.load.kv_total_blocks * w.block_size,
                                           not w.load.running and not w.load.waiting, acc, demand, resume_demand)
        return loads

    def _pause_on(self, wid: str, load: _Load, now: float) -> None:
        cfg = self.cfg
        limit = cfg.pause_threshold * load.cap
        mine = [p for p in load.account.members.values()
                if not p.pause_after_turn and (p.resumed_at < 0 or now - p.resumed_at >= cfg.min_run_s)]
        sizes = {p.program_id: self._tokens(p, load, 2) for p in mine}
        mine.sort(key=lambda p: (sizes[p.program_id], -p.first_seen, p.seq))  # equal sizes: the newest first
        for state in (ProgramState.ACTING, ProgramState.REASONING):
            for p in mine:
                if load.demand <= limit:
                    return
                if p.state is not state:
                    continue
                load.demand -= sizes[p.program_id]
                if state is ProgramState.ACTING:  # a marked program holds its KV until its turn ends
                    load.resume_demand -= sizes[p.program_id] * self._weight(p, now)
                why = f"{wid} demand {load.demand + sizes[p.program_id]:.0f} > {limit:.0f} tokens"
                if state is ProgramState.ACTING:
                    self.table.pause(p, now)
                    self.pauses += 1
                    self._event(now, p, "pause", wid, why)
                else:
                    p.pause_after_turn = True
                    self.pauses += 1
                    self._event(now, p, "pause_after_turn", wid, why)

    def _order(self, now: float) -> list[Program]:
        paused = list(self.accounts.paused.values())

        smallest = self.cfg.resume_order is ResumeOrder.smallest

        def rank(p: Program) -> tuple[int, int, int, float, int]:
            forced = now - p.paused_since >= self.cfg.max_pause_s
            cls = 0 if p.program_id in self._held and p.admitted else 1 if not p.admitted else 2
            return (0 if forced else 1, cls, p.context_tokens if smallest else 0, p.paused_since, p.seq)

        paused.sort(key=rank)
        return paused

    def _resume(self, loads: dict[str, _Load], now: float) -> list[str]:
        resumed: list[str] = []
        for p in self._order(now):
            forced = now - p.paused_since >= self.cfg.max_pause_s
            target = self._place(p, loads, now)
            if target is None and self.cfg.work_conserving:
                target = self._idle_worker(p, loads, now)
            if target is None and not forced:
                if self.cfg.resume_order is ResumeOrder.smallest:
                    continue  # the paper's proxy: a program that does not fit is passed over
                break  # in order: nobody overtakes the program at the head for good
            if target is None:
                target = max(loads, key=lambda w: self.cfg.resume_threshold * loads[w].cap - loads[w].resume_demand)
            self._resume_on(p, target, loads[target], now,
                            "paused past max_pause_s" if forced else f"room on {target}", forced)
            resumed.append(p.program_id)
        if self.cfg.work_conserving and self.cfg.idle_resume is IdleResume.cached:
            self._resume_cached_on_idle(loads, resumed, now)
        return resumed

    def _resume_on(self, p: Program, target: str, load: _Load, now: float, why: str, forced: bool = False) -> None:
        load.idle = False
        need = self._tokens(p, load, 1)
        load.demand += need
        load.resume_demand += need
        if self.cfg.accounting is PacingAccounting.shared:
            load.extra.update(p.blocks)
        self.table.resume(p, target, now)
        self.resumes += 1
        self.forced_resumes += forced
        self._event(now, p, "resume", target, why)

    def _resume_cached_on_idle(self, loads: dict[str, _Load], resumed: list[str], now: float) -> None:
        """``idle_resume: cached``: each worker still idle takes the paused program holding most of
        its blocks there, out of resume order. Why: a worker idling while programs wait loses their
        steps (work conservation), but the head of the order usually has nothing cached on it and
        recomputes its whole context; a program whose blocks are still there resumes at the price
        of its new tokens. (The order still holds everywhere else; ``max_pause_s`` still forces.)"""
        idle = [w for w, ld in loads.items() if ld.idle]
        if not idle:
            return
        taken = set(resumed)
        overlaps = [(p, self.index.find_matches(p.blocks, now)) for p in self.accounts.paused.values()
                    if p.blocks and p.program_id not in taken]
        for wid in idle:
            best, best_n = None, 0
            for p, overlap in overlaps:
                n = overlap.get(wid, 0)
                if n > best_n and p.program_id not in taken:
                    best, best_n = p, n
            if best is not None:
                taken.add(best.program_id)
                self._resume_on(best, wid, loads[wid], now, f"{wid} idle, holds {best_n} of its blocks")
                resumed.append(best.program_id)

    def _place(self, p: Program, loads: dict[str, _Load], now: float) -> str | None:
        """Where ``p`` fits now, or None."""
        thr = self.cfg.resume_threshold

        def room(w: str) -> float:
            return thr * loads[w].cap - loads[w].resume_demand - self._tokens(p, loads[w], 1)

        if self.cfg.placement is ResumePlacement.cached and p.blocks:
            overlap = self.index.find_matches(p.blocks, now)
            for w in sorted((w for w in overlap if w in loads), key=lambda w: -overlap[w]):
                if overlap[w] and (room(w) >= 0 or loads[w].resume_demand <= 0):
                    return w
        best = max(loads, key=room)
        return best if room(best) >= 0 or loads[best].resume_demand <= 0 else None  # empty: it goes anyway

    def _idle_worker(self, p: Program, loads: dict[str, _Load], now: float) -> str | None:
        """An idle worker for ``p`` (the one holding most of its blocks), or None; with
        ``idle_resume: cached`` only one holding some of them (the others go to the cached pass)."""
        idle = [w for w, ld in loads.items() if ld.idle]
        if not idle:
            return None
        overlap = self.index.find_matches(p.blocks, now) if p.blocks else {}
        best = max(idle, key=lambda w: overlap.get(w, 0))
        if self.cfg.idle_resume is IdleResume.cached and not overlap.get(best, 0):
            return None
        return best

    def _event(self, now: float, p: Program, action: str, worker: str | None, reason: str) -> None:
        self.recent.append(PacingEvent(now, p.program_id, action, worker, reason))
