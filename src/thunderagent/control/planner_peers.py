"""The planner's counters shared by the frontends of one bus, so each judges the whole fleet.

A frontend's planner reads each worker's load (waiting, running, KV use) from the worker's own heartbeat,
the same on every frontend, but the requests routed, the hits and the times to first token only from the
requests *it* routed. With several frontends every planner would judge on a part of the traffic. So every
``planner.interval_s`` each frontend publishes its cumulative counters per worker on
``<p>.frontend.<id>.planner`` (:class:`~thunderagent.bus.wire.PlannerCounters`), and each planner adds
the others' latest to its own before it looks (:class:`SharedCounters`, pure).

The planner takes differences of cumulative counters, so the sum must never go down: a peer's counters
stay counted at their latest values after it stops (it contributed nothing since: its share of every
later difference is 0), a peer whose counter for a worker went down (its metrics for that worker were
reset) has the old values kept as a base, and a peer silent for ``forget_s`` is folded into that base
(its id is random per process: restarts would pile up). A peer's counters lag by up to one of its
intervals. A frontend routing to more workers than one message carries (the bus's ``max_payload``: ~1 MiB,
some 10,000 workers with TTFT buckets) sends its counters in several messages, each a self-contained subset
of its workers: a receiver takes each worker's latest counters wherever they come from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from thunderagent.bus.nats import Bus, BusMsg
from thunderagent.bus.wire import PlannerCounters, Subjects, WorkerCounters, decode_planner_counters, encode

log = logging.getLogger(__name__)

#: a frontend not heard for this long is folded into the base (seconds)
FORGET_S = 600.0
#: bytes of a message kept free of counters (the bus adds the subject and its headers)
HEADROOM = 4096


def messages(origin: str, workers: list[WorkerCounters], max_payload: int) -> list[bytes]:
    """``origin``'s counters as messages of at most ``max_payload - HEADROOM`` bytes each (one when they fit;
    a worker's counters are never split)."""
    limit = max(1, max_payload - HEADROOM)
    body = encode(PlannerCounters(origin, workers))
    if len(body) <= limit or len(workers) <= 1:
        return [body]
    parts = -(-len(body) // limit) + 1  # the size per worker varies (ids, buckets): one part more, then check
    step = -(-len(workers) // parts)
    out: list[bytes] = []
    for i in range(0, len(workers), step):
        out.extend(messages(origin, workers[i:i + step], max_payload))  # a part still too big is split again
    return out


def add(a: WorkerCounters | None, b: WorkerCounters) -> WorkerCounters:
    """``a + b`` for one worker (histogram buckets by bound; a bound one side lacks counts that side's 0)."""
    if a is None:
        return b
    buckets = a.ttft_buckets
    if b.ttft_buckets:
        merged: dict[float, int] = dict(a.ttft_buckets)
        for le, n in b.ttft_buckets:
            merged[le] = merged.get(le, 0) + n
        buckets = sorted(merged.items())
    return WorkerCounters(a.worker_id, a.routed + b.routed, a.hits + b.hits, a.ttft_count + b.ttft_count,
                          a.ttft_sum + b.ttft_sum, buckets)


def _went_down(old: WorkerCounters, new: WorkerCounters) -> bool:
    return new.routed < old.routed or new.hits < old.hits or new.ttft_count < old.ttft_count


class SharedCounters:
    """The other frontends' counters per worker (pure: ``now`` passed in)."""

    def __init__(self, self_id: str, forget_s: float = FORGET_S) -> None:
        self.self_id = self_id
        self.forget_s = forget_s
        self._latest: dict[str, dict[str, WorkerCounters]] = {}  # origin -> worker -> its latest counters
        self._seen: dict[str, float] = {}  # origin -> when its latest message arrived
        self._base: dict[str, WorkerCounters] = {}  # worker -> counts of forgotten or reset series

    def absorb(self, origin: str, workers: list[WorkerCounters], now: float) -> None:
        if origin == self.self_id:  # our own message, echoed by the bus
            return
        per = self._latest.setdefault(origin, {})
        for c in workers:
            old = per.get(c.worker_id)
            if old is not None and _went_down(old, c):
                self._base[c.worker_id] = add(self._base.get(c.worker_id), old)
            per[c.worker_id] = c
        self._seen[origin] = now
        for o in [o for o, t in self._seen.items() if now - t > self.forget_s]:
            for wid, c in self._latest.pop(o).items():
                self._base[wid] = add(self._base.get(wid), c)
            del self._seen[o]

    def merged(self, local: dict[str, WorkerCounters]) -> dict[str, WorkerCounters]:
        """``local`` (this frontend's, by worker) plus every other frontend's."""
        out = dict(local)
        for per in [self._base, *self._latest.values()]:
            for wid, c in per.items():
                out[wid] = add(out.get(wid), c)
        return out

    def origins(self) -> list[str]:
        return sorted(self._latest)


class PlannerPeers:
    """The bus side: publish this frontend's counters, absorb the others'."""

    def __init__(self, bus: Bus, subjects: Subjects, frontend_id: str) -> None:
        self.bus = bus
        self.subjects = subjects
        self.frontend_id = frontend_id
        self.shared = SharedCounters(frontend_id)
        self.ignored = 0  # messages that did not decode
        self._clock: Callable[[], float] = lambda: 0.0

    async def start(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        await self.bus.subscribe(self.subjects.all_planner_counters(), self._on_counters)

    def share(self, local: dict[str, WorkerCounters]) -> None:
        subject = self.subjects.planner_counters(self.frontend_id)
        for body in messages(self.frontend_id, list(local.values()), self.bus.max_payload):
            self.bus.publish(subject, body)

    def merged(self, local: dict[str, WorkerCounters]) -> dict[str, WorkerCounters]:
        return self.shared.merged(local)

    async def _on_counters(self, msg: BusMsg) -> None:
        try:
            body = decode_planner_counters(msg.data)
        except msgspec.DecodeError:
            self.ignored += 1
            if self.ignored == 1:
                log.warning("planner counters on %s did not decode (a frontend of another version?): ignored",
                            msg.subject)
            return
        if msg.subject != self.subjects.planner_counters(body.origin):
            self.ignored += 1  # the subject names the sender: a body claiming another frontend is not taken
            return
        self.shared.absorb(body.origin, body.workers, self._clock())
