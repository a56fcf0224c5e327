"""Per-worker KV accounts of agent programs, kept up to date as programs change, so that a pacing
tick reads each worker's demand in O(1) instead of walking every program's blocks. Pure and
clock-free.

What a tick needs per worker (the programs placed there and not paused; see
:mod:`thunderagent.scheduler.pacing`)::

    demand = sum_p share_p        resume_demand = sum_p share_p * w_p

``w_p`` is 1, or ``0.5 ** ((now - t_p) / h)`` for a program ACTING since ``t_p`` (``h``: the
acting half-life). ``share_p = own_p + bs * sum_{i < shared_p} 1 / c(b_i)``: ``c(b)`` counts the
programs there holding block ``b``, ``shared_p`` is how many leading blocks of ``p`` two or more
hold, ``own_p = max(0, ctx_p - bs * shared_p)``; ``paper`` accounting: ``share_p = ctx_p``.

Why the sums regroup by block: hashes are chained, so a program holding block ``b`` holds every
block before it, and ``c`` never increases along a chain: a block held by ``c >= 2`` programs lies
in the shared prefix of each of them. Hence (``a_p = 2 ** ((t_p - base) / h)``, ``A(b)`` and
``N(b)`` the sums of ``a_p`` and of 1 over the ACTING holders of ``b``)::

    sum_p share_p           = sum_p ctx_p - bs * (occurrences - distinct blocks)
    sum_ACT share_p         = sum_ACT ctx_p       - bs * sum_b N(b) * (1 - 1 / c(b))
    sum_ACT a_p * share_p   = sum_ACT a_p * ctx_p - bs * sum_b A(b) * (1 - 1 / c(b))
    resume_demand           = demand - sum_ACT share_p + 2 ** (-(now - base) / h) * sum_ACT a_p * share_p

Every term changes only when a program does (a request of it starts, is placed, ends; it pauses,
resumes, is released), at O(its blocks), so the cost moves from the tick (which stalled a live
server's event loop for tens of ms with 1,000 programs) to the events, a few tens of µs each. The
clamp in ``own_p`` acts only for a program whose context is shorter than its blocks (never from real
requests): such programs are corrected at each tick by bisection. ``base`` is moved (everything
re-added) every ``REBASE_HALF_LIVES`` half-lives, so ``a_p`` never overflows and float drift is reset.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from thunderagent.kv.hashing import common_prefix
from thunderagent.scheduler.programs import Program, ProgramState

#: half-lives between rebases of the decay's reference time (2 ** 64 is far from overflow)
REBASE_HALF_LIVES = 64.0


#: no extra counts (read-only)
NONE: Mapping[int, int] = MappingProxyType({})


def shared_prefix(blocks: Sequence[int], counts: Mapping[int, int], least: int, extra: Mapping[int, int] = NONE) -> int:
    """Leading blocks of ``blocks`` counted at least ``least`` times in ``counts`` plus ``extra``
    (bisection: counts along a chain never increase). A plain loop with the lookups inline: wrapping
    the list for ``bisect`` built a class per call, which cost more than the search."""
    lo, hi = 0, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        b = blocks[mid]
        if counts.get(b, 0) + extra.get(b, 0) < least:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(slots=True, frozen=True)
class _Entry:
    """What a counted program contributes, as last applied (removal takes back exactly this)."""

    prog: Program
    key: str  # its worker: pinned, else where its latest request was served
    blocks: Sequence[int]  # the request's own hash list (never mutated after ``prepare``)
    tokens: int
    acting: bool
    since: float  # ACTING since (0.0 otherwise)

    def same(self, o: _Entry) -> bool:  # `blocks` by identity: an O(1) test on every event
        return (self.key == o.key and self.blocks is o.blocks and self.tokens == o.tokens
                and self.acting == o.acting and self.since == o.since)


class WorkerAccount:
    """The programs counted on one worker and the sums above."""

    __slots__ = ("act_a", "act_atokens", "act_n", "act_tokens", "counts", "members", "occurrences", "s_a", "s_n",
                 "short", "tokens")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.counts: Counter[int] = Counter()  # c(b) (shared accounting)
        self.members: dict[str, Program] = {}
        self.short: dict[str, _Entry] = {}  # programs whose blocks outnumber their context
        self.tokens = 0
        self.occurrences = 0
        self.act_tokens = 0
        self.act_atokens = 0.0
        self.act_n: dict[int, int] = {}  # N(b)
        self.act_a: dict[int, float] = {}  # A(b)
        self.s_n = 0.0  # sum_b N(b) (1 - 1/c(b))
        self.s_a = 0.0  # sum_b A(b) (1 - 1/c(b))


class ProgramAccounts:
    """Watches a :class:`~thunderagent.scheduler.programs.ProgramTable` (``table.watcher``) and
    keeps a :class:`WorkerAccount` per worker and the set of paused programs."""

    def __init__(self, shared: bool, block_size: int, acting_half_life_s: float) -> None:
        self.shared = shared
        self.block_size = block_size
        self.half_life = acting_half_life_s
        self.base: float | None = None
        self.accounts: dict[str, WorkerAccount] = {}
        self.paused: dict[str, Program] = {}  # in the order they were paused (ties: see pacing)
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[str, Program | None] | None = None  # deferred changes (during a tick)

    # -- the table's events -----------------------------------------------------------------------
    def changed(self, prog: Program) -> None:
        pid = prog.program_id
        if prog.state is ProgramState.PAUSED:
            self.paused[pid] = prog
        else:
            self.paused.pop(pid, None)
        if self._pending is not None:
            self._pending[pid] = prog
        else:
            self._apply(pid, prog)

    def removed(self, prog: Program) -> None:
        self.paused.pop(prog.program_id, None)
        if self._pending is not None:
            self._pending[prog.program_id] = None
        else:
            self._apply(prog.program_id, None)

    def defer(self) -> None:
        """Hold account changes until :meth:`flush` (a tick decides on the accounts as they were
        when it began, as a recount would; the paused set stays live)."""
        self._pending = {}

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        for pid, prog in (pending or {}).items():
            self._apply(pid, prog)

    # -- reading ----------------------------------------------------------------------------------
    def account(self, worker_id: str) -> WorkerAccount:
        acc = self.accounts.get(worker_id)
        if acc is None:
            acc = self.accounts[worker_id] = WorkerAccount()
        return acc

    def totals(self, acc: WorkerAccount, now: float) -> tuple[float, float]:
        """``(demand, resume_demand)`` of ``acc`` at ``now``: O(1) (plus the rare short programs)."""
        bs = self.block_size
        decay = 0.5 ** ((now - self.base) / self.half_life) if self.base is not None else 0.0
        if self.shared:
            demand: float = acc.tokens - bs * (acc.occurrences - len(acc.counts))
            act_share = acc.act_tokens - bs * acc.s_n
            act_weighted = acc.act_atokens - bs * acc.s_a
        else:
            demand, act_share, act_weighted = acc.tokens, acc.act_tokens, acc.act_atokens
        resume = demand - act_share + decay * act_weighted
        counts = acc.counts
        for e in acc.short.values():  # own_p's clamp: max(0, ctx - bs * shared) went below zero
            over = shared_prefix(e.blocks, counts, 2) * bs - e.tokens
            if over > 0:
                demand += over
                resume += over * (decay * self._a(e.since) if e.acting else 1.0)
        return demand, resume

    def start_tick(self, now: float) -> None:
        """Before a tick reads the accounts: drop empty ones (workers gone: O(workers)), and move the
        decay's reference time to ``now`` (re-adding every program) once it is ``REBASE_HALF_LIVES``
        half-lives behind: bounded work every that many half-lives."""
        for wid in [w for w, acc in self.accounts.items() if not acc.members]:
            del self.accounts[wid]
        if self.base is not None and now - self.base > REBASE_HALF_LIVES * self.half_life:
            self._rebuild(now)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _a(self, since: float) -> float:
        assert self.base is not None
        return 2.0 ** ((since - self.base) / self.half_life)

    def _rebuild(self, base: float) -> None:
        entries, self._entries, self.base = self._entries, {}, base
        for acc in self.accounts.values():  # emptied in place: the last tick's loads hold these objects
            acc.reset()
        for pid, e in entries.items():
            self._add(pid, e)

    def _apply(self, pid: str, prog: Program | None) -> None:
        old = self._entries.get(pid)
        new = None
        if prog is not None and prog.state is not ProgramState.PAUSED:
            key = prog.pinned or prog.worker
            if key is not None:
                acting = prog.state is ProgramState.ACTING
                new = _Entry(prog, key, prog.blocks, prog.context_tokens, acting, prog.last_change if acting else 0.0)
        if old is not None and new is not None and old.same(new):
            return
        if old is not None and new is not None and old.key == new.key and self.shared and self._in_range(new):
            self._move(pid, old, new)
            return
        if old is not None:
            self._remove(pid, old)
        if new is not None:
            self._add(pid, new)

    def _add(self, pid: str, e: _Entry) -> None:
        if e.acting:
            if self.base is None:
                self.base = e.since
            elif e.since - self.base > REBASE_HALF_LIVES * self.half_life:  # a tick was not due in time
                self._rebuild(e.since)
        self._entries[pid] = e
        acc = self.account(e.key)
        acc.members[pid] = e.prog
        acc.tokens += e.tokens
        a = self._a(e.since) if e.acting else 0.0
        if e.acting:
            acc.act_tokens += e.tokens
            acc.act_atokens += a * e.tokens
        if not self.shared or not e.blocks:
            return
        acc.occurrences += len(e.blocks)
        if len(e.blocks) * self.block_size > e.tokens:
            acc.short[pid] = e
        self._count(acc, e.blocks, 1, int(e.acting), a)

    def _in_range(self, e: _Entry) -> bool:
        """``e`` can be added without moving ``base`` first."""
        return not e.acting or (self.base is not None and e.since - self.base <= REBASE_HALF_LIVES * self.half_life)

    def _move(self, pid: str, old: _Entry, new: _Entry) -> None:
        """A program changed on the same worker (its next turn's blocks, its state): only the blocks
        past what the two lists share change counts (a turn extends the last one's prompt); the
        ACTING sums are taken back and added again in one pass each."""
        acc = self.accounts[old.key]
        self._entries[pid] = new
        acc.members[pid] = new.prog
        acc.tokens += new.tokens - old.tokens
        a_old = self._a(old.since) if old.acting else 0.0
        a_new = self._a(new.since) if new.acting else 0.0
        if old.acting:
            acc.act_tokens -= old.tokens
            acc.act_atokens -= a_old * old.tokens
            self._count(acc, old.blocks, 0, -1, a_old)
        acc.occurrences += len(new.blocks) - len(old.blocks)
        acc.short.pop(pid, None)
        if len(new.blocks) * self.block_size > new.tokens:
            acc.short[pid] = new
        k = common_prefix(old.blocks, new.blocks)
        if k < len(old.blocks):
            self._count(acc, old.blocks[k:], -1, 0, 0.0)
        if k < len(new.blocks):
            self._count(acc, new.blocks[k:], 1, 0, 0.0)
        if new.acting:
            acc.act_tokens += new.tokens
            acc.act_atokens += a_new * new.tokens
            self._count(acc, new.blocks, 0, 1, a_new)

    def _remove(self, pid: str, e: _Entry) -> None:
        del self._entries[pid]
        acc = self.accounts[e.key]
        del acc.members[pid]
        acc.tokens -= e.tokens
        a = self._a(e.since) if e.acting else 0.0
        if e.acting:
            acc.act_tokens -= e.tokens
            acc.act_atokens -= a * e.tokens
        if self.shared and e.blocks:
            acc.occurrences -= len(e.blocks)
            acc.short.pop(pid, None)
            self._count(acc, e.blocks, -1, -int(e.acting), a)
        if not acc.members:  # empty: any float drift goes with it (the object stays: a tick's loads hold it)
            acc.s_n = acc.s_a = acc.act_atokens = 0.0

    @staticmethod
    def _count(acc: WorkerAccount, blocks: Sequence[int], dc: int, dn: int, a: float) -> None:
        """Over ``blocks``: ``c(b) += dc``, ``N(b) += dn``, ``A(b) += dn * a``, and the two sums
        with them (the hot loop of every event: locals only)."""
        counts, act_n, act_a = acc.counts, acc.act_n, acc.act_a
        s_n, s_a = acc.s_n, acc.s_a
        da = dn * a
        for b in blocks:
            c0 = counts.get(b, 0)
            c1 = c0 + dc
            if dc:
                if c1:
                    counts[b] = c1
                else:
                    del counts[b]
            n0 = act_n.get(b, 0)
            if not n0 and not dn:
                continue
            a0 = act_a.get(b, 0.0)
            f0 = 1.0 - 1.0 / c0 if c0 else 0.0
            f1 = 1.0 - 1.0 / c1 if c1 else 0.0
            n1, a1 = n0 + dn, a0 + da
            if not n1:
                a1 = 0.0  # the last ACTING holder left: exactly zero, no drift kept
                act_n.pop(b, None)
                act_a.pop(b, None)
            elif dn:
                act_n[b], act_a[b] = n1, a1
            s_n += n1 * f1 - n0 * f0
            s_a += a1 * f1 - a0 * f0
        acc.s_n, acc.s_a = s_n, s_a
