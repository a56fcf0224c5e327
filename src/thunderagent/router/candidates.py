"""FleetView: the routable workers as a maintained structure, so a kv_aware decision scores the few
workers that can win instead of the whole fleet.

The driver owns the view and tells it every load change (``set_load``), every worker joining
(``add``) and leaving (``remove``); the view keeps, sorted, the *free* workers (not busy, as the cost
function defines it) by the request-independent part of their cost (``cost.base_load``), and every
worker's queued prefill (the cost's credit is relative to the least backlogged one). A view is also
a plain ``Sequence[WorkerState]`` in the driver's order, so it can be passed wherever a list of
workers goes; the router takes the fast path only when it is handed a view (a filtered list, for a
retry or a pinned program, is scanned whole as before).

Why sorted lists and not heaps: reading the k smallest must not pop, and an update must remove one
precise entry. ``bisect`` finds it in O(log n); the insert/delete then moves pointers with one
``memmove`` (O(n) bytes, ~1 µs at 10,000 workers), far below one cost evaluation in Python.

Pure, synchronous, clock-free. ``FleetView`` is not thread-safe (no part of the core is).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from thunderagent.config import Role, RoutingConfig
from thunderagent.router.cost import base_load, cost_terms, is_busy, score_terms
from thunderagent.decision import CandidateScore
from thunderagent.types import LoadReport, WorkerState


_NO_LIMIT = 1 << 62  # a FleetView floor where no worker states a limit


class FleetView(Sequence[WorkerState]):
    __slots__ = ("cfg", "_states", "_loads", "_pos", "_free", "_free_key", "_busy", "_queued", "_queued_key",
                 "version", "prefill_workers", "seq_floor", "prompt_floor")

    def __init__(self, cfg: RoutingConfig, workers: Iterable[WorkerState] = ()) -> None:
        self.cfg = cfg
        self._states: list[WorkerState] = []
        self._loads: list[LoadReport] = []  # parallel to _states: a snapshot is one C-level list copy
        self._pos: dict[str, int] = {}
        self._free: list[tuple[float, int]] = []  # (base_load, position) of free workers, ascending
        self._free_key: list[tuple[float, int] | None] = []  # per position: its key in _free, None = busy
        self._busy: set[int] = set()  # positions of busy workers
        self._queued: list[tuple[int, int]] = []  # (queued prefill, position) of every worker, ascending
        self._queued_key: list[tuple[int, int]] = []
        #: bumped on every membership change (add/remove): lets the router refresh what it derives
        self.version = 0
        #: workers of role prefill (the dispatcher splits the pools only when there are some: O(1), not a scan)
        self.prefill_workers = 0
        #: every worker holds a sequence / takes a prompt this long (``WorkerState.holds``): a request within
        #: both needs no per-worker check (the usual case: only a mixed fleet has a floor below its ceiling)
        self.seq_floor = self.prompt_floor = _NO_LIMIT
        for w in workers:
            self.add(w)

    # -- Sequence ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._states)

    @overload
    def __getitem__(self, i: int) -> WorkerState: ...
    @overload
    def __getitem__(self, i: slice) -> list[WorkerState]: ...
    def __getitem__(self, i: int | slice) -> WorkerState | list[WorkerState]:
        return self._states[i]

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(self._states)

    @property
    def states(self) -> list[WorkerState]:
        """The workers in the driver's order (``view[i]`` without the method call, for hot loops). Read only."""
        return self._states

    # -- maintenance (drivers) ------------------------------------------------------------------
    def add(self, w: WorkerState) -> None:
        if w.worker_id in self._pos:
            raise ValueError(f"worker {w.worker_id!r} is already in the fleet view")
        i = len(self._states)
        self._pos[w.worker_id] = i
        self._states.append(w)
        self._loads.append(w.load)
        self._free_key.append(None)
        self._queued_key.append((w.load.queued_prefill_tokens, i))
        insort(self._queued, self._queued_key[i])
        self._place(i)
        self.version += 1
        self.prefill_workers += w.role == Role.prefill.value
        if w.max_seq_tokens:
            self.seq_floor = min(self.seq_floor, w.max_seq_tokens)
        if w.max_prompt_tokens:
            self.prompt_floor = min(self.prompt_floor, w.max_prompt_tokens)

    def remove(self, worker_id: str) -> None:
        """O(n): positions shift, so the orders are rebuilt (membership changes are rare)."""
        i = self._pos.get(worker_id)
        if i is None:
            return
        rest = self._states[:i] + self._states[i + 1:]
        version = self.version
        self.__init__(self.cfg, rest)  # type: ignore[misc]
        self.version = version + 1

    def set_load(self, i: int, load: LoadReport) -> None:
        """Worker at position ``i`` reported ``load`` (the view sets ``WorkerState.load`` too)."""
        self._states[i].load = load
        self._loads[i] = load
        old = self._queued_key[i]
        if old[0] != load.queued_prefill_tokens:
            del self._queued[bisect_left(self._queued, old)]
            self._queued_key[i] = new = (load.queued_prefill_tokens, i)
            insort(self._queued, new)
        self._place(i)

    def update(self, w: WorkerState) -> None:
        """``w``'s load changed (by worker id); adds ``w`` if the view does not hold it yet."""
        i = self._pos.get(w.worker_id)
        if i is None:
            self.add(w)
        else:
            self.set_load(i, w.load)

    def _place(self, i: int) -> None:
        w = self._states[i]
        old = self._free_key[i]
        key = None if is_busy(w, self.cfg) else (base_load(w, self.cfg), i)
        if key == old and (key is not None or i in self._busy):
            return
        if old is not None:
            del self._free[bisect_left(self._free, old)]
        if key is not None:
            insort(self._free, key)
            self._busy.discard(i)
        else:
            self._busy.add(i)
        self._free_key[i] = key

    # -- queries (router) -----------------------------------------------------------------------
    def position(self, worker_id: str) -> int | None:
        return self._pos.get(worker_id)

    def is_free(self, i: int) -> bool:
        return self._free_key[i] is not None

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def free_order(self) -> list[tuple[float, int]]:
        """(base_load, position) of the free workers, least loaded first. Read only."""
        return self._free

    @property
    def busy_positions(self) -> set[int]:
        """Positions of the busy workers. Read only."""
        return self._busy

    def min_queued(self) -> int:
        return self._queued[0][0]

    def snapshot(self) -> list[LoadReport]:
        return list(self._loads)


class LazyScores(Sequence[CandidateScore]):
    """``Decision.candidates`` of a decision that scored only part of the fleet: every worker's
    score, computed on first access from the loads and overlaps the decision saw, so it is the
    list a full scan would have built (same order, same values)."""

    __slots__ = ("_states", "_loads", "_args", "_built")

    def __init__(self, view: FleetView, num_tokens: int, levels: list[tuple[int, int]], bits: list[int],
                 min_queued: int, best_cached: int, cfg: RoutingConfig | None = None, held: int = 0) -> None:
        """``levels``: the index's ``match_levels``; ``bits``: each view position's index bit (the
        caller's list must not change afterwards); ``cfg``: the router's (its weights may be tuned,
        ``router/autotune.py``), else the view's."""
        # WorkerState objects are mutated by drivers after the decision: keep their loads as they were
        self._states = view._states[:]
        self._loads = view.snapshot()
        self._args = (num_tokens, levels, bits, cfg or view.cfg, min_queued, best_cached, held)
        self._built: tuple[CandidateScore, ...] | None = None

    def _all(self) -> tuple[CandidateScore, ...]:
        built = self._built
        if built is None:
            n, levels, bits, cfg, min_queued, best_cached, held = self._args
            terms = cost_terms(cfg)
            built = self._built = tuple(
                score_terms(WorkerState(w.worker_id, w.block_size, w.max_num_batched_tokens, w.queue_depth_threshold,
                                        load),
                            n, depth(levels, bit), terms, min_queued, best_cached, held)
                for w, load, bit in zip(self._states, self._loads, bits)
            )
        return built

    def __len__(self) -> int:
        return len(self._states)

    @overload
    def __getitem__(self, i: int) -> CandidateScore: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[CandidateScore, ...]: ...
    def __getitem__(self, i: int | slice) -> CandidateScore | tuple[CandidateScore, ...]:
        return self._all()[i]

    def __iter__(self) -> Iterator[CandidateScore]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyScores):
            return self._all() == other._all()
        if isinstance(other, tuple):
            return self._all() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return f"LazyScores({len(self)} workers{', built' if self._built is not None else ''})"


def depth(levels: list[tuple[int, int]], bit: int) -> int:
    """Leading blocks the worker of index bit ``bit`` holds, by ``KvIndex.match_levels``."""
    for blocks, mask in levels:
        if mask & bit:
            return blocks
    return 0
