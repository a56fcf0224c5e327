"""The step-wise scaling planner (seed 004 §3.2: add one node at a time, watch for a minute or two,
then decide): +1 / -1 / hold per worker role, with its reasons.

Pure and clock-injected: a driver (the live fleet's ``control/planner_hook.py``, the simulator's
``sim/scaling.py``) hands it a :class:`WorkerSample` per worker every ``interval_s`` (:meth:`Planner.observe`)
and asks for a :class:`Recommendation` per role (:meth:`Planner.recommend`). What it reads, per role,
over the last ``window_s`` (never reaching back past the role's last step or worker-count change):

- **queue depth**: waiting requests per worker (mean of the samples);
- **wait time**: time to first token of the requests whose first token came in the window (the
  scheduler's queue wait is part of it): their mean, from the workers' cumulative TTFT sums and counts,
  or with ``ttft_quantile`` that quantile, from the workers' cumulative TTFT histograms (linear within a
  bucket, as Prometheus' ``histogram_quantile``; the mean when a worker's histogram is missing);
- **hit rate**: requests routed to a worker holding part of their prompt / requests routed;
- **KV water level**: mean KV use (active blocks / total) of the role's workers.

Rules, in order (the first that applies gives the answer):

1. a step decided and not yet seen (the role's worker count has not changed) stays the answer for
   ``cooldown_s``: it is *pending*, and the actor acts once, on the look that decided it (``fresh``);
1b. +1 when (with ``target_utilization``) the **forecast** needs more workers than the role has (below
   ``max_workers``): it reads the traffic, not the fleet's TTFT, so rules 2-4 do not hold it;
2. for ``cooldown_s`` after a step or a change of the role's worker count: hold (watching);
3. while a worker that joined after the planner's first look is **cold** (served fewer than
   ``warm_requests`` requests and its hit rate below its role's, for at most ``max_cold_s``): hold;
4. fewer than ``window_s / 2`` seconds of samples since the last change: hold (not enough seen);
5. +1 when any of queue depth >= ``up_queue_per_worker``, TTFT >= ``up_ttft_s``, KV use >=
   ``up_kv_usage`` or the forecast needs more workers (held at ``max_workers``);
6. -1 when all of queue depth and KV use, spread over one worker fewer, stay at or below
   ``down_queue_per_worker`` / ``down_kv_usage``, TTFT at or below ``down_ttft_s`` and (with
   ``target_utilization``) one worker fewer still carries the larger of the current and the forecast
   arrival rate (held at ``min_workers``);
7. else hold.

The workers present at the first look count as warm: the planner cannot know their history.

The forecast (``target_utilization`` set; off by default) sizes the role ahead of its load instead of
waiting for TTFT to rise (Little's law: workers needed = arrival rate / what one worker serves):

- **arrival rate**: per look interval, a role's first tokens plus the growth of its waiting queues
  (requests that arrived, whether served yet or not), summed over the workers seen at both looks; it
  is a property of the traffic, not of the fleet, so its history (``trend_window_s``) is kept across
  steps. A weighted least-squares line through it gives the rate now and its slope, and the rate
  ``forecast_lead_s`` ahead (set it to the time a new worker takes to start);
- **service rate**: first tokens per worker-second over the intervals in which a worker had at least
  two requests waiting at both looks (it was busy throughout: what one worker serves at full load; one
  waiting request is often just an arrival between two engine passes, which biased the figure low), over the
  planner's whole history (a worker's capacity does not change with the load); until the role has
  been busy for ``window_s / 2`` worker-seconds, ``service_rate_per_worker`` (if set);
- workers needed = ceil(forecast rate / (``target_utilization`` x service rate)); unknown (no rule)
  until the service rate is known and the arrival history covers
  ``window_s / 2``; until it covers ``trend_window_s / 2`` the slope is taken as 0 (the level only: a
  fleet started under load is sized on its load before its trend is known).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from thunderagent.config.planner import PlannerConfig

__all__ = ["WORKER_TTFT_BUCKETS", "Forecast", "Planner", "Recommendation", "RoleSignals", "WorkerSample"]

#: the per-worker TTFT histogram's bounds (seconds; the live ``thunderagent_worker_ttft_seconds`` and the
#: simulator's): finer from 0.5 to 3 s, where TTFT objectives sit and ``ttft_quantile`` is read (linear
#: within a bucket: a 1-2.5 s bucket would put a 1.2 s p90 anywhere in it)
WORKER_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3,
                       5, 10, 30, 60)


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
    #: their histogram: (upper bound in seconds, cumulative count) per finite bucket, bounds ascending
    #: (the +Inf bucket is ``ttft_count``); () when the source has none (then only the mean is known)
    ttft_buckets: tuple[tuple[float, int], ...] = ()


@dataclass(slots=True, frozen=True)
class Forecast:
    """The role's arrival trend and the workers it needs (``target_utilization`` set)."""

    rate: float  # arrivals/s at the latest look (the trend line's value)
    slope: float  # its change, req/s per second
    ahead: float  # the trend line ``forecast_lead_s`` ahead (>= 0)
    service_rate: float | None  # first tokens per busy worker-second (None: not measured enough yet)
    needed: int | None  # workers for ``ahead`` at ``target_utilization`` (None: service rate unknown)
    needed_now: int | None  # workers for the larger of ``rate`` and ``ahead`` (the -1 check)


@dataclass(slots=True, frozen=True)
class RoleSignals:
    """What the planner saw of one role over its window."""

    workers: int
    cold: tuple[str, ...]  # workers still warming up
    queue_per_worker: float  # mean waiting requests per worker
    ttft_s: float | None  # time to first token, mean or quantile (None: no first token in the window)
    hit_rate: float | None  # hits / routed (None: nothing routed in the window)
    kv_usage: float  # mean KV use of its workers
    span_s: float  # seconds the samples cover
    forecast: Forecast | None = None  # None: forecast off, or too little arrival history yet
    ttft_stat: str = "mean"  # what ttft_s is: "mean", or the quantile read ("p90")


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
        # forecast inputs, per role: (interval start, end, arrivals) over trend_window_s; [first tokens,
        # worker-seconds] of the intervals in which a worker stayed busy (its service rate)
        self._arrivals: dict[str, deque[tuple[float, float, int]]] = {}
        self._busy: dict[str, list[float]] = {}
        self._needs: dict[str, deque[tuple[float, int]]] = {}  # role -> (look, forecast.needed_now) over window_s

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
            if self.cfg.target_utilization is not None:
                self._observe_load(self._snaps[-1].t, now, prev, cur)
        self._snaps.append(_Snap(now, cur))
        horizon = now - self.cfg.window_s
        while len(self._snaps) > 1 and self._snaps[1].t <= horizon:
            self._snaps.popleft()

    def _observe_load(self, t0: float, now: float, prev: dict[str, WorkerSample],
                      cur: dict[str, WorkerSample]) -> None:
        if now <= t0:
            return
        arrived: dict[str, int] = {}
        for wid, c in cur.items():
            p = prev.get(wid)
            if p is None or p.role != c.role:
                continue
            served = c.ttft_count - p.ttft_count
            arrived[c.role] = arrived.get(c.role, 0) + served + c.waiting - p.waiting
            if p.waiting > 1 and c.waiting > 1:  # a queue at both looks: busy the whole interval, at full speed
                busy = self._busy.setdefault(c.role, [0.0, 0.0])
                busy[0] += served
                busy[1] += now - t0
        for role, n in arrived.items():
            dq = self._arrivals.setdefault(role, deque())
            dq.append((t0, now, n))
            while dq and dq[0][0] < now - self.cfg.trend_window_s:
                dq.popleft()

    def forecast(self, role: str, now: float) -> Forecast | None:
        """The role's arrival trend (None: forecast off or less than ``trend_window_s / 2`` of history)."""
        cfg = self.cfg
        dq = self._arrivals.get(role)
        span = dq[-1][1] - dq[0][0] if dq else 0.0
        if cfg.target_utilization is None or not dq or span < min(cfg.window_s, cfg.trend_window_s) / 2:
            return None
        # weighted least squares of the interval rates (weight: the interval's length) against its midpoint
        w = [b - a for a, b, _ in dq]
        x = [(a + b) / 2 for a, b, _ in dq]
        y = [n / (b - a) for a, b, n in dq]
        sw = sum(w)
        mx = sum(wi * xi for wi, xi in zip(w, x)) / sw
        my = sum(wi * yi for wi, yi in zip(w, y)) / sw
        sxx = sum(wi * (xi - mx) ** 2 for wi, xi in zip(w, x))
        # a slope fitted on less than half the trend window is mostly noise: until then, the level only
        trend = span >= cfg.trend_window_s / 2 and sxx > 0
        slope = sum(wi * (xi - mx) * (yi - my) for wi, xi, yi in zip(w, x, y)) / sxx if trend else 0.0
        t_last = dq[-1][1]
        rate = max(0.0, my + slope * (t_last - mx))
        ahead = max(0.0, my + slope * (t_last + cfg.forecast_lead_s - mx))
        busy = self._busy.get(role)
        mu = busy[0] / busy[1] if busy is not None and busy[1] >= cfg.window_s / 2 and busy[0] > 0 else None
        if mu is None:
            mu = cfg.service_rate_per_worker  # the operator's capacity figure, until measured
        if mu is None:
            return Forecast(rate, slope, ahead, None, None, None)
        per = cfg.target_utilization * mu
        # 1e-9: a rate that is exactly a whole number of workers' share needs that many, not one more
        return Forecast(rate, slope, ahead, mu, max(1, math.ceil(ahead / per - 1e-9)),
                        max(1, math.ceil(max(rate, ahead) / per - 1e-9)))

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
        if sig.forecast is not None and sig.forecast.needed_now is not None:
            needs = self._needs.setdefault(role, deque())
            needs.append((now, sig.forecast.needed_now))
            while needs[0][0] <= now - cfg.window_s:
                needs.popleft()

        def hold(*why: str) -> Recommendation:
            return Recommendation(role, 0, why, sig, now, decided_at=step.at if step is not None else None)

        # changed == step.at: the count changed on the look that decided the step (before it): not this step
        if step is not None and step.delta and now - step.at < cfg.cooldown_s and changed <= step.at:
            return Recommendation(role, step.delta, (f"pending: {step.delta:+d} decided at {step.at:.0f}s, still "
                                                     f"{n} workers", *step.reasons), sig, now, decided_at=step.at)
        ahead = self._forecast_up(sig)
        if ahead is not None and n < cfg.max_workers:
            # the forecast reads the traffic and a worker's measured service rate, not the fleet's TTFT: it
            # needs no watching after a step (cooldown, window) nor a warm newcomer (cold), only its last
            # step seen (the pending rule above): one worker at a time, each started once the last joined
            return self._decide(role, +1, (ahead,), sig, now)
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
        down = self._down_reasons(role, sig)
        if down is not None:
            if n <= cfg.min_workers:
                return hold(f"at min_workers ({cfg.min_workers})", *down)
            return self._decide(role, -1, down, sig, now)
        return hold(f"in range: {sig.queue_per_worker:.2f} waiting/worker, TTFT {sig.ttft_stat} {_secs(sig.ttft_s)}, "
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
            out.append(f"TTFT: {sig.ttft_stat} {sig.ttft_s:.3f}s >= {cfg.up_ttft_s:g}s")
        if sig.kv_usage >= cfg.up_kv_usage:
            out.append(f"KV: {sig.kv_usage:.0%} used >= {cfg.up_kv_usage:.0%}")
        ahead = self._forecast_up(sig)
        if ahead is not None:
            out.append(ahead)
        return tuple(out)

    def _forecast_up(self, sig: RoleSignals) -> str | None:
        """The forecast's reason for +1 (None: off, unknown, or the role has the workers it needs)."""
        f, cfg = sig.forecast, self.cfg
        if f is None or f.needed is None or f.needed <= sig.workers:
            return None
        return (f"forecast: {_rate(f)} -> {f.ahead:.2f} req/s in {cfg.forecast_lead_s:g}s needs {f.needed} "
                f"workers at {cfg.target_utilization:.0%} of {f.service_rate:.2f} req/s each")

    def _down_reasons(self, role: str, sig: RoleSignals) -> tuple[str, ...] | None:
        """The reasons for -1 when every one holds, else None."""
        cfg = self.cfg
        n = sig.workers
        spread = n / (n - 1) if n > 1 else 1.0  # the same load on one worker fewer (one worker: min_workers holds)
        queue, kv = sig.queue_per_worker * spread if sig.queue_per_worker else 0.0, sig.kv_usage * spread
        if queue > cfg.down_queue_per_worker or kv > cfg.down_kv_usage:
            return None
        if sig.ttft_s is not None and sig.ttft_s > cfg.down_ttft_s:
            return None
        f = sig.forecast
        # scale-down stabilisation (as Kubernetes' HPA does): the most workers the forecast asked for at any
        # look of the last window_s, so that noise in the trend does not drain a worker the next look re-adds
        most = max((k for _, k in self._needs.get(role, ())), default=None) if f is not None else None
        if most is not None and most > n - 1:
            return None
        out = (f"queue on {n - 1} workers: {queue:.2f} waiting/worker <= {cfg.down_queue_per_worker:g}",
               f"KV on {n - 1} workers: {kv:.0%} <= {cfg.down_kv_usage:.0%}",
               f"TTFT: {sig.ttft_stat} {_secs(sig.ttft_s)} <= {cfg.down_ttft_s:g}s")
        if most is not None and f is not None:
            out += (f"forecast: {_rate(f)}, {f.ahead:.2f} req/s in {cfg.forecast_lead_s:g}s: at most {most} "
                    f"workers needed over {cfg.window_s:g}s at {cfg.target_utilization:.0%} of "
                    f"{f.service_rate:.2f} req/s each",)
        return out

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
        q = self.cfg.ttft_quantile
        hist: dict[float, int] | None = {} if q is not None else None  # the window's TTFT histogram
        for wid, s in latest.items():
            base = next(snap.workers[wid] for snap in snaps if wid in snap.workers)  # its first look in the window
            routed += s.routed - base.routed
            hits += s.hits - base.hits
            count += s.ttft_count - base.ttft_count
            ttft += s.ttft_sum - base.ttft_sum
            if hist is not None:
                hist = _add_window(hist, s, base)
        hit_rate = hits / routed if routed else None
        cold = tuple(sorted(w for w in latest if self._cold(latest[w], hit_rate, now)))
        ttft_s, stat = (ttft / count if count else None), "mean"
        if q is not None and hist is not None and count:
            ttft_s, stat = _quantile(q, hist, count), f"p{q * 100:g}"
        return RoleSignals(n, cold, queue / len(snaps), ttft_s, hit_rate, kv / len(snaps), snaps[-1].t - snaps[0].t,
                           self.forecast(role, now), stat)

    def _cold(self, s: WorkerSample, role_hit_rate: float | None, now: float) -> bool:
        j = self._joined.get(s.worker_id)
        if j is None or now - j.at >= self.cfg.max_cold_s or s.ttft_count - j.served >= self.cfg.warm_requests:
            return False
        routed = s.routed - j.routed
        return not (routed and role_hit_rate is not None and (s.hits - j.hits) / routed >= role_hit_rate)


def _add_window(hist: dict[float, int], s: WorkerSample, base: WorkerSample) -> dict[float, int] | None:
    """``hist`` plus ``s``'s TTFT buckets less ``base``'s (the same worker at its first look in the
    window); None when they cannot be told apart (a sample without buckets, or bounds that differ)."""
    if s.ttft_count == base.ttft_count:
        return hist  # nothing in the window from this worker
    if not s.ttft_buckets or (base.ttft_count and [b for b, _ in base.ttft_buckets] != [b for b, _ in s.ttft_buckets]):
        return None
    before = dict(base.ttft_buckets)
    for bound, n in s.ttft_buckets:
        hist[bound] = hist.get(bound, 0) + n - before.get(bound, 0)
    return hist


def _quantile(q: float, hist: dict[float, int], count: int) -> float:
    """The ``q`` quantile of ``count`` values from their cumulative histogram (upper bound -> values at
    or below it): linear within the bucket that holds it, from the bucket below's bound (0 for the
    first); past the last finite bound, that bound (as Prometheus' ``histogram_quantile``)."""
    rank = q * count
    lo, below = 0.0, 0
    for bound in sorted(hist):
        n = hist[bound]
        if n >= rank:
            return lo + (bound - lo) * ((rank - below) / (n - below) if n > below else 1.0)
        lo, below = bound, n
    return lo


def _count(workers: dict[str, WorkerSample], role: str) -> int:
    return sum(1 for s in workers.values() if s.role == role)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _rate(f: Forecast) -> str:
    return f"arrivals {f.rate:.2f} req/s ({f.slope * 60:+.2f} per minute)"


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}s"
