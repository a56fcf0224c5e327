"""Agent programs: the requests of one agent trajectory, tracked as one unit (the ThunderAgent paper's
program abstraction). Pure and clock-free.

A program id comes with a request (``x-thunderagent-program-id``, a body ``program_id``, or Dynamo's
``x-dynamo-session-id``). States:

- ``REASONING``: a request of the program is in flight;
- ``ACTING``: between a response and the program's next request (a tool is running);
- ``PAUSED``: the pacer (:mod:`thunderagent.scheduler.pacing`) took it out of the fleet's KV budget:
  its next request is held until it is resumed. A REASONING program is never paused mid-turn: it is
  marked (``pause_after_turn``) and pauses when its turn ends;
- ``TERMINATED``: released by the client (``POST /v1/programs/{id}/release``) or idle past the TTL;
  a terminated program is forgotten.

The table records where a program's requests were served (its worker), where the pacer pinned it
after a resume, its steps, its context size and the block hashes of its latest prompt (the pacer
counts a prefix shared by several programs once).

Program ids come from clients, so the table is bounded and costs O(1) per request whatever its size:
the count per state is kept as states change (``by_state`` runs on every program request's start and
end), idle programs wait in a heap by the time they went idle (the TTL sweep pops only what expired),
and past ``max_programs`` a new program evicts an idle program (a program with a request in flight is
never evicted: those are bounded by the requests admitted, not by the table).

With API keys on, programs are a tenant's own: the table's key is ``tenant/id`` (:func:`program_key`),
so two tenants that pick the same id never share a record, and one tenant cannot release or read
another's program. The bound is shared max-min fairly: a new program evicts the idlest program of the
tenant that holds the most (counting the new one, so on a tie the newcomer's tenant pays). A tenant
alone may fill the table, but a flood of new ids from one tenant evicts only its own programs once it
holds more than any other: it can push no other tenant below its own count. Each tenant keeps its idle
programs in a heap of its own too, and the tenants are bucketed by how many programs they hold, so an
eviction costs a sort of the distinct counts (at most ~sqrt(2 x programs)), not of the tenants.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from thunderagent.scheduler.queue import QueueFull

#: what a program id may be: it appears in URLs and logs
PROGRAM_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
#: between a tenant and a program id in the table's key: neither a tenant name nor an id holds it
OWNER_SEP = "/"


def program_key(tenant: str | None, program_id: str) -> str:
    """The table's key of a client's program: ``tenant/id`` with API keys on, the client's id without.
    The tenant itself is given to the table apart (``request_started``): the key is never parsed, as
    ids from elsewhere (a trace's sessions, ``conversation/agent``) may hold the separator."""
    return program_id if tenant is None else f"{tenant}{OWNER_SEP}{program_id}"


class ProgramState(StrEnum):
    REASONING = "reasoning"
    ACTING = "acting"
    PAUSED = "paused"
    TERMINATED = "terminated"


#: the states a program in the table can be in (a terminated one is forgotten)
LIVE_STATES = (ProgramState.REASONING, ProgramState.ACTING, ProgramState.PAUSED)


@dataclass(slots=True)
class Program:
    program_id: str  # the table's key (:func:`program_key`)
    state: ProgramState
    first_seen: float
    last_change: float
    in_flight: int = 0  # requests in the system (held by the pacer included)
    steps: int = 0  # responses completed
    context_tokens: int = 0  # tokens of its latest step (prompt, then prompt + completion)
    worker: str | None = None  # where its latest request was served
    #: the block hashes of its latest prompt (the request's own list, not a copy)
    blocks: Sequence[int] = ()
    admitted: bool = False  # a request of it was dispatched at least once
    pinned: str | None = None  # the worker the pacer placed it on at its last resume
    pause_after_turn: bool = False
    paused_since: float = -1.0
    pause_cycles: int = 0
    resumed_at: float = -1.0
    seq: int = 0  # creation order in its table (ties in the pacer's orders go by it)
    #: ``last_change`` as of its entry in the table's idle heap; None: not idle (no live entry)
    idle_since: float | None = None
    tenant: str | None = None  # whose it is (API keys on; None: keys off)

    @property
    def client_id(self) -> str:
        """The id its client gave (the key less its tenant)."""
        return self.program_id if self.tenant is None else self.program_id[len(self.tenant) + len(OWNER_SEP):]

    def as_dict(self, now: float) -> dict[str, object]:
        return {
            "id": self.client_id, "tenant": self.tenant, "state": self.state.value, "worker": self.worker,
            "steps": self.steps,
            "in_flight": self.in_flight, "context_tokens": self.context_tokens,
            "age_s": round(now - self.first_seen, 3), "in_state_s": round(now - self.last_change, 3),
            "pinned": self.pinned, "pause_cycles": self.pause_cycles, "pause_after_turn": self.pause_after_turn,
        }


#: the 429's error code when a tenant's program cap refuses a new program
PROGRAM_CAP_CODE = "too_many_programs"

#: ``listing`` / ``by_state`` over every tenant's programs (not a tenant name: those hold no ``*``)
EVERYONE = "*"


@dataclass(slots=True)
class _Owner:
    """One tenant's programs (keys off: all of them), with their idle heap."""

    programs: dict[str, Program] = field(default_factory=dict)
    # (idle since, seq, key) of its idle programs, oldest first; an entry whose program changed since is
    # stale and skipped when popped (cheaper than finding it on every change)
    idle: list[tuple[float, int, str]] = field(default_factory=list)


def _push(heap: list[tuple[float, int, str]], entry: tuple[float, int, str], bound: int,
          programs: Iterable[Program]) -> None:
    """Push an idle entry; past ``bound`` entries (mostly stale), first rebuild the heap from the other
    idle ``programs``."""
    if len(heap) > bound:
        heap[:] = [(p.idle_since, p.seq, p.program_id) for p in programs
                   if p.idle_since is not None and p.program_id != entry[2]]
        heapq.heapify(heap)
    heapq.heappush(heap, entry)


class ProgramWatcher(Protocol):
    """Told of every change to a program (after it) and of its removal: the pacer's accounts
    (:class:`~thunderagent.scheduler.accounts.ProgramAccounts`) follow the table this way."""

    def changed(self, prog: Program) -> None: ...

    def removed(self, prog: Program) -> None: ...


class ProgramTable:
    def __init__(self, idle_ttl_s: float, max_programs: int | None = None,
                 tenant_caps: tuple[Mapping[str, int | None], int | None] = ({}, None)) -> None:
        """``max_programs``: past it a new program evicts an idle one (None: no bound). ``tenant_caps``:
        programs per tenant at most (``config.tenants.program_caps``: per named tenant, and for the
        others; None: no bound): past its cap a tenant's new program evicts its own idlest one, and
        is refused (:class:`~thunderagent.scheduler.queue.QueueFull`) while none is idle."""
        if idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be > 0, got {idle_ttl_s}")
        if max_programs is not None and max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.idle_ttl_s = idle_ttl_s
        self.max_programs = max_programs
        self._caps, self._default_cap = tenant_caps
        self._programs: dict[str, Program] = {}
        self._owners: dict[str | None, _Owner] = {}  # per tenant; an owner with no program left is dropped
        #: program count -> the tenants holding that many (in the order they reached it): eviction's order
        self._by_size: dict[int, dict[str | None, None]] = {}
        # (idle since, seq, key) of idle programs, oldest first, for the TTL sweep (each tenant's heap holds
        # the same entries, for eviction); an entry whose program changed since is stale and skipped when
        # popped (cheaper than finding it on every change)
        self._idle: list[tuple[float, int, str]] = []
        self._created = 0
        self.watcher: ProgramWatcher | None = None
        #: a tenant's programs with a request in flight at the other frontends of a NATS deployment, at ``now``
        #: (``TenantLimiter.peer_programs``, set when they share limits): they count against its cap here too
        self.peer_programs: Callable[[str, float], int] | None = None
        self._counts = dict.fromkeys(LIVE_STATES, 0)
        self.evicted = 0  # idle programs forgotten early to stay within max_programs
        #: evictions per tenant since the last :meth:`take_evictions` (the fleet's metrics drain it)
        self._new_evictions: dict[str | None, int] = {}

    def __len__(self) -> int:
        return len(self._programs)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._programs.values())

    def get(self, program_id: str) -> Program | None:
        return self._programs.get(program_id)

    def heap_entries(self) -> int:
        """Entries in the idle heaps, stale ones included (the sweep's and the tenants' heaps, each bounded
        by about twice the programs)."""
        return len(self._idle) + sum(len(owner.idle) for owner in self._owners.values())

    def request_started(self, program_id: str, now: float, blocks: Sequence[int] = (),
                        prompt_tokens: int = 0, tenant: str | None = None) -> Program:
        """A request of ``program_id`` (a table key: :func:`program_key` of ``tenant``'s, or any id without
        a tenant) arrived: the program is (or becomes) REASONING, unless it is PAUSED (the request is
        then held until the pacer resumes it)."""
        prog = self._programs.get(program_id)
        if prog is None:
            if tenant is not None and not program_id.startswith(tenant + OWNER_SEP):
                raise ValueError(f"program key {program_id!r} is not tenant {tenant!r}'s (program_key)")
            if tenant is not None:
                self._within_cap(tenant, now)
            if self.max_programs is not None and len(self._programs) >= self.max_programs:
                self._evict_for(tenant)
            self._created += 1
            prog = self._programs[program_id] = Program(program_id, ProgramState.REASONING, now, now,
                                                        seq=self._created, tenant=tenant)
            owner = self._owners.get(tenant)
            if owner is None:
                owner = self._owners[tenant] = _Owner()
            owner.programs[program_id] = prog
            self._resized(tenant, len(owner.programs) - 1, len(owner.programs))
            self._counts[ProgramState.REASONING] += 1
        elif prog.state is ProgramState.ACTING:
            self._set(prog, ProgramState.REASONING)
            prog.last_change = now
        prog.in_flight += 1
        if prompt_tokens:
            prog.blocks, prog.context_tokens = blocks, prompt_tokens
        self._changed(prog)
        return prog

    def request_placed(self, program_id: str, worker_id: str, unpin: bool = False) -> None:
        """A request of the program went to ``worker_id``; ``unpin``: its pin (if any) is dropped, its next
        requests are routed freely."""
        prog = self._programs.get(program_id)
        if prog is not None:
            prog.worker = worker_id
            prog.admitted = True
            if unpin:
                prog.pinned = None
            self._changed(prog)

    def request_finished(self, program_id: str, context_tokens: int, now: float, *, completed: bool) -> None:
        """A request ended; ``completed``: it produced its response (a step). With nothing left in
        flight the program is ACTING (its tool runs until its next request), or PAUSED if the pacer
        marked it during the turn."""
        prog = self._programs.get(program_id)
        if prog is None:
            return  # released while its request ran
        prog.in_flight = max(0, prog.in_flight - 1)
        if completed:
            prog.steps += 1
            prog.context_tokens = context_tokens
        if prog.in_flight or prog.state is ProgramState.PAUSED:
            self._changed(prog)
            return
        if prog.pause_after_turn:
            self.pause(prog, now)
        else:
            self._set(prog, ProgramState.ACTING)
            prog.last_change = now
            self._changed(prog)

    def pause(self, prog: Program, now: float) -> None:
        self._set(prog, ProgramState.PAUSED)
        prog.last_change = now
        prog.pause_after_turn = False
        prog.paused_since = now
        prog.pause_cycles += 1
        prog.pinned = None
        self._changed(prog)

    def resume(self, prog: Program, worker_id: str | None, now: float) -> None:
        self._set(prog, ProgramState.REASONING if prog.in_flight else ProgramState.ACTING)
        prog.last_change = prog.resumed_at = now
        prog.paused_since = -1.0
        prog.pinned = worker_id
        self._changed(prog)

    def release(self, program_id: str) -> bool:
        """The client says the program is done (TERMINATED): forget it. False if unknown."""
        prog = self._programs.get(program_id)
        if prog is not None:
            self._forget(prog)
        return prog is not None

    def expire(self, now: float) -> list[str]:
        """Programs idle (ACTING, or PAUSED with nothing held) for the TTL or longer are TERMINATED;
        returns their ids, oldest program first. Work: the heap entries that expired, not the table."""
        ttl, heap = self.idle_ttl_s, self._idle
        gone: list[Program] = []
        while heap and now - heap[0][0] >= ttl:
            prog = self._live(*heapq.heappop(heap))
            if prog is not None:
                prog.idle_since = None  # a duplicate entry (idle again at the same time) is stale now
                gone.append(prog)
        gone.sort(key=lambda p: p.seq)  # the order of a scan of the table (creation order)
        for prog in gone:
            self._forget(prog)
        return [p.program_id for p in gone]

    def busy(self, tenant: str) -> int:
        """``tenant``'s programs here with a request in flight (what the other frontends count)."""
        owner = self._owners.get(tenant)
        return 0 if owner is None else sum(1 for p in owner.programs.values() if p.in_flight)

    def _within_cap(self, tenant: str, now: float) -> None:
        """``tenant`` starts a program: at its cap (its programs here, and its busy ones at the other
        frontends), its idlest programs here are forgotten first (evictions); with none idle (each has a
        request in flight) the new one is refused and nothing changes."""
        cap = self._caps.get(tenant, self._default_cap)
        if cap is None:
            return
        owner = self._owners.get(tenant)
        elsewhere = self.peer_programs(tenant, now) if self.peer_programs is not None else 0
        held = len(owner.programs) if owner is not None else 0
        if held + elsewhere < cap:
            return
        busy = self.busy(tenant)
        if busy + elsewhere >= cap:  # evicting every idle one here would not make room: evict none
            there = f" here and {elsewhere} at the other frontends" if elsewhere else ""
            raise QueueFull(f"tenant {tenant!r} holds {busy} agent programs{there}, each with a request in "
                            f"flight (control_plane.tenant_limits max_programs: {cap}); release one, or retry "
                            "once one of its requests ends", 1.0, code=PROGRAM_CAP_CODE)
        for _ in range(held + elsewhere - cap + 1):  # its idlest ones here, as many as it takes
            self._evict_from(owner)  # type: ignore[arg-type]  (held > busy: it has that many idle)

    def _evict_for(self, tenant: str | None) -> None:
        """The table is full and ``tenant`` starts a program: forget the idlest program of the tenant
        holding the most, counting the new one (max-min fair: on a tie ``tenant`` pays; between other
        tenants tied, the one that reached that count first), as if its TTL had run out. A tenant with
        none idle is passed over (none idle anywhere: every program has a request in flight, and the
        table grows past the bound with them). Work: a sort of the distinct per-tenant counts (at
        most ~sqrt(2 x programs) of them, however many tenants), then usually one heap pop."""
        mine = self._owners.get(tenant)
        level = (len(mine.programs) if mine is not None else 0) + 1  # the tenant's count with the new one
        by_size = self._by_size
        for size in sorted(by_size.keys() | {level}, reverse=True):
            if size == level and mine is not None and self._evict_from(mine):
                return
            for other in by_size.get(size, ()):
                # an eviction changes by_size, but it ends the loop
                if other != tenant and self._evict_from(self._owners[other]):
                    return

    def _evict_from(self, owner: _Owner) -> bool:
        heap = owner.idle
        while heap:
            prog = self._live(*heapq.heappop(heap))
            if prog is not None:
                self._forget(prog)
                self.evicted += 1
                new = self._new_evictions
                new[prog.tenant] = new.get(prog.tenant, 0) + 1
                return True
        return False

    def take_evictions(self) -> dict[str | None, int]:
        """Evictions per tenant since the last call (read on every program request: O(tenants evicted
        from since), and no allocation while there were none)."""
        new = self._new_evictions
        if new:
            self._new_evictions = {}
        return new

    def _resized(self, tenant: str | None, old: int, new: int) -> None:
        """One tenant's program count went from ``old`` to ``new``: ``_by_size`` follows."""
        by_size = self._by_size
        if old:
            bucket = by_size[old]
            del bucket[tenant]
            if not bucket:
                del by_size[old]
        if new:
            by_size.setdefault(new, {})[tenant] = None

    def _live(self, since: float, seq: int, program_id: str) -> Program | None:
        """The program of an idle-heap entry if the entry is current (else it is stale: skipped)."""
        prog = self._programs.get(program_id)
        return prog if prog is not None and prog.seq == seq and prog.idle_since == since else None

    def _forget(self, prog: Program) -> None:
        del self._programs[prog.program_id]
        owner = self._owners[prog.tenant]
        del owner.programs[prog.program_id]
        self._resized(prog.tenant, len(owner.programs) + 1, len(owner.programs))
        if not owner.programs:  # its heap holds only stale entries now
            del self._owners[prog.tenant]
        self._counts[prog.state] -= 1
        prog.idle_since = None
        if self.watcher is not None:
            self.watcher.removed(prog)

    def _set(self, prog: Program, state: ProgramState) -> None:
        counts = self._counts
        counts[prog.state] -= 1
        counts[state] += 1
        prog.state = state

    def _changed(self, prog: Program) -> None:
        if prog.state is not ProgramState.REASONING and not prog.in_flight:  # idle: the TTL runs
            if prog.idle_since != prog.last_change:
                prog.idle_since = prog.last_change
                entry = (prog.last_change, prog.seq, prog.program_id)
                owner = self._owners[prog.tenant]
                # mostly stale entries: rebuild (amortised O(1): a rebuild follows more pushes than it
                # costs). A tenant's slack is small, as each tenant has a heap: 2 x programs + 16 x tenants
                _push(owner.idle, entry, 2 * len(owner.programs) + 16, owner.programs.values())
                _push(self._idle, entry, 2 * len(self._programs) + 1024, self._programs.values())
        else:
            prog.idle_since = None
        if self.watcher is not None:
            self.watcher.changed(prog)

    def by_state(self, tenant: str | None = EVERYONE) -> dict[str, int]:
        """Programs per state: every tenant's (kept as states change: O(1), called on every program
        request), or one tenant's (a walk of its programs)."""
        if tenant == EVERYONE:
            return {state.value: n for state, n in self._counts.items()}
        counts = dict.fromkeys((s.value for s in LIVE_STATES), 0)
        for prog in self._mine(tenant):
            counts[prog.state.value] += 1
        return counts

    def _mine(self, tenant: str | None) -> Iterable[Program]:
        if tenant == EVERYONE:
            return self._programs.values()
        owner = self._owners.get(tenant)
        return owner.programs.values() if owner is not None else ()

    def snapshot(self, now: float) -> list[dict[str, object]]:
        """Every program, oldest first."""
        return self.listing(now)[0]

    def listing(self, now: float, state: ProgramState | None = None, limit: int | None = None,
                tenant: str | None = EVERYONE) -> tuple[list[dict[str, object]], int]:
        """``snapshot`` of ``tenant``'s programs (EVERYONE: all) in ``state`` (None: any), the ``limit``
        oldest; and how many matched. O(programs x log limit): a listing of a full table does not
        sort all of it."""
        progs = self._mine(tenant)
        matching: Iterable[Program]
        if tenant != EVERYONE:
            matching = [p for p in progs if state is None or p.state is state]
            total = len(matching)
        elif state is None:
            matching, total = progs, len(self._programs)
        else:
            matching, total = (p for p in progs if p.state is state), self._counts[state]
        if limit is None or limit >= total:
            chosen = sorted(matching, key=lambda p: p.first_seen)
        else:  # stable like sorted(): ties keep the table's order
            chosen = heapq.nsmallest(limit, matching, key=lambda p: p.first_seen)
        return [p.as_dict(now) for p in chosen], total
