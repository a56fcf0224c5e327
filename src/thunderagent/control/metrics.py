"""Prometheus metrics of the control plane, on a registry owned by the app (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

from thunderagent.control.metric_children import LabelledChildren
from thunderagent.control.seed_metrics import Latency, SeedMetrics
from thunderagent.execution.kv_stream import StreamStats
from thunderagent.scheduler.dispatch import Dispatch, Dispatcher
from thunderagent.scheduler.programs import PROGRAM_CAP_CODE
from thunderagent.types import KvPull, LoadReport

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
#: a worker that left the fleet keeps its labelled series this long (seconds), then they are removed
DEPARTED_SERIES_S = 600.0


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, window_s: float = 60.0, max_route_keys: int = 32) -> None:
        r = self.registry = CollectorRegistry()
        self.seed = SeedMetrics(r, window_s, max_route_keys)
        self.requests = Counter(
            "thunderagent_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "thunderagent_ttft_seconds", "Time to first token (wall clock)", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "thunderagent_itl_seconds", "Inter-token latency (wall clock)", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(
            "thunderagent_worker_queue_depth", "Waiting requests per worker", ["worker"], registry=r
        )
        self.running = Gauge("thunderagent_worker_running", "Running requests per worker", ["worker"], registry=r)
        self.kv_usage = Gauge("thunderagent_worker_kv_usage", "Active KV blocks / total", ["worker"], registry=r)
        self.healthy = Gauge("thunderagent_worker_healthy", "1 if the worker is routable", ["worker"], registry=r)
        self.out_of_routing = Gauge(
            "thunderagent_worker_out_of_routing",
            "1 while a worker keeps itself out of routing (reason: unreachable, block_size_mismatch)",
            ["worker", "reason"], registry=r,
        )
        self.rerouted = Counter(
            "thunderagent_rerouted", "Requests routed again because their worker could not take them", registry=r
        )
        self.migrations = Counter("thunderagent_migrations", "Requests moved to another worker mid-stream "
                                  "(their worker was lost)", ["cause"], registry=r)
        self.migration_failed = Counter("thunderagent_migration_failed", "Requests lost mid-stream that no "
                                        "worker could take over", registry=r)
        self.routed = Counter("thunderagent_routed", "Routing decisions per worker", ["worker"], registry=r)
        self.prompt_tokens = Counter("thunderagent_prompt_tokens", "Prompt tokens routed", registry=r)
        self.predicted_hit_tokens = Counter(
            "thunderagent_predicted_hit_tokens", "Prompt tokens the router expected cached on the chosen worker",
            registry=r,
        )
        self.cached_tokens = Counter(
            "thunderagent_cached_tokens", "Prompt tokens engines served from cache", registry=r
        )
        self.recompute_tokens = Counter(
            "thunderagent_prefill_recompute_tokens",
            "Prompt tokens prefilled although some worker held them (per the index at routing time)",
            registry=r,
        )
        self.decision_time = Histogram(
            "thunderagent_routing_decision_seconds", "Time to hash, match and choose a worker",
            buckets=_DECISION_BUCKETS, registry=r,
        )
        for add in (self._marks_metrics, self._rate_metrics, self._liveness_metrics, self._scheduler_metrics, self._grouping_metrics,
                    self._pd_metrics, self._relay_metrics):
            add(r)
        self._tiers: set[str] = set()
        self._paced = (0, 0)  # the pacer's pauses and resumes already counted
        self._routed_by, self._requests_by = LabelledChildren(self.routed), LabelledChildren(self.requests)
        # per worker id seen on the health tick: None while registered, else when it was first missing
        self._present: dict[str, float | None] = {}

    def observe_route(self, d: Dispatch, seconds: float, now: float) -> None:
        prompt_tokens, predicted_hit_tokens = len(d.request.prompt_tokens), d.predicted_tokens
        self.seed.routed(d, now)
        self._routed_by(d.decision.worker_id).inc()
        self.decision_time.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.predicted_hit_tokens.inc(predicted_hit_tokens)
        self._prompt += prompt_tokens
        self._predicted += predicted_hit_tokens

    def count_request(self, endpoint: str, status: int) -> None:
        """``thunderagent_requests_total{endpoint,status}``: one answered request."""
        self._requests_by(endpoint, str(status)).inc()

    def observe_prefill(self, d: Dispatch, prompt_tokens: int, cached_tokens: int, now: float) -> None:
        """Once per request, when it ends (real engines report cached tokens with the last output):
        what the engine reused vs the best the fleet had, and whether the index was wrong about its
        worker (lazy verification: the engine had less than predicted)."""
        self.cached_tokens.inc(cached_tokens)
        if cached_tokens < d.predicted_tokens and not d.request.resumed:
            self.observe_correction(1)
        recompute = max(0, d.best_known_tokens - cached_tokens)
        self.seed.ended(prompt_tokens, cached_tokens, recompute, now)
        self.recompute_tokens.inc(recompute)
        self._recompute += recompute
        self._recompute_prompt = self._prompt

    def observe_correction(self, wrong: int) -> None:
        """Lazy verification found the index wrong about a request's worker (``wrong`` > 0)."""
        if wrong:
            self.prediction_corrections.inc()

    def observe_ttft(self, latency: Latency | None, seconds: float) -> None:
        self.ttft.observe(seconds)
        if latency is not None:
            latency.ttft(seconds)

    def observe_itl(self, latency: Latency | None, seconds: float) -> None:
        self.itl.observe(seconds)
        if latency is not None:
            latency.itl(seconds)

    def observe_fleet(self, loads: Iterable[LoadReport], now: float) -> None:
        """The health tick: the fleet's shape from the latest load reports (every registered worker);
        window rates decay; the series of workers gone ``DEPARTED_SERIES_S`` are removed."""
        reports = list(loads)
        self.seed.loads(reports)
        self.seed.refresh(now)
        self._departures([ld.worker_id for ld in reports], now)

    def _departures(self, present: list[str], now: float) -> None:
        """Workers come and go under new ids (pods, autoscaling): a worker that left keeps its series
        while a dashboard shows it unhealthy, then they go, so the page (and Prometheus' series count)
        does not grow with every worker ever seen. A worker back before then keeps them."""
        seen = self._present
        for wid in present:
            seen[wid] = None
        if len(seen) == len(present):
            return  # nobody left (ids are unique): O(1) beyond the loop above
        here = set(present)
        for wid, since in list(seen.items()):
            if wid in here:
                continue
            if since is None:
                seen[wid] = now
            elif now - since >= DEPARTED_SERIES_S:
                del seen[wid]
                self.forget_worker(wid)

    def forget_worker(self, worker_id: str) -> None:
        """Remove every series labelled with ``worker_id`` (and the children cached for it)."""
        for family in (self, self.seed):
            for metric in vars(family).values():
                if isinstance(metric, MetricWrapperBase) and "worker" in metric._labelnames:
                    metric.remove_by_labels({"worker": worker_id})
        self._routed_by.forget(0, worker_id)
        self.seed.forget_worker(worker_id)

    def observe_load(self, load: LoadReport, healthy: bool) -> None:
        w = load.worker_id
        self.queue_depth.labels(w).set(load.waiting)
        self.running.labels(w).set(load.running)
        self.kv_usage.labels(w).set(load.kv_usage)
        self.healthy.labels(w).set(1 if healthy else 0)

    def _marks_metrics(self, r: CollectorRegistry) -> None:
        """The marks on workers (``control/marks.py``), one gauge each."""
        self.cordoned = Gauge("thunderagent_worker_cordoned", "1 while an operator keeps the worker out of routing "
                              "(POST /v1/admin/workers/{id}/cordon)", ["worker"], registry=r)
        self.asleep = Gauge("thunderagent_worker_asleep", "1 while the worker's server sleeps (vLLM's sleep mode): "
                            "routed to only while no awake one can", ["worker"], registry=r)
        self.paused = Gauge("thunderagent_worker_paused", "1 while the worker's server has its generation paused "
                            "(vLLM's /pause): routed to only while no other one can", ["worker"], registry=r)

    def _rate_metrics(self, r: CollectorRegistry) -> None:
        self._prompt = self._predicted = self._recompute = 0
        self._recompute_prompt = 0  # _prompt when the recompute rate was last observed (its denominator)
        self.predicted_hit_rate = Gauge(
            "thunderagent_router_predicted_hit_rate", "predicted_hit_tokens / prompt_tokens", registry=r
        )
        self.recompute_rate = Gauge(
            "thunderagent_prefill_recompute_rate", "prefill_recompute_tokens / prompt_tokens", registry=r
        )
        # Both are ratios of the totals above, computed when scraped (on the loop, like every
        # observation) rather than set on every request; the recompute rate keeps the denominator of
        # its last observation, exactly what a set() there would have left.
        self.predicted_hit_rate.set_function(lambda: self._predicted / self._prompt if self._prompt else 0.0)
        self.recompute_rate.set_function(
            lambda: self._recompute / self._recompute_prompt if self._recompute_prompt else 0.0)

    def _liveness_metrics(self, r: CollectorRegistry) -> None:
        self.lease_expired = Counter(
            "thunderagent_worker_lease_expired", "Workers taken out of routing: no heartbeat for a lease of on-time "
            "loop seconds", ["worker"], registry=r,
        )
        self.index_purged = Counter(
            "thunderagent_index_purged_entries", "KV index entries purged because their worker left or its lease "
            "expired", ["worker"], registry=r,
        )
        self.kv_resyncs = Counter(
            "thunderagent_kv_resyncs", "Workers' index entries reloaded from a dump because KV events were lost "
            "(cause: gap: a seq skipped; tail_lost: the heartbeat's seq is past the last event received; rejoined: "
            "back after its lease expired)",
            ["worker", "cause"], registry=r,
        )
        self.loop_lag = Histogram(
            "thunderagent_loop_lag_seconds", "How late the frontend's health loop woke up (its event loop's lag)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r,
        )
        self.loop_lag_max = Gauge(
            "thunderagent_loop_lag_max_seconds", "Largest lateness of the health loop seen", registry=r,
        )
        self.prediction_corrections = Counter(
            "thunderagent_prediction_corrections", "Requests whose worker lacked blocks the index believed it held "
            "(its engine reported fewer cached tokens than predicted, or it never ran: predictions dropped)",
            registry=r,
        )
        self.breaker_state = Gauge(
            "thunderagent_worker_breaker_state", "Slow-worker breaker: 0 closed, 1 half-open (probing), 2 open "
            "(ejected from routing)", ["worker"], registry=r,
        )
        self.ejections = Counter(
            "thunderagent_worker_ejections", "Times a live worker was ejected from routing (slow against the fleet, "
            "or failing)", ["worker"], registry=r,
        )

    def observe_loop_lag(self, lag: float, max_lag: float) -> None:
        self.loop_lag.observe(lag)
        self.loop_lag_max.set(max_lag)

    def _scheduler_metrics(self, r: CollectorRegistry) -> None:
        self.scheduler_queued = Gauge(
            "thunderagent_scheduler_queued", "Requests held in the scheduler, per priority tier", ["priority"],
            registry=r,
        )
        self.scheduler_wait = Histogram(
            "thunderagent_scheduler_queue_wait_seconds", "Time requests waited in the scheduler before dispatch",
            buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r,
        )
        self.scheduler_affinity = Counter(
            "thunderagent_scheduler_affinity_dispatches", "Held requests dispatched ahead of the queue's next because "
            "a worker that could start them held their prefix (scheduler.affinity_candidates)", registry=r,
        )
        self.scheduler_rejected = Counter(
            "thunderagent_scheduler_rejected", "Requests refused with 429: the scheduler's queue was full", registry=r,
        )
        self.programs = Gauge(
            "thunderagent_programs", "Agent programs known, per state (reasoning, acting, paused)", ["state"], registry=r,
        )
        self.program_pauses = Counter(
            "thunderagent_program_pauses", "Agent programs paused (or marked to pause after their turn) by pacing",
            registry=r,
        )
        self.program_resumes = Counter(
            "thunderagent_program_resumes", "Paused or held agent programs resumed by pacing", registry=r,
        )
        self.programs_released = Counter(
            "thunderagent_programs_released", "Agent programs released by their clients", registry=r,
        )
        self.programs_evicted = Counter(
            "thunderagent_programs_evicted", "Idle agent programs forgotten early to stay within "
            "scheduler.max_programs, per tenant (empty: keys off; past metrics.max_route_keys tenants: _other)",
            ["tenant"], registry=r,
        )
        self.programs_evicted.labels("")  # exported before the first eviction
        self.tenant_refused_total = Counter(
            "thunderagent_tenant_refused", "Inference requests refused with 429 by a tenant's limit (400 for a prompt "
            "larger than its token bucket) (control_plane.tenant_limits: limit is requests_per_s, tokens_per_min, "
            "max_in_flight or max_programs; past metrics.max_route_keys tenants: _other)", ["tenant", "limit"],
            registry=r,
        )
        self.tenant_tokens_total = Counter(
            "thunderagent_tenant_tokens", "Tokens of each tenant's inference requests that started (API keys on): "
            "kind prompt (as tokenized here, cached included) or completion (generated, a client gone mid-stream "
            "included; past metrics.max_route_keys tenants: _other)", ["tenant", "kind"], registry=r,
        )
        self.tenant_in_flight_now = Gauge(
            "thunderagent_tenant_in_flight", "Inference requests of a limited tenant admitted and not yet answered",
            ["tenant"], registry=r,
        )
        self.scheduler_cancelled = Counter(
            "thunderagent_scheduler_cancelled", "Held requests whose client left before dispatch", registry=r,
        )
    def observe_queue(self, by_tier: dict[int, int]) -> None:
        now = {str(t): n for t, n in by_tier.items()}
        for t in self._tiers - now.keys():
            self.scheduler_queued.labels(t).set(0)  # a tier that emptied reads 0, not its last value
        for t, n in now.items():
            self.scheduler_queued.labels(t).set(n)
        self._tiers |= now.keys()

    def observe_programs(self, by_state: dict[str, int], evicted: Mapping[str | None, int]) -> None:
        """``evicted``: the program table's evictions per tenant since the last call."""
        for state, n in by_state.items():
            self.programs.labels(state).set(n)
        for tenant, n in evicted.items():
            self.programs_evicted.labels(self.seed.route_key(tenant or "")).inc(n)

    def queue_refused(self, code: str, tenant: str | None) -> None:
        """The dispatch path refused a request (429): a tenant's program cap, or the holding queue."""
        if code == PROGRAM_CAP_CODE and tenant is not None:
            self.tenant_refused(tenant, "max_programs")
        else:
            self.scheduler_rejected.inc()

    def tenant_refused(self, tenant: str, limit: str) -> None:
        self.tenant_refused_total.labels(self.seed.route_key(tenant), limit).inc()

    def tenant_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        """A request of ``tenant`` ended: its prompt's and its completion's tokens."""
        key = self.seed.route_key(tenant)
        self.tenant_tokens_total.labels(key, "prompt").inc(prompt)
        self.tenant_tokens_total.labels(key, "completion").inc(completion)

    def tenant_in_flight(self, tenant: str, n: int) -> None:
        # a tenant past max_route_keys shares _other with others: its last write wins there
        self.tenant_in_flight_now.labels(self.seed.route_key(tenant)).set(n)

    def observe_scheduler(self, d: Dispatcher, now: float) -> None:
        """The dispatcher's pacing, grouping and hot-prefix counters (each health tick)."""
        if d.pacer is not None:
            self.observe_pacing(d.pacer.pauses, d.pacer.resumes)
        if d.grouper is not None:
            self.observe_grouping(d.grouper.stats)
        hot = d.router.hot
        if hot is not None:
            self.observe_hot(hot.live_replicas(now), hot.added, hot.to_replicas)

    def observe_pacing(self, pauses: int, resumes: int) -> None:
        """The pacer's running totals: counters advance by what is new since the last call."""
        last_pauses, last_resumes = self._paced
        self.program_pauses.inc(pauses - last_pauses)
        self.program_resumes.inc(resumes - last_resumes)
        self._paced = (pauses, resumes)

    def _grouping_metrics(self, r: CollectorRegistry) -> None:
        """Prefix grouping (``scheduler.grouping``) and hot-prefix replicas (``routing.hot_prefix``)."""
        self.grouped = Counter(
            "thunderagent_grouped_requests", "Requests held as followers of an in-flight leader sharing their "
            "prefix (scheduler.grouping)", registry=r,
        )
        self.coalesced = Counter(
            "thunderagent_coalesced_requests", "Followers whose every full block was their leader's (identical "
            "prefills, scheduler.grouping.coalesce)", registry=r,
        )
        self.follower_releases = Counter(
            "thunderagent_follower_releases", "Followers released, by cause: stored (the prefix confirmed on the "
            "leader's worker), leader (its first token or end), timeout (follower_max_wait_ms)", ["cause"], registry=r,
        )
        self.grouping_windows = Counter(
            "thunderagent_grouping_windows", "New requests held for a window so that siblings can follow them",
            registry=r,
        )
        self.hot_replicas = Gauge(
            "thunderagent_hot_prefix_replicas", "Live replicas of hot prefixes (routing.hot_prefix)", registry=r,
        )
        self.hot_added = Counter(
            "thunderagent_hot_prefix_replicas_added", "Replicas added for hot prefixes", registry=r,
        )
        self.hot_routed = Counter(
            "thunderagent_hot_prefix_routed", "Requests sent to a hot prefix's replica", registry=r,
        )
        self._grouping: dict[str, int] = {}  # the grouper's totals already counted
        self._hot = (0, 0)  # hot prefixes' replicas added and requests to replicas already counted

    def observe_grouping(self, stats: Mapping[str, int]) -> None:
        """The grouper's running totals (``Grouper.stats``): counters advance by what is new."""
        last = self._grouping
        for name, counter in (("followers", self.grouped), ("coalesced", self.coalesced),
                              ("windows", self.grouping_windows)):
            counter.inc(stats[name] - last.get(name, 0))
        for cause in ("stored", "leader", "timeout"):
            self.follower_releases.labels(cause).inc(stats[cause] - last.get(cause, 0))
        self._grouping = dict(stats)

    def observe_hot(self, live_replicas: int, added: int, routed: int) -> None:
        """Hot prefixes (``HotPrefixes``): live replicas now; running totals of replicas added and
        of requests sent to a replica."""
        self.hot_replicas.set(live_replicas)
        self.hot_added.inc(added - self._hot[0])
        self.hot_routed.inc(routed - self._hot[1])
        self._hot = (added, routed)

    def _relay_metrics(self, r: CollectorRegistry) -> None:
        """Requests relayed with the client's body (``frontend/relay.py``), an operator's calls on the servers
        (``control/server_admin.py``)."""
        self.relayed = Counter(
            "thunderagent_relayed_requests", "Requests of a vLLM / SGLang fleet relayed to the servers with the "
            "client's body (relay), by the first field ThunderAgent does not model (all: every request with relay: "
            "all)", ["field"], registry=r,
        )
        self.server_calls = Counter(
            "thunderagent_server_calls", "An operator's calls on the servers, per worker asked (call: "
            "reset_prefix_cache, load_lora_adapter, unload_lora_adapter, pause, resume, or the vLLM path called; "
            "result: done, refused)", ["call", "result"], registry=r)

    def _pd_metrics(self, r: CollectorRegistry) -> None:
        """Disaggregated requests run by ``control.disagg_flow`` (prefill on one worker, KV moved)."""
        self.pd_started = Counter("thunderagent_pd_transfers_started", "Remote prefills started (prefill on one "
                                  "worker, KV pulled by the decode worker)", registry=r)
        self.pd_ok = Counter("thunderagent_pd_transfers_ok", "Remote prefills whose decode worker produced output "
                             "from the moved KV", registry=r)
        self.pd_failed = Counter("thunderagent_pd_transfers_failed", "Remote prefills that failed, by cause",
                                 ["cause"], registry=r)
        self.pd_fallbacks = Counter("thunderagent_pd_fallbacks", "Requests prefilled on their decode worker after "
                                    "their remote prefill failed, by cause", ["cause"], registry=r)
        self.pd_rerouted = Counter("thunderagent_pd_rerouted", "Requests routed again after their remote prefill or "
                                   "transfer failed (routing.fallback_to_local false: never prefilled on their "
                                   "decode worker), by cause", ["cause"], registry=r)
        self.pd_inflight = Gauge("thunderagent_pd_transfers_inflight", "Remote prefills holding a transfer plane slot "
                                 "(prefill running or KV on its way)", registry=r)
        self.pd_bytes = Counter("thunderagent_pd_transfer_bytes", "KV bytes moved by remote prefills (the plans' "
                                "estimate: full blocks x bytes_per_token)", registry=r)
        self.pd_seconds = Histogram(
            "thunderagent_pd_transfer_seconds", "Remote prefill submitted to first decode output (or failure)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r,
        )
        # simulated workers move real bytes (execution/kv_bytes.py); their decode side reports its pull
        self.pd_pulled_bytes = Counter("thunderagent_pd_kv_pulled_bytes", "KV payload bytes decode workers "
                                       "pulled and verified themselves (simulated workers)", registry=r)
        self.pd_pull_checksums = Counter("thunderagent_pd_kv_checksums_verified", "KV blocks whose checksum a "
                                         "decode worker verified on a pull (simulated workers)", registry=r)
        self.pd_pull_seconds = Histogram(
            "thunderagent_pd_kv_pull_seconds", "A decode worker's pull of a transfer's bytes, connect to last "
            "block verified (the plane's links learn from it)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r,
        )
        self.pd_links_learned = Counter("thunderagent_pd_links_learned", "Samples the transfer plane's link "
                                        "estimates learned, by source: a decode worker's own pull, or a decode "
                                        "server's NIXL metrics (per link)", ["source"], registry=r)

    def observe_kv_pull(self, pull: KvPull) -> None:
        """A decode worker's own pull of a transfer's bytes (simulated workers)."""
        self.pd_pulled_bytes.inc(pull.nbytes)
        self.pd_pull_checksums.inc(pull.blocks)
        self.pd_pull_seconds.observe(pull.seconds)

    def observe_pd_end(self, ok: bool, cause: str, seconds: float) -> None:
        if ok:
            self.pd_ok.inc()
        else:
            self.pd_failed.labels(cause).inc()
        self.pd_seconds.observe(seconds)

    def watch_kv_streams(self, streams: Callable[[], Mapping[str, StreamStats]]) -> None:
        """Export the KV-event streams of this process's engine adapters (vLLM / SGLang servers), read
        at each scrape: ``thunderagent_kv_event_batches_total{worker, outcome}``."""
        self.registry.register(StreamCollector(streams))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreamCollector:
    """Per engine adapter, its stream's counters (``execution/kv_stream.py``), as of the scrape."""

    #: outcome label -> what it counts
    OUTCOMES = (("applied", "batches"), ("duplicate", "duplicates"), ("gap", "gaps"), ("replay", "replays"),
                ("catch_up", "catch_ups"), ("resync", "resyncs"), ("engine_restart", "restarts"),
                ("undecodable", "decode_errors"))

    def __init__(self, streams: Callable[[], Mapping[str, StreamStats]]) -> None:
        self._streams = streams

    def collect(self) -> Iterable[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "thunderagent_kv_event_batches", "KV-event stream of each engine server, by outcome: applied batches, "
            "duplicates skipped, gaps seen, replays asked (gaps and catch-ups), catch-ups on (re)subscribing, "
            "resyncs (events lost for good), engine restarts, undecodable batches", labels=["worker", "outcome"])
        for wid, stats in sorted(self._streams().items()):
            for outcome, field in self.OUTCOMES:
                fam.add_metric([wid, outcome], getattr(stats, field))
        yield fam
