"""Routing policies: small strategy classes chosen by name (``make_policy``).

A policy sees the scored candidates (already filtered of busy workers by the router) and returns the
index of its choice and a one-line reason, as a format string and its arguments (a :class:`Reason`):
the decision formats it only when read. Scores are computed for every policy so each decision can
be explained and the predicted hit rate measured, whatever the policy. Over a maintained fleet view,
kv_aware is handed only the workers that can win (``router/selection.py``): it must choose as it
would among all of them, so a new rule here must keep ``selection.py``'s bound true.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Protocol

from thunderagent.config import Policy, RoutingConfig
from thunderagent.router.balance import RecentRequests
from thunderagent.router.cost import load_key, queued_prefill
from thunderagent.decision import CandidateScore
from thunderagent.types import WorkerState

#: a one-line reason: ``str.format`` text and its arguments (no arguments: the text as it is)
Reason = tuple[str, tuple[object, ...]]

#: costs closer than this (relative) are ties: the engine's pass time cannot tell them apart.
TIE_RELATIVE = 1e-6


class Candidate:
    """A worker with its score and the size of its indexed cache (for tie-breaks)."""

    __slots__ = ("worker", "score", "footprint")

    def __init__(self, worker: WorkerState, score: CandidateScore, footprint: int) -> None:
        self.worker = worker
        self.score = score
        self.footprint = footprint


class RoutingPolicy(Protocol):
    name: str

    def choose(
        self, cands: Sequence[Candidate], rng: random.Random, num_tokens: int, now: float
    ) -> tuple[int, Reason]: ...


class KvAware:
    """Lowest cost, with misses balanced by recent traffic.

    * **Miss** (the best and worst overlap differ by less than ``miss_overlap_fraction`` of the
      prompt, so the cache cannot tell workers apart): among workers that can start the prompt
      within one pass (queued prefill below ``max_num_batched_tokens``), the one sent the least
      prefill work lately (decayed uncached prompt tokens, see ``balance.py``), then the smallest
      cache footprint. A miss
      usually opens a conversation whose next turns stick where it lands: spreading misses by recent
      traffic spreads conversations, where the instantaneous queue between two turns is noise.
    * **Otherwise** temperature 0: argmin of cost; ties go to the smallest cache footprint (evicts
      least, as SGLang's cache-aware router does), then at random. Temperature > 0: softmax among
      the near-ties only (cost within ``tie_margin`` of the best, in the cost's unit: prefill-token
      equivalents), over their costs normalised to [0, 1]; a lone best is taken as at temperature 0.
    """

    name = "kv_aware"

    def __init__(self, temperature: float, miss_overlap_fraction: float, half_life: float,
                 tie_margin: float) -> None:
        self.temperature = temperature
        self.tie_margin = tie_margin
        self.miss_fraction = miss_overlap_fraction
        self.recent = RecentRequests(half_life)

    def choose(
        self, cands: Sequence[Candidate], rng: random.Random, num_tokens: int, now: float
    ) -> tuple[int, Reason]:
        i, reason = self._choose(cands, rng, num_tokens, now)
        self.record(cands[i], num_tokens, now)
        return i, reason

    def window(self, lo: float) -> float:
        """Costs up to ``lo + window(lo)`` can be chosen when the best is ``lo`` (ties, and with a
        temperature the near-ties): the router must score every worker that low."""
        tol = TIE_RELATIVE * max(1.0, abs(lo))
        return max(tol, self.tie_margin) if self.temperature > 0 else tol

    def record(self, c: Candidate, num_tokens: int, now: float) -> None:
        """``c`` gets the request (chosen here, or by a hot prefix's replica steering)."""
        # Recent traffic counts the prompt tokens the winner must prefill (and store): that is the
        # work and the cache churn a new conversation brings, whatever its number of requests.
        fresh = num_tokens - min(num_tokens, c.score.overlap_blocks * c.worker.block_size)
        self.recent.add(c.worker.worker_id, now, max(1, fresh))

    def _choose(
        self, cands: Sequence[Candidate], rng: random.Random, num_tokens: int, now: float
    ) -> tuple[int, Reason]:
        # Plain loops rather than min()/max() over lists: compiled, those are generic calls (this runs once per
        # request over every candidate).
        lo_cached = hi_cached = cands[0].score.overlap_blocks * cands[0].worker.block_size
        for c in cands:
            cached = c.score.overlap_blocks * c.worker.block_size
            if cached > hi_cached:
                hi_cached = cached
            elif cached < lo_cached:
                lo_cached = cached
        if hi_cached - lo_cached <= self.miss_fraction * num_tokens:
            ready = [i for i, c in enumerate(cands) if queued_prefill(c.worker) < c.worker.max_num_batched_tokens]
            if ready:
                rates = [self.recent.rate(cands[i].worker.worker_id, now) for i in ready]
                low = rates[0]
                for r in rates:
                    if r < low:
                        low = r
                tied = [i for i, r in zip(ready, rates) if r - low < 1e-9]
                tied = _smallest_footprint(cands, tied)
                i = tied[0] if len(tied) == 1 else rng.choice(tied)
                return i, ("cache miss everywhere: least recent prefill traffic ({:.0f} tokens) among workers "
                           "ready within a pass", (rates[ready.index(i)],))
        costs = [c.score.cost for c in cands]
        lo = costs[0]
        for cost in costs:
            if cost < lo:
                lo = cost
        tol = TIE_RELATIVE * max(1.0, abs(lo))
        if self.temperature > 0 and self.tie_margin > tol:
            # Near-ties only: a worker far above the best is never sampled, whatever the fleet's size
            # (a softmax over the whole fleet gave 1,000 bad workers 1,000 lottery tickets).
            near = [i for i, c in enumerate(costs) if c - lo <= self.tie_margin]
            span = max(costs[i] for i in near) - lo
            if span > 0:
                weights = [math.exp(-((costs[i] - lo) / span) / self.temperature) for i in near]
                i = near[rng.choices(range(len(near)), weights=weights)[0]]
                return i, ("softmax(T={}) among {} near-ties, cost {:.1f} (min {:.1f})",
                           (self.temperature, len(near), costs[i], lo))
        tied = [i for i, c in enumerate(costs) if c - lo <= tol]
        if len(tied) == 1:
            return tied[0], _why_lowest(cands[tied[0]].score)
        tied = _smallest_footprint(cands, tied)
        i = tied[0] if len(tied) == 1 else rng.choice(tied)
        return i, ("lowest cost {:.1f}, tie among workers broken by smallest cache then random", (lo,))


def _smallest_footprint(cands: Sequence[Candidate], tied: list[int]) -> list[int]:
    """Of the ``tied`` positions, those whose worker holds the smallest indexed cache."""
    small = cands[tied[0]].footprint
    for i in tied:  # (a loop: compiled, ``min`` over a generator is a generic call)
        if cands[i].footprint < small:
            small = cands[i].footprint
    return [i for i in tied if cands[i].footprint == small]


def _why_lowest(s: CandidateScore) -> Reason:
    if s.overlap_blocks:
        return ("lowest cost {:.1f}: {} cached blocks, {} queued prefill tokens",
                (s.cost, s.overlap_blocks, s.queued_prefill_tokens))
    return "lowest cost {:.1f}: no cached prefix, least backlog", (s.cost,)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, cands: Sequence[Candidate], rng: random.Random, num_tokens: int, now: float
    ) -> tuple[int, Reason]:
        # Rotate over worker ids, not list positions, so a worker leaving does not skew the cycle.
        ids = sorted(c.worker.worker_id for c in cands)
        wid = ids[self._next % len(ids)]
        self._next += 1
        i = next(k for k, c in enumerate(cands) if c.worker.worker_id == wid)
        return i, ("round robin", ())


class RandomChoice:
    name = "random"

    def choose(
        self, cands: Sequence[Candidate], rng: random.Random, num_tokens: int, now: float
    ) -> tuple[int, Reason]:
        return rng.randrange(len(cands)), ("uniform random", ())


class LeastLoaded:
    name = "least_loaded"

    def choose(
        self, cands: Sequence[Candidate], rng: random.Random, num_tokens: int, now: float
    ) -> tuple[int, Reason]:
        keys = [load_key(c.worker) for c in cands]
        lo = min(keys)
        tied = [i for i, k in enumerate(keys) if k == lo]
        return rng.choice(tied), ("least loaded ({} requests, {} queued prefill tokens)", (lo[0], lo[1]))


class PowerOfTwo:
    name = "power_of_two"

    def choose(
        self, cands: Sequence[Candidate], rng: random.Random, num_tokens: int, now: float
    ) -> tuple[int, Reason]:
        if len(cands) == 1:
            return 0, ("only candidate", ())
        a, b = rng.sample(range(len(cands)), 2)
        i = a if load_key(cands[a].worker) <= load_key(cands[b].worker) else b
        other = cands[b if i == a else a].worker.worker_id
        return i, ("less loaded of two sampled (vs {})", (other,))


def make_policy(cfg: RoutingConfig, name: Policy | None = None) -> RoutingPolicy:
    policy = name or cfg.policy
    if policy is Policy.kv_aware:
        return KvAware(cfg.temperature, cfg.miss_overlap_fraction, cfg.balance_half_life, cfg.tie_margin)
    if policy is Policy.round_robin:
        return RoundRobin()
    if policy is Policy.random:
        return RandomChoice()
    if policy is Policy.least_loaded:
        return LeastLoaded()
    if policy is Policy.power_of_two:
        return PowerOfTwo()
    raise ValueError(f"unknown routing policy {policy!r}")
