"""Liveness that survives a busy frontend: leases are measured against our own loop's lateness.

Heartbeats of in-process workers are tasks on the frontend's event loop; NATS heartbeats are read by
a task on it too. When the loop is saturated (a flood of requests, a long GC pause) every one of them
runs late by the same amount, and a lease checked on the wall clock alone would expire for every
worker at once: workers taken out of routing and their index entries purged because *we* were slow.

:class:`LoopLag` records how late the health loop woke up (it asks to sleep a known period, so any
extra is the loop's own lag) and answers how much of that lag fell after a given instant. Other
timed waits of the control plane (the PD flow's watch) report their late wake-ups too: one stall
seen by several of them is counted once. The lease
and the stall check subtract it: a worker is declared dead only for silence while our loop was on
time, i.e. on evidence that survives a busy frontend. A genuinely dead or hung worker is still found
after its lease of on-time loop seconds (later than the wall-clock lease by the lag measured
meanwhile, never earlier).

Pure and clock-free: the health loop passes the times in.
"""

from __future__ import annotations

from collections import deque

#: lateness below this is the loop's ordinary jitter, not recorded
JITTER_S = 0.005


class LoopLag:
    def __init__(self, horizon_s: float, max_records: int = 4096) -> None:
        if horizon_s <= 0:
            raise ValueError("horizon_s must be > 0")
        #: how far back lag is remembered (at least the longest lease or stall timeout it excuses)
        self.horizon_s = horizon_s
        self._lags: deque[tuple[float, float]] = deque(maxlen=max_records)  # (woke, seconds late)
        self.max_lag = 0.0
        self.total_lag = 0.0

    def tick(self, expected: float, woke: float) -> float:
        """A wait asked to wake at ``expected`` and woke at ``woke``: record the lateness (seconds,
        returned; 0 when on time) and forget records older than the horizon. A late span that
        overlaps the last record's (the same stall, seen by another wait) widens that record."""
        lag = woke - expected
        lags = self._lags
        while lags and lags[0][0] < woke - self.horizon_s:
            lags.popleft()
        if lag < JITTER_S:
            return 0.0
        start, end = expected, woke
        if lags and expected < lags[-1][0]:  # overlaps: the union, so records stay ordered by wake-up
            last_end, last_lag = lags.pop()
            self.total_lag -= last_lag
            start, end = min(start, last_end - last_lag), max(end, last_end)
        span = end - start
        lags.append((end, span))
        self.total_lag += span
        if span > self.max_lag:
            self.max_lag = span
        return lag

    def excused_since(self, t: float) -> float:
        """Seconds our loop was late after instant ``t`` (a record whose late wake-up straddles ``t``
        counts whole: a heartbeat stamped during a stall is not charged for that stall)."""
        total = 0.0
        for woke, lag in reversed(self._lags):
            if woke <= t:
                break
            total += lag
        return total

    def silent_for(self, since: float, now: float) -> float:
        """Seconds of on-time loop between ``since`` and ``now``: the silence a lease is judged on."""
        return max(0.0, now - since - self.excused_since(since))
