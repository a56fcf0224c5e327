"""Prefix grouping and coalescing: siblings wait for their leader's prefix instead of prefilling it again.

Pure and clock-free (``now`` is passed in). A **group** is one in-flight request (its *leader*) on
one worker, keyed by the chained hash of its ``group_min_blocks``-th block (a chained hash names the
whole prefix before it) and, with ``coalesce``, by the hash of its last full block (an identical
prefill has the same one, however short). A new request with a key that some group holds:

- if that prefix is already **confirmed** stored on the group's worker (a ``BlockStored`` reached
  the index; predictions do not count), nothing to wait for: it is routed as usual;
- if some worker is **idle** (nothing running or waiting) and leads no group of that key, it is
  routed away from the group's workers: an idle worker computing the prefix costs no more time than
  waiting for the leader's, so it starts there and leads a group of its own (the prefix is then
  prefilled once per worker used, never once per request);
- otherwise it becomes a **follower** of the key's group with the fewest follower tokens, held
  here and pinned to that group's worker. It is released (into the dispatcher's ready path) when
  the index confirms the prefix it shares with the leader on that worker, or when the leader
  produced its first token or ended (pinned to that worker when the leader succeeded), or after
  ``follower_max_wait_ms`` (on its own). A group takes new followers for ``follower_max_wait_ms``
  after its leader was placed (a slow leader does not collect followers forever).

**Window** (``enabled``): under load a new request that could lead a group waits up to a window so
that its siblings arriving meanwhile follow it; the window is ``window_max_ms`` (``batch_window_max_ms``
for priority < 0) times the fleet's load, the mean over workers of their queued prefill in passes
(capped at 1): 0 at idle, so an idle fleet adds no latency.

Why hold followers at all when an engine shares blocks computed earlier in the same pass (vLLM v1
and the simulated engine register a block at allocation): siblings routed elsewhere by load
balancing each compute the prefix; and a sibling joining the engine's queue behind its leader makes
the worker look busier than it is (the router's cost counts its prompt before the leader stored the
prefix). Held here, a follower adds no queued work anywhere until the prefix is known to be stored.

Bounds: at most ``limit`` followers and windows held (past it new requests route as usual); work per
KV-event batch is the followers waiting on that worker; per request, a few dict lookups.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.config import GroupingConfig
from thunderagent.kv.hashing import common_prefix
from thunderagent.kv.index import KvIndex
from thunderagent.scheduler.queue import Held
from thunderagent.types import WorkerState

__all__ = ["Grouper"]


@dataclass(slots=True, eq=False)
class _Group:
    keys: tuple[int, ...]
    leader: str  # request id
    hashes: list[int]  # the leader's block hashes
    worker: str | None  # None while the leader waits in its window
    followers: list[_Follower] = field(default_factory=list)
    tokens: int = 0  # the followers' prompt tokens beyond the shared prefix
    open: bool = True  # takes new followers


@dataclass(slots=True, eq=False)
class _Follower:
    held: Held
    group: _Group
    need: int  # hash of the last block shared with the leader: released once stored on the worker
    tokens: int
    gone: bool = False


class Grouper:
    def __init__(self, cfg: GroupingConfig, index: KvIndex, block_size: int, ready: deque[Held],
                 limit: int) -> None:
        self.cfg = cfg
        self.index = index
        self.block_size = block_size
        self._ready = ready  # the dispatcher's: released requests go there
        self.limit = limit
        self._by_key: dict[int, list[_Group]] = {}
        self._by_leader: dict[str, _Group] = {}
        self._by_worker: dict[str, list[_Group]] = {}  # placed groups with followers waiting
        self._followers: dict[str, _Follower] = {}
        self._windows: dict[str, tuple[Held, _Group]] = {}  # leaders waiting in their window
        self._timers: list[tuple[float, int, str, object]] = []  # (due, seq, kind, ref), lazily deleted
        self._seq = itertools.count()
        # followers: held behind a leader; coalesced: of those, identical prefills (every full block is the
        # leader's); stored / leader / timeout: followers released, by cause
        self.stats = {"followers": 0, "coalesced": 0, "windows": 0, "stored": 0, "leader": 0, "timeout": 0,
                      "leaders": 0}

    # -- requests in ---------------------------------------------------------------------------
    def keys(self, hashes: Sequence[int]) -> tuple[int, ...]:
        g = self.cfg.group_min_blocks
        out: list[int] = []
        if self.cfg.enabled and len(hashes) >= g:
            out.append(hashes[g - 1])
        if self.cfg.coalesce and hashes and hashes[-1] not in out:
            out.append(hashes[-1])
        return tuple(out)

    def offer(self, held: Held, workers: Sequence[WorkerState], now: float) -> tuple[str, ...] | None:
        """A new request: held here (None: as a follower or a window's leader), or to be routed now
        away from the returned workers (empty: anywhere)."""
        hashes = held.req.block_hashes
        keys = self.keys(hashes)
        if not keys or len(self._followers) + len(self._windows) >= self.limit:
            return ()
        groups = [g for k in keys for g in self._by_key.get(k, ())]
        for g in groups:
            if g.worker is not None and self.index.is_confirmed(g.worker, hashes[common_prefix(hashes, g.hashes) - 1]):
                return ()  # stored there already: the router finds it
        if groups:
            leading = {g.worker for g in groups if g.worker is not None}
            # a worker that holds (or was sent) as much of this prompt as a leader would give wins:
            # a conversation's next turn goes where its history is, not behind a shared system prompt
            elsewhere = max((n for w, n in self.index.find_matches(hashes, now).items() if w not in leading),
                            default=0)
            groups = [g for g in groups if common_prefix(hashes, g.hashes) > elsewhere]
            if not groups:
                return ()
            if any(_idle(w) and w.worker_id not in leading for w in workers):
                return tuple(w for w in leading if w is not None)  # an idle worker starts it at once
            open_groups = [g for g in groups if g.open]
            if open_groups:
                self._follow(held, min(open_groups, key=lambda g: g.tokens), now)
                return None
            return ()
        window = self.window(workers, held.req.priority)
        if window <= 0 or not self.cfg.enabled or len(hashes) < self.cfg.group_min_blocks:
            return ()
        group = _Group(keys, held.req.request_id, hashes, None)
        self._register(group)
        self._windows[held.req.request_id] = (held, group)
        self._timer(now + window, "window", held.req.request_id)
        self.stats["windows"] += 1
        return None

    def window(self, workers: Sequence[WorkerState], priority: int) -> float:
        """Seconds a new request may wait for siblings: the window's maximum times the fleet's load."""
        if not workers:
            return 0.0
        load = sum(min(1.0, w.load.queued_prefill_tokens / w.max_num_batched_tokens) for w in workers) / len(workers)
        top = self.cfg.batch_window_max_ms if priority < 0 else self.cfg.window_max_ms
        return top * load / 1e3

    def placed(self, request_id: str, hashes: Sequence[int], worker: str, now: float) -> None:
        """A request was routed to ``worker``: a window's leader takes its group there; another
        leads a new group unless the worker holds (or is computing) its prefix already."""
        win = self._windows.pop(request_id, None)
        if win is not None:
            group = win[1]
            group.worker = worker
            if group.followers:
                self._by_worker.setdefault(worker, []).append(group)
            self._timer(now + self.cfg.follower_max_wait_ms / 1e3, "close", group)
            self.stored(worker)
            return
        keys = self.keys(hashes)
        if not keys or request_id in self._by_leader:
            return
        if any(g.worker == worker for k in keys for g in self._by_key.get(k, ())):
            return  # a sibling of a leader there (released, or routed there anyway)
        if any(self.index.is_confirmed(worker, k) for k in keys):
            return  # stored there already: nothing to wait for
        group = _Group(keys, request_id, list(hashes), worker)
        self._register(group)
        self._timer(now + self.cfg.follower_max_wait_ms / 1e3, "close", group)
        self.stats["leaders"] += 1

    def _follow(self, held: Held, group: _Group, now: float) -> None:
        hashes = held.req.block_hashes
        n = common_prefix(hashes, group.hashes)
        f = _Follower(held, group, hashes[n - 1], max(0, len(held.req.prompt_tokens) - n * self.block_size))
        group.followers.append(f)
        group.tokens += f.tokens
        if group.worker is not None and len(group.followers) == 1:
            self._by_worker.setdefault(group.worker, []).append(group)
        self._followers[held.req.request_id] = f
        self._timer(now + self.cfg.follower_max_wait_ms / 1e3, "follower", f)
        self.stats["followers"] += 1
        self.stats["coalesced"] += n == len(hashes)

    # -- releases --------------------------------------------------------------------------------
    def stored(self, worker: str) -> int:
        """KV events of ``worker`` reached the index: its followers whose prefix is now confirmed
        there go (pinned to it). Returns how many."""
        groups = self._by_worker.get(worker)
        if not groups:
            return 0
        n = 0
        confirmed = self.index.is_confirmed
        for g in list(groups):
            for f in [f for f in g.followers if confirmed(worker, f.need)]:
                self._release(f, worker)
                n += 1
        self.stats["stored"] += n
        return n

    def progressed(self, request_id: str, ok: bool) -> int:
        """A leader produced its first token or ended (``ok``: it got that far without an error):
        its group closes and its followers go, pinned to its worker when ``ok``."""
        group = self._by_leader.pop(request_id, None)
        if group is None:
            return 0
        self._close(group)
        n = len(group.followers)
        for f in list(group.followers):
            self._release(f, group.worker if ok else None)
        self.stats["leader"] += n
        return n

    def expire(self, now: float) -> int:
        """Windows ended (their leaders go), followers past ``follower_max_wait_ms`` (on their own),
        groups past their time to take followers. Returns how many requests were released."""
        timers, n = self._timers, 0
        while timers and timers[0][0] <= now:
            _, _, kind, ref = heapq.heappop(timers)
            if kind == "window":
                win = self._windows.get(ref)  # type: ignore[arg-type]
                if win is not None and win[1].worker is None and win[0] not in self._ready:
                    self._ready.append(win[0])  # routed by the pump; ``placed`` gives its group a worker
                    n += 1
            elif kind == "follower":
                f: _Follower = ref  # type: ignore[assignment]
                if not f.gone:
                    self._release(f, None)
                    self.stats["timeout"] += 1
                    n += 1
            else:
                self._close(ref)  # type: ignore[arg-type]
        return n

    def cancel(self, request_id: str) -> bool:
        """Drop a held request (client gone); a window's leader's followers go on their own."""
        f = self._followers.get(request_id)
        if f is not None:
            self._detach(f)
            return True
        win = self._windows.pop(request_id, None)
        if win is None:
            return False
        group = win[1]
        self._close(group)
        self._by_leader.pop(request_id, None)
        for f in list(group.followers):
            self._release(f, None)
        if win[0] in self._ready:
            self._ready.remove(win[0])
        return True

    # -- state ---------------------------------------------------------------------------------
    def held_count(self) -> int:
        """Requests held here (a window's leader already released to the ready path not counted)."""
        return len(self._followers) + sum(1 for h, _ in self._windows.values() if h not in self._ready)

    @property
    def next_deadline(self) -> float:
        """When :meth:`expire` next has something to do (inf: nothing)."""
        return self._timers[0][0] if self._timers else float("inf")

    def _register(self, group: _Group) -> None:
        self._by_leader[group.leader] = group
        for k in group.keys:
            self._by_key.setdefault(k, []).append(group)

    def _close(self, group: _Group) -> None:
        """No new followers (the ones waiting keep waiting for their release)."""
        if not group.open:
            return
        group.open = False
        for k in group.keys:
            lst = self._by_key.get(k)
            if lst is not None and group in lst:
                lst.remove(group)
                if not lst:
                    del self._by_key[k]
        if not group.followers and self._by_leader.get(group.leader) is group:
            del self._by_leader[group.leader]

    def _release(self, f: _Follower, pin: str | None) -> None:
        self._detach(f)
        f.held.pin = pin
        self._ready.append(f.held)

    def _detach(self, f: _Follower) -> None:
        f.gone = True
        del self._followers[f.held.req.request_id]
        g = f.group
        g.followers.remove(f)
        g.tokens -= f.tokens
        if not g.followers and g.worker is not None:
            groups = self._by_worker.get(g.worker)
            if groups is not None and g in groups:
                groups.remove(g)
                if not groups:
                    del self._by_worker[g.worker]
        if not g.followers and not g.open and self._by_leader.get(g.leader) is g:
            del self._by_leader[g.leader]

    def _timer(self, due: float, kind: str, ref: object) -> None:
        heapq.heappush(self._timers, (due, next(self._seq), kind, ref))


def _idle(w: WorkerState) -> bool:
    return not w.load.running and not w.load.waiting
