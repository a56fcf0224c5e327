"""The holding queue: requests that no worker can start yet wait here, not in an engine's queue.

Pure and clock-free (``now`` is passed in). Which request goes next, when a worker frees up:

1. **deadline**: a request held ``max_wait_s`` or longer goes first (the oldest such), whatever its
   tier and size: nobody starves. With ``overdue_share`` below 1 overdue requests take only that
   share of the dispatches (one in every ``1 / share``, the others keep the order below): in a
   sustained overload every request becomes overdue, and "overdue first" would be plain FIFO, the
   order with the worst mean; a fixed share still drains the overdue ones at a bounded rate;
2. **strict priority tiers**: the highest ``priority`` with a request held;
3. **fairness across route keys** inside the tier: deficit round robin (as llm-d's flow control
   does): each key in turn earns ``drr_quantum_tokens`` of credit and spends it on its requests'
   uncached prompt tokens, so a tenant sending huge prompts cannot crowd out one sending small ones;
4. **short first with ageing** inside a key: the fewest uncached prompt tokens, less
   ``aging_tokens_per_s`` per second waited.

The queue is bounded in total and per route key, and in time: a request that would wait longer than
``max_queue_delay_s`` (the requests ahead of it times the measured drain gap) is refused at once, so
under sustained overload the excess gets 429 instead of a TTFT that grows with the backlog. "Ahead"
follows the order above (:meth:`HoldingQueue.ahead`): higher tiers, and in its own tier what deficit
round robin sends first, so one route key's backlog gets its own key's requests refused, not another
key's, which round robin would send within a round or two. With
``admit_ttft_factor`` (SLO-style admission) the time bound follows the fleet's own speed: a request
is held only while its predicted wait stays within (factor - 1) x the measured service TTFT (from
leaving this queue to the first token, fed by the driver through :meth:`HoldingQueue.observe_service`),
so an admitted request's TTFT stays within about factor x what a lightly loaded fleet gives. Past a
bound :meth:`HoldingQueue.push` raises :class:`QueueFull` with a ``retry_after`` computed from the
measured drain rate. A cancelled
request leaves at once (:meth:`HoldingQueue.cancel`). Work per pick is linear in the requests of one
key, bounded by the queue's size.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from thunderagent.config import SchedulerConfig
from thunderagent.types import EngineRequest

#: drain-rate smoothing: weight of the newest inter-dispatch gap
_RATE_ALPHA = 0.2
#: service-TTFT smoothing (``admit_ttft_factor``): weight of the newest dispatch-to-first-token time
_SERVICE_ALPHA = 0.1


class QueueFull(Exception):
    """The holding queue (or one route key's share of it) is full: the client retries later."""

    def __init__(self, message: str, retry_after: float, *, wait: bool = False, code: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.code = code  # the 429's error code
        #: refused for the wait it would have (``max_queue_delay_s``, ``admit_ttft_factor``): the
        #: fleet is overloaded, as opposed to a count bound (memory) or one route key's quota
        self.wait = wait


@dataclass(slots=True, eq=False)
class Held:
    req: EngineRequest
    key: str  # route key (tenant / business line)
    tier: int  # priority: higher goes first
    enqueued: float
    uncached: int  # uncached prompt tokens, estimated from the index at enqueue
    program: str | None = None  # the agent program it belongs to
    pin: str | None = None  # the worker it must go to while routable (a released follower: its leader's)
    gone: bool = field(default=False, repr=False)  # dispatched or cancelled (lazy heap deletion)
    pops_at_push: int = field(default=0, repr=False)  # the queue's dispatch count when pushed (admission's calibration)
    #: a later step of an agent program already served: with ``hold_admitted_programs`` the wait
    #: bounds do not refuse it (the count bounds still do)
    admitted: bool = False
    #: the workers (``KvIndex.bit_of`` bits) holding its longest cached prefix at enqueue; 0: none held any block.
    #: Cache affinity looks for candidates among the requests a free worker holds, or no worker does.
    holders: int = field(default=0, repr=False)

    def cached_on(self, free: int) -> bool:
        """Served from cache by one of ``free`` (a mask of ``bit_of`` bits) as far as enqueue knew, or held nowhere
        (any worker computes it all alike): what cache affinity's candidates are drawn from."""
        return not self.holders or bool(self.holders & free)


class _Key:
    # Short first with ageing ranks by ``uncached - age * (now - enqueued)``, which orders requests
    # exactly as ``uncached + age * enqueued`` does whatever ``now`` is: a heap on that keeps a key's
    # best request at hand in O(log n) (entries of gone requests are skipped lazily).
    __slots__ = ("heap", "n", "tokens", "deficit", "visiting")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Held]] = []
        self.n = 0  # live requests
        self.tokens = 0  # what they cost in deficit round robin (uncached prompt tokens, at least 1 each)
        self.deficit = 0.0
        self.visiting = False  # at the head of the rotation, this round's quantum already earned


class _Tier:
    __slots__ = ("keys", "order", "n", "tokens")

    def __init__(self) -> None:
        self.keys: dict[str, _Key] = {}
        self.order: deque[str] = deque()  # round-robin order of keys with requests
        self.n = 0  # live requests
        self.tokens = 0  # and their cost, as _Key.tokens


class HoldingQueue:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self._tiers: dict[int, _Tier] = {}
        self._by_id: dict[str, Held] = {}
        self._per_key: dict[str, int] = {}
        self._seq = itertools.count()
        self._gap = 0.0  # smoothed seconds between dispatches from the queue (0: not measured yet)
        self._last_pop: float | None = None
        self._since_overdue = 0.0  # dispatches (weighted by overdue_share) since an overdue one went
        self._service = 0.0  # smoothed seconds from dispatch to first token (0: not measured yet)
        self._per_dispatch = 0.0  # smoothed seconds a held request waited per dispatch while held (its own included)
        self._pops = 0  # dispatches from the queue so far

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def by_tier(self) -> dict[int, int]:
        return {t: sum(k.n for k in tier.keys.values()) for t, tier in self._tiers.items()}

    def oldest_wait(self, now: float) -> float:
        oldest = next(iter(self._by_id.values()), None)
        return 0.0 if oldest is None else now - oldest.enqueued

    # -- in ------------------------------------------------------------------------------------
    def push(self, held: Held, now: float) -> None:
        cfg = self.cfg
        if len(self._by_id) >= cfg.max_queued:
            raise QueueFull(f"the scheduler holds {len(self._by_id)} requests (scheduler.max_queued)",
                            self.retry_after(now))
        if self._per_key.get(held.key, 0) >= cfg.max_queued_per_key:
            raise QueueFull(f"route key {held.key!r} has {cfg.max_queued_per_key} requests waiting "
                            "(scheduler.max_queued_per_key)", self.retry_after(now, held.key))
        if not (held.admitted and cfg.hold_admitted_programs):  # a program's later step: only the counts bound it
            ahead = self.ahead(held)
            wait = ahead * self._gap
            if cfg.max_queue_delay_s is not None and wait > cfg.max_queue_delay_s:
                raise QueueFull(f"a new request would wait about {wait:.2f}s here, over scheduler.max_queue_delay_s "
                                f"({cfg.max_queue_delay_s}s)", self.retry_after(now), wait=True)
            bound = self.admit_bound()
            if bound is not None:
                # The drain gap is a mean over busy periods' dispatches: when engines free their slots in
                # waves (requests of one shape end together) a request held just after a wave waits for
                # the next one, far longer than that mean says, and a request held alone measures no gap
                # at all. What held requests really waited per dispatch calibrates it.
                slo_wait = ahead * max(self._gap, self._per_dispatch)
                if slo_wait > bound:
                    raise QueueFull(f"a new request would wait about {slo_wait:.3f}s here, over "
                                    f"(scheduler.admit_ttft_factor - 1) x the measured service TTFT ({bound:.3f}s)",
                                    self.retry_after(now), wait=True)
        held.pops_at_push = self._pops
        if not self._by_id:
            self._last_pop = None  # a busy period starts: the idle time before it is no drain gap
        tier = self._tiers.get(held.tier)
        if tier is None:
            tier = self._tiers[held.tier] = _Tier()
        key = tier.keys.get(held.key)
        if key is None:
            key = tier.keys[held.key] = _Key()
            tier.order.append(held.key)
        heapq.heappush(key.heap, (self.rank(held, held.uncached), next(self._seq), held))
        key.n += 1
        tier.n += 1
        cost = max(1, held.uncached)
        key.tokens += cost
        tier.tokens += cost
        self._by_id[held.req.request_id] = held
        self._per_key[held.key] = self._per_key.get(held.key, 0) + 1

    def ahead(self, held: Held) -> int:
        """Dispatches until ``held``, pushed now, would go (itself included), as the wait bounds count
        them: every request of a higher tier; of its own tier, its key's requests held, and what the
        other keys send meanwhile under deficit round robin. Its key needs ``r`` rounds (its held
        requests' cost and its own, over the quantum); in ``r`` rounds each other key sends up to
        ``r`` quanta of cost, counted in requests at the tier's mean cost per request of the others.
        So one key's backlog refuses another key's request only for the part of it that round robin
        sends first (with one key: the whole queue, as before). O(tiers held)."""
        higher, tier = 0, None
        for t, tr in self._tiers.items():
            if t > held.tier:
                higher += tr.n
            elif t == held.tier:
                tier = tr
        if tier is None:
            return higher + 1
        own = tier.keys.get(held.key)
        n_own, cost_own = (own.n, own.tokens) if own is not None else (0, 0)
        others, keys = tier.n - n_own, len(tier.order) - (own is not None)
        if not others:
            return higher + n_own + 1
        quantum = self.cfg.drr_quantum_tokens
        rounds = -(-(cost_own + max(1, held.uncached)) // quantum)  # ceil
        sent = -(-rounds * quantum * keys * others // (tier.tokens - cost_own))  # ceil: requests of the others
        return higher + n_own + 1 + min(others, sent)

    def admit_bound(self) -> float | None:
        """Seconds a new request may be predicted to wait here under ``admit_ttft_factor``: (factor - 1)
        x the smoothed service TTFT, at least ``admit_min_wait_s``; None while off or not measured yet."""
        f = self.cfg.admit_ttft_factor
        if f is None or self._service <= 0:
            return None
        return max(self.cfg.admit_min_wait_s, (f - 1) * self._service)

    def observe_service(self, seconds: float) -> None:
        """A dispatched request's first token came ``seconds`` after it left this queue (or after it
        was routed at once): routing, the engine's start and its prefill. ``admit_ttft_factor``'s
        measure."""
        s = max(0.0, seconds)
        self._service = s if self._service <= 0 else (1 - _SERVICE_ALPHA) * self._service + _SERVICE_ALPHA * s

    def retry_after(self, now: float, key: str | None = None) -> float:
        """Seconds until the queue (or ``key``'s share) has drained enough to take one more request,
        from the measured dispatch rate; 1 s until a rate is known, at most 60 s."""
        ahead = self._per_key.get(key, 0) if key is not None else len(self._by_id)
        if self._gap <= 0:
            return 1.0
        return min(60.0, max(1.0, math.ceil(ahead * self._gap)))

    def cancel(self, request_id: str) -> bool:
        held = self._by_id.get(request_id)
        if held is None:
            return False
        self._remove(held)
        return True

    # -- out -----------------------------------------------------------------------------------
    def peek_overdue(self, now: float) -> Held | None:
        """The oldest request held ``max_wait_s`` or longer, if any."""
        # _by_id keeps push order and pushes come with a non-decreasing clock: its first entry is the
        # oldest (O(1) instead of a scan per pick)
        oldest = next(iter(self._by_id.values()), None)
        return oldest if oldest is not None and now - oldest.enqueued >= self.cfg.max_wait_s else None

    def next(self, now: float) -> Held | None:
        """The request that goes next (not removed: :meth:`take` removes it once it is placed)."""
        if not self._by_id:
            return None
        overdue = self.peek_overdue(now)
        if overdue is not None and self._overdue_turn():
            return overdue
        tier = self._tiers[max(t for t, tier in self._tiers.items() if tier.order)]
        return self._drr_pick(tier, now)

    def candidates(self, held: Held, k: int, free: int = -1) -> list[Held]:
        """``held`` (what :meth:`next` returned, not overdue: its key's best) and the requests that follow it in its
        key's order, ``k`` at most, best first: what the dispatcher re-ranks by cache affinity. With ``free`` (a mask
        of the workers that can start a request now) only requests held by one of them at enqueue, or by none
        (:attr:`Held.holders`), count: one whose cache sits on full workers only would recompute it, and looking
        past it finds one that would not (at most ``4 k`` live entries are looked at). O(k log n): the live entries
        are popped and pushed back (the gone ones met on the way are dropped, as :meth:`_best` does)."""
        heap = self._tiers[held.tier].keys[held.key].heap
        live: list[tuple[float, int, Held]] = []
        out: list[Held] = []
        while heap and len(out) < k and len(live) < 4 * k:
            e = heapq.heappop(heap)
            h = e[2]
            if not h.gone:
                live.append(e)
                if h is held or h.cached_on(free):
                    out.append(h)
        for e in live:
            heapq.heappush(heap, e)
        return out

    def peers(self, held: Held, k: int, now: float, free: int = -1) -> list[Held]:
        """The best requests of up to ``k`` other route keys of ``held``'s tier that may go out of their turn: a
        key's deficit less its best request's cost stays at or above minus one quantum (``drr_quantum_tokens``),
        so a key is at most one quantum in debt (:meth:`take` with ``borrow``) and the rotation still finds a
        key that can pay within a round or two. At most ``4 k`` keys are looked at (bounded work per pick). ``free``:
        as in :meth:`candidates`, a key whose best is held by full workers only offers none."""
        tier = self._tiers[held.tier]
        floor = -float(self.cfg.drr_quantum_tokens)
        out: list[Held] = []
        for name in itertools.islice(tier.order, 4 * k):
            if len(out) >= k:
                break
            if name == held.key:
                continue
            key = tier.keys[name]
            best = self._best(key, now)
            if key.deficit - max(1, best.uncached) >= floor and best.cached_on(free):
                out.append(best)
        return out

    def rank(self, held: Held, uncached: float) -> float:
        """Where ``held`` would sit in its key's order with ``uncached`` tokens to prefill (short first with
        ageing: the heap's own key, comparable across requests whatever ``now`` is)."""
        return uncached + self.cfg.aging_tokens_per_s * held.enqueued

    def _overdue_turn(self) -> bool:
        """An overdue request's turn: always with ``overdue_share`` 1, else once ``1 / share - 1``
        others went since the last overdue one (``share`` is added per dispatch: exact in floats for
        the shares 1/2, 1/4 ...; 1 - 1e-9 absorbs rounding of the others)."""
        share = self.cfg.overdue_share
        return share >= 1.0 or self._since_overdue >= 1.0 - share - 1e-9

    def forced(self, held: Held, now: float) -> bool:
        """``held`` goes even if no worker can start it: it is overdue and it is an overdue request's
        turn (with ``overdue_share`` below 1, an overdue request picked by the normal order when all
        are overdue waits for the gate like any other: a sustained overload is not dumped into the
        engines' FIFO queues)."""
        return now - held.enqueued >= self.cfg.max_wait_s and self._overdue_turn()

    def take(self, held: Held, now: float, *, borrow: bool = False) -> None:
        """``held`` was dispatched: remove it, charge its key's deficit, measure the drain rate. ``borrow``: it went
        out of its key's turn (:meth:`peers`): the charge may take the deficit below 0, a debt its key's next
        rounds repay, so its share over time stays what deficit round robin gives."""
        tier = self._tiers[held.tier]
        key = tier.keys[held.key]
        left = key.deficit - max(1, held.uncached)
        key.deficit = left if borrow else max(0.0, left)
        share = self.cfg.overdue_share
        if share < 1.0:
            self._since_overdue = 0.0 if now - held.enqueued >= self.cfg.max_wait_s else self._since_overdue + share
        self._remove(held)
        per = (now - held.enqueued) / (self._pops - held.pops_at_push + 1)  # the dispatches it waited for
        a = _RATE_ALPHA
        self._per_dispatch = per if self._per_dispatch <= 0 else (1 - a) * self._per_dispatch + a * per
        self._pops += 1
        if self._last_pop is not None:
            gap = max(0.0, now - self._last_pop)
            self._gap = gap if self._gap <= 0 else (1 - _RATE_ALPHA) * self._gap + _RATE_ALPHA * gap
        self._last_pop = now

    def _drr_pick(self, tier: _Tier, now: float) -> Held:
        """Deficit round robin over the tier's keys: the key at the head of the rotation earns one
        quantum per visit and keeps the head while its credit pays for its best request."""
        quantum = self.cfg.drr_quantum_tokens
        order = tier.order
        if len(order) == 1:
            return self._best(tier.keys[order[0]], now)
        # Every full rotation adds a quantum to each key, so within ceil(max cost / quantum) + 1
        # rotations some key can pay: bounded work.
        while True:
            key = tier.keys[order[0]]
            if not key.visiting:
                key.visiting = True
                key.deficit += quantum
            best = self._best(key, now)
            if key.deficit >= max(1, best.uncached):
                return best
            key.visiting = False
            order.rotate(-1)

    @staticmethod
    def _best(key: _Key, now: float) -> Held:
        heap = key.heap
        while heap[0][2].gone:
            heapq.heappop(heap)
        return heap[0][2]

    def _remove(self, held: Held) -> None:
        del self._by_id[held.req.request_id]
        n = self._per_key[held.key] - 1
        if n:
            self._per_key[held.key] = n
        else:
            del self._per_key[held.key]
        held.gone = True
        tier = self._tiers[held.tier]
        key = tier.keys[held.key]
        cost = max(1, held.uncached)
        tier.n -= 1
        tier.tokens -= cost
        key.n -= 1
        key.tokens -= cost
        if not key.n:
            del tier.keys[held.key]
            tier.order.remove(held.key)
            if not tier.order:
                del self._tiers[held.tier]
