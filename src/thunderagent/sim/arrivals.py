"""Arrival sources of the simulator driver: open loop (trace times) and closed loop (per session).

A source tells the driver the time of its next arrival (``t``, ``math.inf`` when none is due yet),
hands it out (:meth:`pop`) and hears of every finished request (:meth:`finished`). The driver runs
the same dispatcher, engines and KV feed for both; only *when* a request arrives differs.

**Open loop** (:class:`OpenLoop`, the default): every request arrives at ``arrival_s / speedup``,
in trace order (the input order breaks ties), whatever happened to the requests before it.

**Closed loop** (:class:`ClosedLoop`): the requests of one session (:attr:`TraceRequest.session`:
a conversation, an agent program, a sub-agent) are issued one after another, ordered by their trace
arrival time (input order breaks ties):

* a session's first request arrives at its trace time ``arrival_s / speedup``; so does every
  request whose ``session`` is None (those stay open loop);
* each next request ``r`` is issued once its predecessor ``p`` has finished, at
  ``finish(p) + r.think_s / speedup`` when the trace records ``r.think_s``;
* without ``think_s``: ``max(finish(p), issue(p) + (r.arrival_s - p.arrival_s) / speedup)``, i.e.
  the trace's own gap between the two requests, measured from ``p``'s closed-loop arrival, but
  never before ``p`` finished.

``finish(p)`` is the time of ``p``'s last output: its last token, or, for a request that finishes
without a token (the engine rejected it as too long for its KV pool, or ``max_tokens == 0``), the
pass end at which the engine gave it up; so a rejected request never stalls its session. Every
client-side time (trace arrivals, think times, trace gaps) is divided by ``speedup``: ``--speedup``
makes the simulated clients that much faster, in both modes. Ties between arrivals at the same
instant go by trace order. Sub-agent sessions are sessions of their own: they start at their trace
time, independently of their parent's progress.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from thunderagent.sim.results import Dist
from thunderagent.sim.traces import TraceRequest

__all__ = ["ClosedLoop", "OpenLoop", "session_stats"]


def _trace_order(requests: Sequence[TraceRequest]) -> list[int]:
    return sorted(range(len(requests)), key=lambda k: requests[k].arrival_s)  # stable: input order ties


class OpenLoop:
    """Every request at its trace time (divided by ``speedup``)."""

    __slots__ = ("t", "_reqs", "_times", "_k", "_n")

    def __init__(self, requests: Sequence[TraceRequest], speedup: float) -> None:
        order = _trace_order(requests)
        self._reqs = [requests[k] for k in order]
        self._times = [requests[k].arrival_s / speedup for k in order]
        self._k = 0
        self._n = len(order)
        self.t = self._times[0] if order else math.inf

    def pop(self) -> TraceRequest:
        k = self._k + 1
        self._k = k
        self.t = self._times[k] if k < self._n else math.inf
        return self._reqs[k - 1]

    def finished(self, request_id: str, t: float, now: float) -> None:
        """Open loop: a finish changes nothing."""

    @property
    def unissued(self) -> int:
        return self._n - self._k


class ClosedLoop:
    """The requests of a session one after another (see the module docstring for the rule)."""

    __slots__ = ("t", "_heap", "_succ", "_issued", "_speedup")

    def __init__(self, requests: Sequence[TraceRequest], speedup: float) -> None:
        self._speedup = speedup
        # heap entries (time, position in trace order, request): the position breaks ties
        self._heap: list[tuple[float, int, TraceRequest]] = []
        # predecessor's id -> (position, successor, predecessor)
        self._succ: dict[str, tuple[int, TraceRequest, TraceRequest]] = {}
        self._issued: dict[str, float] = {}  # closed-loop arrival of each issued session request
        last: dict[str, TraceRequest] = {}
        for pos, k in enumerate(_trace_order(requests)):
            r = requests[k]
            prev = None if r.session is None else last.get(r.session)
            if prev is None:
                self._heap.append((r.arrival_s / speedup, pos, r))
            else:
                self._succ[prev.request_id] = (pos, r, prev)
            if r.session is not None:
                last[r.session] = r
        heapq.heapify(self._heap)
        self.t = self._heap[0][0] if self._heap else math.inf

    def pop(self) -> TraceRequest:
        heap = self._heap
        t, _, r = heapq.heappop(heap)
        if r.request_id in self._succ:
            self._issued[r.request_id] = t
        self.t = heap[0][0] if heap else math.inf
        return r

    def finished(self, request_id: str, t: float, now: float) -> None:
        """``request_id`` finished at ``t`` (seen by the driver at ``now``): issue its successor."""
        nxt = self._succ.pop(request_id, None)
        if nxt is None:
            return
        pos, r, prev = nxt
        issued = self._issued.pop(request_id)
        if r.think_s is not None:
            ta = t + r.think_s / self._speedup
        else:
            ta = max(t, issued + (r.arrival_s - prev.arrival_s) / self._speedup)
        heapq.heappush(self._heap, (max(ta, now), pos, r))  # never in the driver's past
        self.t = self._heap[0][0]

    @property
    def unissued(self) -> int:
        """Requests not handed out yet (queued, or waiting for their predecessor to finish)."""
        return len(self._heap) + len(self._succ)


def session_stats(requests: Sequence[TraceRequest], times: Mapping[str, tuple[float, float]],
                  duration_s: float) -> dict[str, object]:
    """The closed-loop figures of a run, for :attr:`RunResult.extra`.

    ``times`` maps a request id to its (arrival, finish) in virtual seconds, finish < 0 if it never
    finished. Only requests with a session count; "finished" includes requests the engine rejected
    (they finish without a token), as in the ``requests`` column.

    * ``sessions``: distinct sessions in ``requests``.
    * ``steps_per_min``: finished requests of sessions / (``duration_s`` / 60), ``duration_s``
      being the run's duration (``extra["duration_s"]``: the last token of the run).
    * ``session_completion_s``: over the sessions whose every request finished, last finish minus
      the first request's (closed-loop) arrival: ``mean``, ``p50``, ``p99`` (nearest rank, as
      :meth:`Dist.of`), plus ``n`` (the sessions counted).
    * ``jain_fairness_steps``: Jain's index ``(sum x_s)^2 / (n * sum x_s^2)`` of the per-session
      rates ``x_s = finished requests of s / (active span of s in minutes)``, the active span of
      ``s`` running from its first request's arrival to its last finished request's finish; over
      the ``n`` sessions with at least one finished request and a positive span. 1 when every
      session progresses at the same rate, ``1/n`` when one session gets all the progress; NaN
      without any such session.
    """
    by_session: dict[str, list[tuple[float, float]]] = {}
    for r in requests:
        if r.session is not None:
            by_session.setdefault(r.session, []).append(times.get(r.request_id, (math.nan, -1.0)))
    steps = 0
    completion: list[float] = []
    rates: list[float] = []
    for ts in by_session.values():
        done = [f for _, f in ts if f >= 0]
        steps += len(done)
        if not done:
            continue
        first = min(a for a, _ in ts if a == a)  # issued requests only (NaN: never issued)
        span = max(done) - first
        if len(done) == len(ts):
            completion.append(span)
        if span > 0:
            rates.append(len(done) / (span / 60.0))
    sq = sum(x * x for x in rates)
    comp = Dist.of(completion)
    return {
        "sessions": len(by_session),
        "steps_per_min": steps / (duration_s / 60.0) if duration_s > 0 else 0.0,
        "session_completion_s": {"n": len(completion), "mean": comp.mean, "p50": comp.p50, "p99": comp.p99},
        "jain_fairness_steps": sum(rates) ** 2 / (len(rates) * sq) if sq > 0 else math.nan,
    }
