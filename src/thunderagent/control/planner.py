"""The step-wise scaling planner (seed 004 §3.2: add one node at a time, watch for a minute or two,
then decide): +1 / -1 / hold per worker role, with its reasons.

Pure and clock-injected: a driver (the live fleet's ``control/planner_hook.py``, the simulator's
``sim/scaling.py``) hands it a :class:`WorkerSample` per worker every ``interval_s`` (:meth:`Planner.observe`)
and asks for a :class:`Recommendation` per role (:meth:`Planner.recommend`). What it reads, per role,
over the last ``window_s`` (never reaching back past the role's last step or worker-count change):

- **queue depth**: waiting requests per worker (mean of the samples);
- **wait time**: mean time to first token of the requests whose first token came in the window (the
  scheduler's queue wait is part of it), from the workers' cumulative TTFT sums and counts;
- **hit rate**: requests routed to a worker holding part of their prompt / requests routed;
- **KV water level**: mean KV use (active blocks / total) of the role's workers.

Rules, in order (the first that applies gives the answer):

1. a step decided and not yet seen (the role's worker count has not changed) stays the answer for
   ``cooldown_s``: it is *pending*, and the actor acts once, on the look that decided it (``fresh``);
2. for ``cooldown_s`` after a step or a change of the role's worker count: hold (watching);
3. while a worker that joined after the planner's first look is **cold** (served fewer than
   ``warm_requests`` requests and its hit rate below its role's, for at most ``max_cold_s``): hold;
4. fewer than ``window_s / 2`` seconds of samples since the last change: hold (not enough seen);
5. +1 when any of queue depth >= ``up_queue_per_worker``, TTFT >= ``up_ttft_s``, KV use >=
   ``up_kv_usage`` (held at ``max_workers``);
6. -1 when all of queue depth and KV use, spread over one worker fewer, stay at or below
   ``down_queue_per_worker`` / ``down_kv_usage`` and TTFT at or below ``down_ttft_s`` (held at
   ``min_workers``);
7. else hold.

The workers present at the first look count as warm: the planner cannot know their history.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from thunderagent.config.planner import PlannerConfig

__all__ = ["Planner", "Recommendation", "RoleSignals", "WorkerSample"]


@dataclass(slots=True, frozen=True)
class WorkerSample:
    """One worker at one look. The four counters are cumulative since the worker joined (the
    planner takes differences, so any monotone source works: Prometheus counters, a simulator's)."""

    worker_id: str
    role: str  # prefill / decode / both
    waiting: int
    running: int
    kv_usage: float
    routed: int = 0  # requests routed to it
    hits: int = 0  # of them, routed to it while it held part of their prompt
    ttft_count: int = 0  # first tokens it produced
    ttft_sum: float = 0.0  # their times to first token, seconds


@dataclass(slots=True, frozen=True)
class RoleSignals:
    """What the planner saw of one role over its window."""

    workers: int
    cold: tuple[str, ...]  # workers still warming up
    queue_per_worker: float  # mean waiting requests per worker
    ttft_s: float | None  # mean time to first token (None: no first token in the window)
    hit_rate: float | None  # hits / routed (None: nothing routed in the window)
    kv_usage: float  # mean KV use of its workers
    span_s: float  # seconds the samples cover


@dataclass(slots=True, frozen=True)
class Recommendation:
    role: str
    delta: int  # +1 add a worker, -1 remove one, 0 hold
    reasons: tuple[str, ...]
    signals: RoleSignals
    at: float  # when it was made
    fresh: bool = False  # the step was decided on this look (act on it now, once)
    decided_at: float | None = None  # when the step in force was decided


@dataclass(slots=True, frozen=True)
class _Step:
    delta: int
    at: float
    workers: int  # the role's worker count when it was decided
    reasons: tuple[str, ...]


@dataclass(slots=True)
class _Joined:
    at: float
    routed: int  # its counters when it joined
    hits: int
    served: int


@dataclass(slots=True, frozen=True)
class _Snap:
    t: float
    workers: dict[str, WorkerSample]


class Planner:
    def __init__(self, cfg: PlannerConfig) -> None:
        self.cfg = cfg
        self._snaps: deque[_Snap] = deque()
        self._joined: dict[str, _Joined] = {}  # workers that joined after the first look (cold candidates)
        self._changed: dict[str, float] = {}  # role -> when its worker count last changed
        self._steps: dict[str, _Step] = {}  # role -> the latest step decided
        self.latest: dict[str, Recommendation] = {}  # role -> the latest recommendation

    def observe(self, now: float, samples: Sequence[WorkerSample]) -> None:
        """One look at the fleet: every routable worker's sample."""
        cur = {s.worker_id: s for s in samples}
        if self._snaps:
            prev = self._snaps[-1].workers
            for wid, s in cur.items():
                if wid not in prev:
                    self._joined[wid] = _Joined(now, s.routed, s.hits, s.ttft_count)
            for wid in [w for w in self._joined if w not in cur]:
                del self._joined[wid]
            for role in {s.role for s in samples} | {s.role for s in prev.values()}:
                if _count(cur, role) != _count(prev, role):
                    self._changed[role] = now
        self._snaps.append(_Snap(now, cur))
        horizon = now - self.cfg.window_s
        while len(self._snaps) > 1 and self._snaps[1].t <= horizon:
            self._snaps.popleft()

    def recommend(self, now: float) -> dict[str, Recommendation]:
        """A recommendation per role present at the latest look (also kept in :attr:`latest`)."""
        if not self._snaps:
            return {}
        roles = sorted({s.role for s in self._snaps[-1].workers.values()})
        self.latest = {role: self._role(role, now) for role in roles}
        return self.latest

    # -- one role ------------------------------------------------------------------------------
    def _role(self, role: str, now: float) -> Recommendation:
        cfg = self.cfg
        step = self._steps.get(role)
        changed = self._changed.get(role, -math.inf)
        since = max(changed, step.at if step is not None else -math.inf)
        sig = self.signals(role, now, max(now - cfg.window_s, since))
        n = sig.workers

        def hold(*why: str) -> Recommendation:
            return Recommendation(role, 0, why, sig, now, decided_at=step.at if step is not None else None)

        if step is not None and step.delta and now - step.at < cfg.cooldown_s and changed < step.at:
            return Recommendation(role, step.delta, (f"pending: {step.delta:+d} decided at {step.at:.0f}s, still "
                                                     f"{n} workers", *step.reasons), sig, now, decided_at=step.at)
        if now - since < cfg.cooldown_s:
            what = "step" if step is not None and step.at >= changed else "worker count change"
            return hold(f"cooling down: {now - since:.0f}s of {cfg.cooldown_s:.0f}s since the last {what}")
        if sig.cold:
            return hold(f"cold: {', '.join(sig.cold)} still warming up (< {cfg.warm_requests} served, hit rate below "
                        f"the role's {_pct(sig.hit_rate)})")
        if sig.span_s < cfg.window_s / 2:
            return hold(f"watching: {sig.span_s:.0f}s of samples, {cfg.window_s / 2:.0f}s needed")
        up = self._up_reasons(sig)
        if up:
            if n >= cfg.max_workers:
                return hold(f"at max_workers ({cfg.max_workers})", *up)
            return self._decide(role, +1, up, sig, now)
        down = self._down_reasons(sig)
        if down is not None:
            if n <= cfg.min_workers:
                return hold(f"at min_workers ({cfg.min_workers})", *down)
            return self._decide(role, -1, down, sig, now)
        return hold(f"in range: {sig.queue_per_worker:.2f} waiting/worker, TTFT {_secs(sig.ttft_s)}, "
                    f"KV {sig.kv_usage:.0%}, hit rate {_pct(sig.hit_rate)}")

    def _decide(self, role: str, delta: int, why: tuple[str, ...], sig: RoleSignals, now: float) -> Recommendation:
        self._steps[role] = _Step(delta, now, sig.workers, why)
        return Recommendation(role, delta, why, sig, now, fresh=True, decided_at=now)

    def _up_reasons(self, sig: RoleSignals) -> tuple[str, ...]:
        cfg = self.cfg
        out = []
        if sig.queue_per_worker >= cfg.up_queue_per_worker:
            out.append(f"queue: {sig.queue_per_worker:.2f} waiting/worker >= {cfg.up_queue_per_worker:g}")
        if sig.ttft_s is not None and sig.ttft_s >= cfg.up_ttft_s:
            out.append(f"TTFT: mean {sig.ttft_s:.3f}s >= {cfg.up_ttft_s:g}s")
        if sig.kv_usage >= cfg.up_kv_usage:
            out.append(f"KV: {sig.kv_usage:.0%} used >= {cfg.up_kv_usage:.0%}")
        return tuple(out)

    def _down_reasons(self, sig: RoleSignals) -> tuple[str, ...] | None:
        """The reasons for -1 when every one holds, else None."""
        cfg = self.cfg
        n = sig.workers
        spread = n / (n - 1) if n > 1 else 1.0  # the same load on one worker fewer (one worker: min_workers holds)
        queue, kv = sig.queue_per_worker * spread if sig.queue_per_worker else 0.0, sig.kv_usage * spread
        if queue > cfg.down_queue_per_worker or kv > cfg.down_kv_usage:
            return None
        if sig.ttft_s is not None and sig.ttft_s > cfg.down_ttft_s:
            return None
        return (f"queue on {n - 1} workers: {queue:.2f} waiting/worker <= {cfg.down_queue_per_worker:g}",
                f"KV on {n - 1} workers: {kv:.0%} <= {cfg.down_kv_usage:.0%}",
                f"TTFT: mean {_secs(sig.ttft_s)} <= {cfg.down_ttft_s:g}s")

    def signals(self, role: str, now: float, start: float) -> RoleSignals:
        """The role's signals over the looks from ``start`` to ``now`` (at least the latest one)."""
        snaps = [s for s in self._snaps if s.t >= start] or [self._snaps[-1]]
        latest = {w: s for w, s in snaps[-1].workers.items() if s.role == role}
        n = len(latest)
        queue = kv = 0.0
        for snap in snaps:
            ws = [s for s in snap.workers.values() if s.role == role]
            if ws:
                queue += sum(s.waiting for s in ws) / len(ws)
                kv += sum(s.kv_usage for s in ws) / len(ws)
        routed = hits = count = 0
        ttft = 0.0
        for wid, s in latest.items():
            base = next(snap.workers[wid] for snap in snaps if wid in snap.workers)  # its first look in the window
            routed += s.routed - base.routed
            hits += s.hits - base.hits
            count += s.ttft_count - base.ttft_count
            ttft += s.ttft_sum - base.ttft_sum
        hit_rate = hits / routed if routed else None
        cold = tuple(sorted(w for w in latest if self._cold(latest[w], hit_rate, now)))
        return RoleSignals(n, cold, queue / len(snaps), ttft / count if count else None, hit_rate,
                           kv / len(snaps), snaps[-1].t - snaps[0].t)

    def _cold(self, s: WorkerSample, role_hit_rate: float | None, now: float) -> bool:
        j = self._joined.get(s.worker_id)
        if j is None or now - j.at >= self.cfg.max_cold_s or s.ttft_count - j.served >= self.cfg.warm_requests:
            return False
        routed = s.routed - j.routed
        return not (routed and role_hit_rate is not None and (s.hits - j.hits) / routed >= role_hit_rate)


def _count(workers: dict[str, WorkerSample], role: str) -> int:
    return sum(1 for s in workers.values() if s.role == role)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}s"
