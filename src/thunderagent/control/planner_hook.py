"""The scaling planner in the live fleet: fed on the health tick, read at ``GET /v1/planner`` and as
``thunderagent_planner_recommendation{role}`` (-1 / 0 / +1), and acting through the operator's
command, webhook or Kubernetes Deployment (``planner:`` config; ``control/planner.py`` decides).

Every ``planner.interval_s`` the fleet's health tick (:meth:`PlannerHook.tick`) hands the planner one
sample per routable worker: its role, its latest load report (waiting, running, KV use) and four
cumulative counters read from the fleet's own metrics (requests routed, of them to a holder of
part of their prompt, and its TTFT histogram's count and sum). A step decided on that look (a
*fresh* +1 / -1) fires the action once, in a task of its own: the event loop never waits for it.

- ``planner.command``: argv + ``[role, "+1" | "-1"]``, no shell, killed after ``action_timeout_s``;
- ``planner.webhook_url``: POST ``{"role", "delta", "reasons", "at"}``, given up after the same time;
- ``planner.kubernetes``: the role's Deployment one replica up / down (``control/planner_k8s.py``).

Each action's outcome (exit status, HTTP status or the error) is kept (the last 20) and shown at
``GET /v1/planner``; a failed action is logged and does not stop the planner.

With several frontends on one bus, each adds the others' counters to its own (``peers``:
``control/planner_peers.py``), so every planner judges the whole fleet's traffic, and only one acts
(``lead``: :class:`~thunderagent.control.leadership.Leadership`); both are set by the NATS membership.
The others show their advice, log a step they would have taken, and keep it in ``actions`` as not
acted on. In ``serve`` (one process) both are None: it acts on its own counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Protocol

import aiohttp
from prometheus_client import CollectorRegistry, Gauge

from thunderagent.bus.wire import WorkerCounters
from thunderagent.config.planner import PlannerConfig
from thunderagent.control.leadership import Leadership
from thunderagent.control.planner import Planner, Recommendation, WorkerSample
from thunderagent.control.planner_k8s import KubeTarget, resolve, scale_step
from thunderagent.control.registry import WorkerRegistry
from thunderagent.types import WorkerState

log = logging.getLogger(__name__)

_COUNTERS = {"thunderagent_routed_total": "routed", "thunderagent_routed_hits_total": "hits",
             "thunderagent_worker_ttft_seconds_count": "ttft_count", "thunderagent_worker_ttft_seconds_sum": "ttft_sum"}
_TTFT_BUCKET = "thunderagent_worker_ttft_seconds_bucket"


class _Peers(Protocol):  # control/planner_peers.py: the other frontends' counters
    def share(self, local: dict[str, WorkerCounters]) -> None: ...
    def merged(self, local: dict[str, WorkerCounters]) -> dict[str, WorkerCounters]: ...


class PlannerHook:
    def __init__(self, cfg: PlannerConfig, metrics: CollectorRegistry, routable: Callable[[], list[WorkerState]],
                 registry: WorkerRegistry) -> None:
        """``metrics``: the fleet's registry (counters read, gauge added); ``routable``: the fleet's
        routable workers now; ``registry``: their roles."""
        self.cfg = cfg
        self.planner = Planner(cfg) if cfg.enabled else None
        #: the Kubernetes API to scale Deployments through (raises ValueError here, at start, if not found)
        self._kube: KubeTarget | None = resolve(cfg.kubernetes) if cfg.kubernetes is not None else None
        self._deployments = cfg.kubernetes.deployments if cfg.kubernetes is not None else {}  # role -> Deployment
        self._metrics, self._routable, self._registry = metrics, routable, registry
        self._next = 0.0
        self.actions: deque[dict[str, Any]] = deque(maxlen=20)  # outcomes of the latest actions
        self._tasks: set[asyncio.Task[None]] = set()
        self.gauge = Gauge("thunderagent_planner_recommendation", "The scaling planner's recommendation per worker "
                           "role: +1 add a worker, -1 remove one, 0 hold", ["role"], registry=metrics)
        #: which frontend of a bus acts (None: this is the only one)
        self.lead: Leadership | None = None
        #: the other frontends' counters (None: this is the only one)
        self.peers: _Peers | None = None
        self.acting_gauge = Gauge("thunderagent_planner_acting", "1 if this frontend runs the planner's command / "
                                  "webhook (the one frontend of a bus that acts), else 0", registry=metrics)

    @property
    def can_act(self) -> bool:
        """The planner is on and has a command or a webhook to call."""
        return self.planner is not None and bool(self.cfg.command or self.cfg.webhook_url or self.cfg.kubernetes)

    def acting(self, now: float) -> bool:
        return self.can_act and (self.lead is None or self.lead.acting(now))

    def tick(self, now: float) -> None:
        """The fleet's health tick: a look every ``interval_s`` (nothing while the planner is off)."""
        if self.planner is None or now < self._next:
            return
        self._next = now + self.cfg.interval_s
        counters = self.counters()
        if self.peers is not None:  # other frontends on the bus: judge the fleet's traffic, not ours alone
            self.peers.share(counters)
            counters = self.peers.merged(counters)
        self.planner.observe(now, self.samples(counters))
        acting = self.acting(now)
        self.acting_gauge.set(int(acting))
        for role, rec in self.planner.recommend(now).items():
            self.gauge.labels(role).set(rec.delta)
            if not rec.fresh:
                continue
            if acting or not self.can_act:  # (without a command, webhook or Deployment there is nothing to act with)
                log.info("planner: %s %+d (%s)", role, rec.delta, "; ".join(rec.reasons))
                self._act(rec)
            else:
                leader = None if self.lead is None else self.lead.leader()
                log.info("planner: %s %+d (%s); not acted on here: %s", role, rec.delta, "; ".join(rec.reasons),
                         f"frontend {leader} acts for the fleet" if leader else "leadership not settled")
                self.actions.append({"kind": "not_acted", "role": role, "delta": rec.delta, "at": rec.at,
                                     "leader": leader})

    def counters(self) -> dict[str, WorkerCounters]:
        """This frontend's cumulative counters per worker, from its metrics."""
        counters: dict[str, dict[str, float]] = {}
        buckets: dict[str, list[tuple[float, int]]] = {}
        quantile = self.cfg.ttft_quantile is not None  # the histograms are read only when the planner uses them
        for family in self._metrics.collect():
            for s in family.samples:
                field = _COUNTERS.get(s.name)
                if field is not None and "worker" in s.labels:
                    counters.setdefault(s.labels["worker"], {})[field] = s.value
                elif quantile and s.name == _TTFT_BUCKET and "worker" in s.labels and s.labels["le"] != "+Inf":
                    buckets.setdefault(s.labels["worker"], []).append((float(s.labels["le"]), int(s.value)))
        return {wid: WorkerCounters(wid, int(c.get("routed", 0)), int(c.get("hits", 0)), int(c.get("ttft_count", 0)),
                                    c.get("ttft_sum", 0.0), sorted(buckets.get(wid, ())))
                for wid, c in counters.items()}

    def samples(self, counters: dict[str, WorkerCounters] | None = None) -> list[WorkerSample]:
        """One sample per routable worker: its load, and ``counters`` (default: this frontend's)."""
        counters = self.counters() if counters is None else counters
        out = []
        for w in self._routable():
            c = counters.get(w.worker_id)
            role = self._registry.info(w.worker_id).role
            if c is None:
                out.append(WorkerSample(w.worker_id, role, w.load.waiting, w.load.running, w.load.kv_usage))
            else:
                out.append(WorkerSample(w.worker_id, role, w.load.waiting, w.load.running, w.load.kv_usage,
                                        c.routed, c.hits, c.ttft_count, c.ttft_sum, tuple(c.ttft_buckets)))
        return out

    # -- actions -------------------------------------------------------------------------------
    def _act(self, rec: Recommendation) -> None:
        kube = rec.role in self._deployments
        for coro in ((self._command(rec),) if self.cfg.command else ()) + \
                ((self._webhook(rec),) if self.cfg.webhook_url else ()) + ((self._kubernetes(rec),) if kube else ()):
            task = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(task)  # a reference, so the task is not collected mid-run
            task.add_done_callback(self._tasks.discard)

    async def _command(self, rec: Recommendation) -> None:
        assert self.cfg.command is not None
        argv = [*self.cfg.command, rec.role, f"{rec.delta:+d}"]
        entry: dict[str, Any] = {"kind": "command", "role": rec.role, "delta": rec.delta, "at": rec.at}
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            entry["error"] = f"cannot run {argv[0]!r}: {exc.strerror}"
        else:
            try:
                _, err = await asyncio.wait_for(proc.communicate(), self.cfg.action_timeout_s)
                entry["exit_status"] = proc.returncode
                if proc.returncode:
                    entry["error"] = err.decode(errors="replace")[-500:]
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                entry["error"] = f"killed after {self.cfg.action_timeout_s:g}s"
        self._done(entry)

    async def _webhook(self, rec: Recommendation) -> None:
        assert self.cfg.webhook_url is not None
        body = {"role": rec.role, "delta": rec.delta, "reasons": list(rec.reasons), "at": rec.at}
        entry: dict[str, Any] = {"kind": "webhook", "role": rec.role, "delta": rec.delta, "at": rec.at}
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.action_timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as http, \
                    http.post(self.cfg.webhook_url, json=body) as resp:
                entry["status"] = resp.status
                if resp.status >= 300:
                    entry["error"] = f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        self._done(entry)

    async def _kubernetes(self, rec: Recommendation) -> None:
        assert self._kube is not None
        entry: dict[str, Any] = {"kind": "kubernetes", "role": rec.role, "delta": rec.delta, "at": rec.at}
        entry.update(await scale_step(self._kube, self._deployments[rec.role], rec.delta,
                                      rec.signals.workers, self.cfg.min_workers, self.cfg.max_workers,
                                      self.cfg.action_timeout_s))
        self._done(entry)

    def _done(self, entry: dict[str, Any]) -> None:
        if "error" in entry:
            log.warning("planner action failed: %s", entry)
        self.actions.append(entry)

    async def stop(self) -> None:
        """Cancel actions still running (the server is stopping)."""
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def summary(self, now: float) -> dict[str, Any]:
        """The ``GET /v1/planner`` body."""
        recs = self.planner.latest if self.planner is not None else {}
        return {
            "enabled": self.planner is not None,
            "acting": self.acting(now),
            "leadership": None if self.lead is None else self.lead.summary(now),
            "recommendations": [{
                "role": r.role, "delta": r.delta, "reasons": list(r.reasons), "at": r.at, "decided_at": r.decided_at,
                "signals": {"workers": r.signals.workers, "cold": list(r.signals.cold),
                            "queue_per_worker": r.signals.queue_per_worker, "ttft_s": r.signals.ttft_s,
                            "ttft_stat": r.signals.ttft_stat,
                            "hit_rate": r.signals.hit_rate, "kv_usage": r.signals.kv_usage,
                            "span_s": r.signals.span_s,
                            "forecast": None if r.signals.forecast is None else asdict(r.signals.forecast)},
            } for r in recs.values()],
            "actions": list(self.actions),
        }
