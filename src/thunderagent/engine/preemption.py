"""Preemption when it pays (``routing.preempt_enabled``): may a waiting request that cannot be admitted
evict running requests of lower priority?

The decision (:func:`decide`) is pure arithmetic on plain records, so its numbers can be pinned by
tests; :class:`PriorityPreemption` reads the simulated engine's state into those records.

Both sides are in seconds of the waiting request's time to first token:

- **gain** = how long the waiting request would otherwise wait (``wait_s``: until enough running
  requests finish on their own to make room for it, at their longest, ``max_tokens``) times
  ``tier_weight`` per priority level it is above the victims (the smallest difference counts);
- **cost** = the prefill time to recompute every victim's KV (recompute semantics, as vLLM's
  preemption: the victim goes back to the waiting queue and computes its prompt and the tokens it
  generated again), plus ``memory_cost_s`` times the share of the KV pool the victims hold (evicting
  a large context throws away more cache and needs that much room again to resume).

It preempts only when gain > cost. Victims are taken lowest priority first and, within a priority,
latest admitted first (vLLM's order); equal or higher priorities are never victims, so two requests
of one priority never preempt each other, and a victim (lower priority) can never preempt back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from thunderagent.config import RoutingConfig
from thunderagent.engine.blocks import BlockManager
from thunderagent.engine.sim_state import _Seq
from thunderagent.engine.timing import TimingModel


@dataclass(frozen=True, slots=True)
class PreemptKnobs:
    """The cost knobs of ``routing`` (``preempt_tier_weight``, ``preempt_memory_cost_s``)."""

    tier_weight: float = 1.0
    memory_cost_s: float = 0.5


def knobs_from(routing: RoutingConfig) -> PreemptKnobs | None:
    """The engines' preemption knobs; None when ``routing.preempt_enabled`` is off."""
    if not routing.preempt_enabled:
        return None
    return PreemptKnobs(routing.preempt_tier_weight, routing.preempt_memory_cost_s)


@dataclass(frozen=True, slots=True)
class RunningView:
    """What the decision needs of one running request."""

    priority: int
    remaining_tokens: int  # decode passes until it finishes at the latest (max_tokens - generated)
    computed_tokens: int  # tokens whose KV it holds: recomputed if evicted
    blocks: int  # KV blocks evicting it would free for the waiting request


@dataclass(frozen=True, slots=True)
class Verdict:
    victims: tuple[int, ...]  # indices into the running list, in eviction order
    wait_s: float  # the waiting request's wait without preemption
    gain_s: float
    cost_s: float

    @property
    def pays(self) -> bool:
        return self.gain_s > self.cost_s


def natural_wait_s(running: Sequence[RunningView], deficit_blocks: int, pass_s: float) -> float:
    """Time until requests finishing on their own free ``deficit_blocks`` blocks (the first one to
    finish frees a sequence slot): one token per pass each, so they finish in order of remaining tokens."""
    freed = 0
    remaining = 0
    for r in sorted(running, key=lambda r: r.remaining_tokens):
        freed += r.blocks
        remaining = r.remaining_tokens
        if freed >= deficit_blocks:
            break
    return remaining * pass_s


def pick_victims(priority: int, running: Sequence[RunningView], deficit_blocks: int) -> tuple[int, ...] | None:
    """The fewest lowest-priority running requests (from the tail of the priority-ordered running
    list) whose eviction frees ``deficit_blocks`` blocks (one victim at least: it frees a sequence
    slot); None when the lower-priority ones cannot."""
    victims: list[int] = []
    freed = 0
    for i in range(len(running) - 1, -1, -1):
        if running[i].priority >= priority:
            break  # the running list is ordered by priority: nothing lower further up
        victims.append(i)
        freed += running[i].blocks
        if freed >= deficit_blocks:
            return tuple(victims)
    return None


def decide(priority: int, running: Sequence[RunningView], deficit_blocks: int, need_slot: bool, *,
           pass_s: float, prefill_s: Callable[[int], float], pool_blocks: int,
           knobs: PreemptKnobs) -> Verdict | None:
    """Whether a waiting request of ``priority``, short of ``deficit_blocks`` KV blocks (and of a
    sequence slot when ``need_slot``), should evict running requests; None when no lower-priority
    request can make room. ``running`` is in the engine's order (priority descending, admission
    order within); ``pass_s`` is a decode pass's time, ``prefill_s(n)`` the time to prefill n tokens."""
    if deficit_blocks <= 0 and not need_slot:
        return None  # it fits: nothing to decide
    victims = pick_victims(priority, running, deficit_blocks)
    if victims is None:
        return None
    wait_s = natural_wait_s(running, deficit_blocks, pass_s)
    levels = priority - max(running[i].priority for i in victims)
    gain_s = wait_s * knobs.tier_weight * levels
    held = sum(running[i].blocks for i in victims)
    cost_s = sum(prefill_s(running[i].computed_tokens) for i in victims) + knobs.memory_cost_s * held / pool_blocks
    return Verdict(victims, wait_s, gain_s, cost_s)


class PriorityPreemption:
    """The simulated engine's side: its state as :class:`RunningView` records, its timing model for
    the two times the decision needs."""

    __slots__ = ("knobs", "_timing", "_total_kv", "_budget")

    def __init__(self, knobs: PreemptKnobs, timing: TimingModel, total_kv_tokens: int, token_budget: int) -> None:
        self.knobs = knobs
        self._timing = timing
        self._total_kv = total_kv_tokens
        self._budget = token_budget

    def prefill_s(self, tokens: int) -> float:
        """Prefill time of ``tokens`` alone, in passes of at most the token budget (chunked)."""
        full, rest = divmod(tokens, self._budget)
        t = self._timing.pass_time
        return full * t(self._budget, 0, self._total_kv, False) + (t(rest, 0, self._total_kv, False) if rest else 0.0)

    def victims(self, head: _Seq, running: list[_Seq], bm: BlockManager, hits: int, deficit: int,
                need_slot: bool, decode_kv_tokens: int) -> list[_Seq]:
        """The running requests to evict so that ``head`` (the waiting queue's first, whose first
        ``hits`` blocks are cached) can be admitted; empty when it does not pay."""
        pr = head.req.priority
        if not running or running[-1].req.priority >= pr:
            return []  # cheap exit, the common case: nothing of lower priority runs
        # Blocks of the head's cached prefix stay out of the count: freeing one makes it free but
        # also no longer an active hit, so the head's shortfall does not shrink.
        own = set(head.hashes[:hits])
        views = [RunningView(s.req.priority, max(s.req.max_tokens - s.generated, 0), s.computed,
                             _freed(s, bm, own) if s.req.priority < pr else len(s.table)) for s in running]
        # A decode pass at the current decode load: mixed passes (prefill chunks too) are longer, so
        # this underestimates the wait, and errs towards not preempting.
        pass_s = self._timing.pass_time(0, decode_kv_tokens, self._total_kv, True)
        v = decide(pr, views, deficit, need_slot, pass_s=pass_s, prefill_s=self.prefill_s,
                   pool_blocks=bm.num_blocks, knobs=self.knobs)
        return [running[i] for i in v.victims] if v is not None and v.pays else []


def _freed(seq: _Seq, bm: BlockManager, keep: set[int]) -> int:
    """Blocks evicting ``seq`` frees: those no other running request holds, outside ``keep``'s hashes."""
    n = 0
    for b in seq.table:
        if bm.ref_count(b) == 1 and bm.block_hash(b) not in keep:
            n += 1
    return n
