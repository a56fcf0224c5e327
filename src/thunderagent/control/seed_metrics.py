"""The seed documents' fleet metrics, as an operator reads them: rates over a sliding window
(``metrics.window_s``), the hot worker and its skew, the fleet's KV water level, TTFT and ITL per
worker and per route key, and decisions by kind.

Rates over the window (gauges, as of the latest observation or health tick, so a quiet fleet's
rates decay to 0 instead of freezing; computed when scraped, see :meth:`SeedMetrics.refresh`):

- ``thunderagent_cache_hit_rate``: share of the requests routed in the window that went to a worker
  the index believed held part of their prompt;
- ``thunderagent_cache_reuse_rate``: prompt tokens the engines served from cache (their own
  ``cached_tokens``) / prompt tokens, over the requests that ended in the window;
- ``thunderagent_prefill_recompute_window_rate``: prompt tokens prefilled although some worker held
  them (per the index at routing time) / prompt tokens, same requests.

Fleet shape (gauges, from the latest load reports): ``thunderagent_hot_worker_queue_depth`` (the
most waiting requests on one worker), ``thunderagent_queue_skew_ratio`` (that / the fleet's median,
a median of 0 counted as 1), ``thunderagent_kv_usage_max`` (the fullest worker's KV use).

Histograms ``thunderagent_worker_ttft_seconds{worker}``, ``thunderagent_worker_itl_seconds{worker}``,
``thunderagent_route_key_ttft_seconds{route_key}``, ``thunderagent_route_key_itl_seconds{route_key}``
(route keys past ``metrics.max_route_keys`` share the label ``_other``: a label per tenant must
not grow without bound), and the counter ``thunderagent_decisions_total{kind}`` (see
:func:`decision_kind`).
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from thunderagent.control.metric_children import LabelledChildren
from thunderagent.control.planner import WORKER_TTFT_BUCKETS
from thunderagent.control.window import WindowSums
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.types import LoadReport

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
OTHER_KEY = "_other"
#: the kinds ``thunderagent_decisions_total`` counts, in the order :func:`decision_kind` tests them
DECISION_KINDS = ("grouped", "held", "fallback", "busy_filtered", "hit", "miss_balance", "miss")


def decision_kind(d: Dispatch) -> str:
    """One kind per routing decision, the first that applies:

    - ``grouped``: a follower released to its group leader's worker (``scheduler.grouping``);
    - ``held``: it waited in the scheduler (holding queue or a paused program) before routing;
    - ``fallback``: every worker was busy (the ``routing.fallback`` rule chose);
    - ``busy_filtered``: some workers were left out as busy;
    - ``hit``: the chosen worker holds part of the prompt;
    - ``miss_balance``: another worker held part of it, the cost chose one that holds none (load);
    - ``miss``: no worker held any of it."""
    if d.grouped:
        return "grouped"
    if d.queue_wait > 0:
        return "held"
    if d.decision.fallback:
        return "fallback"
    if d.decision.busy_filtered:
        return "busy_filtered"
    if d.decision.overlap_blocks > 0:
        return "hit"
    return "miss_balance" if d.best_known_tokens > 0 else "miss"


class Latency:
    """A request's per-worker and per-route-key latency histograms."""

    __slots__ = ("_ttft", "_itl")

    def __init__(self, worker_ttft: Histogram, worker_itl: Histogram, key_ttft: Histogram,
                 key_itl: Histogram) -> None:
        self._ttft = (worker_ttft, key_ttft)
        self._itl = (worker_itl, key_itl)

    def ttft(self, seconds: float) -> None:
        for h in self._ttft:
            h.observe(seconds)

    def itl(self, seconds: float) -> None:
        for h in self._itl:
            h.observe(seconds)


class SeedMetrics:
    def __init__(self, r: CollectorRegistry, window_s: float, max_route_keys: int) -> None:
        self._routed = WindowSums(window_s, 2)  # requests routed, of them to a holder
        self._ended = WindowSums(window_s, 3)  # prompt tokens, cached tokens, recomputed tokens
        self.max_route_keys = max_route_keys
        self._keys: set[str] = set()
        #: the ``now`` of the latest observation or tick whose rates were not computed yet (None: current)
        self._due: float | None = None
        self._rates = (0.0, 0.0, 0.0)  # hit, reuse, recompute, as of the latest observation or tick
        # Latency records, each built once per (worker, route key) (four ``labels()`` calls each: see
        # control/metric_children.py; at most max_route_keys + 1 route keys)
        self._latency: dict[tuple[str, str], Latency] = {}
        self.hit_rate = Gauge("thunderagent_cache_hit_rate", "Requests routed to a worker holding part of their "
                              "prompt / requests routed, over the window", registry=r)
        self.reuse_rate = Gauge("thunderagent_cache_reuse_rate", "Prompt tokens engines served from cache / prompt "
                                "tokens, requests ended in the window", registry=r)
        self.recompute_rate = Gauge("thunderagent_prefill_recompute_window_rate", "Prompt tokens prefilled although "
                                    "some worker held them / prompt tokens, requests ended in the window", registry=r)
        self.hot_queue = Gauge("thunderagent_hot_worker_queue_depth", "Most waiting requests on one worker",
                               registry=r)
        self.skew = Gauge("thunderagent_queue_skew_ratio", "Hot worker's waiting requests / the fleet's median "
                          "(a median of 0 counts as 1)", registry=r)
        self.kv_max = Gauge("thunderagent_kv_usage_max", "KV use of the fullest worker (active blocks / total)",
                            registry=r)
        self.worker_ttft = Histogram("thunderagent_worker_ttft_seconds", "Time to first token per worker",
                                     ["worker"], buckets=WORKER_TTFT_BUCKETS, registry=r)
        self.worker_itl = Histogram("thunderagent_worker_itl_seconds", "Inter-token latency per worker",
                                    ["worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.key_ttft = Histogram("thunderagent_route_key_ttft_seconds", "Time to first token per route key",
                                  ["route_key"], buckets=_LATENCY_BUCKETS, registry=r)
        self.key_itl = Histogram("thunderagent_route_key_itl_seconds", "Inter-token latency per route key",
                                 ["route_key"], buckets=_LATENCY_BUCKETS, registry=r)
        self.decisions = Counter("thunderagent_decisions", "Routing decisions by kind (grouped, held, fallback, "
                                 "busy_filtered, hit, miss_balance, miss)", ["kind"], registry=r)
        self._kind = LabelledChildren(self.decisions)
        for kind in DECISION_KINDS:
            self._kind(kind)  # every kind reads 0 from the start
        self.worker_hits = Counter("thunderagent_routed_hits", "Requests routed to a worker while it held part of "
                                   "their prompt, per worker (the scaling planner's per-worker hit rate)", ["worker"],
                                   registry=r)
        self._hits = LabelledChildren(self.worker_hits)
        # the rates are read when scraped (generate_latest, on the event loop's thread like every
        # observation: /metrics renders there), not recomputed on every request
        self.hit_rate.set_function(lambda: self._rate(0))
        self.reuse_rate.set_function(lambda: self._rate(1))
        self.recompute_rate.set_function(lambda: self._rate(2))

    def routed(self, d: Dispatch, now: float) -> None:
        self._kind(decision_kind(d)).inc()
        self._routed.add(now, 1.0, 1.0 if d.predicted_tokens > 0 else 0.0)
        if d.predicted_tokens > 0:
            self._hits(d.decision.worker_id).inc()
        self._due = now

    def ended(self, prompt_tokens: int, cached_tokens: int, recomputed_tokens: int, now: float) -> None:
        """A request that reached its engine ended: its prompt, what its engine reused, and what
        was recomputed although some worker held it."""
        self._ended.add(now, prompt_tokens, cached_tokens, recomputed_tokens)
        self._due = now

    def refresh(self, now: float) -> None:
        """The window rates are as of ``now`` (the health tick calls it: quiet windows decay).

        Lazy: the rates are computed when read (a scrape), at the ``now`` of the latest observation or
        tick. That is exactly the value the eager recompute of every call would have left: nothing was
        added to the windows after that call, and a window read at a given ``now`` is the same whenever
        it is read (``WindowSums`` clears slices by ``now``, never by the clock)."""
        self._due = now

    def _rate(self, i: int) -> float:
        at = self._due
        if at is not None:
            self._due = None
            n, hits = self._routed.totals(at)
            prompt, cached, recomputed = self._ended.totals(at)
            self._rates = (hits / n if n else 0.0, cached / prompt if prompt else 0.0,
                           recomputed / prompt if prompt else 0.0)
        return self._rates[i]

    def route_key(self, key: str) -> str:
        """The label for ``key``: itself while fewer than ``max_route_keys`` were seen, else ``_other``."""
        if key in self._keys:
            return key
        if len(self._keys) < self.max_route_keys:
            self._keys.add(key)
            return key
        return OTHER_KEY

    def latency(self, worker_id: str, key: str) -> Latency:
        """The histograms one request's TTFT and ITL go to (looked up once per request, not per token)."""
        label = self.route_key(key)
        lat = self._latency.get((worker_id, label))
        if lat is None:  # the histograms only record: one Latency serves every request of the pair
            lat = self._latency[(worker_id, label)] = Latency(
                self.worker_ttft.labels(worker_id), self.worker_itl.labels(worker_id),
                self.key_ttft.labels(label), self.key_itl.labels(label))
        return lat

    def forget_worker(self, worker_id: str) -> None:
        """The worker's series were removed (``Metrics.forget_worker``): drop the children cached for it."""
        self._hits.forget(0, worker_id)
        for pair in [p for p in self._latency if p[0] == worker_id]:
            del self._latency[pair]

    def loads(self, loads: Iterable[LoadReport]) -> None:
        """The fleet's latest load reports (routable workers): hot worker, skew, KV water level."""
        reports = list(loads)
        if not reports:
            return
        waiting = [ld.waiting for ld in reports]
        hot = max(waiting)
        self.hot_queue.set(hot)
        self.skew.set(hot / max(median(waiting), 1.0))
        self.kv_max.set(max(ld.kv_usage for ld in reports))
