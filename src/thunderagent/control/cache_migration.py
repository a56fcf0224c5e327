"""Cache migration in the live fleet (``routing.migration``): the migrator on the health tick.

A thin driver of :class:`~thunderagent.transfer.migration.Migrator` (the policy the simulator runs):
the fleet reports each routed request (:meth:`CacheMigrationFlow.observe`, the prefix's demand and its
tokens) and calls :meth:`CacheMigrationFlow.tick` on its health tick with the routable workers; each planned
copy starts on the transfer plane (the prefill/decode plane when the fleet has a prefill group, else the one
``routing.migration.link`` configures) and runs as a task.

**How a copy moves, live**: in the two halves of a prefill/decode handoff (``control/disagg_flow.py``), with
one token asked of each: the source gets the prefix (its blocks' tokens and the token after them) as a
``remote_decode`` job, which finds the prefix in its cache and answers with a
:class:`~thunderagent.types.KvTransfer`; the target gets the same prompt with ``kv_from`` set to it, takes
the blocks it lacks from the source instead of computing them, and keeps them in its prefix cache (its
``BlockStored`` events confirm them in the index). vLLM servers move the bytes over NIXL (both started with
a ``NixlConnector`` in ``kv_role: kv_both``: either side of a copy); simulated engines import the blocks by
hash (their workers' byte transport moves checksummed bytes over TCP when configured). The copy's requests
carry the prefix's own ``cache_salt`` and LoRA adapter, which key the engines' caches. The source is not
pinned beyond its job (live, as for prefill/decode handoffs).

A copy ends when the target's request finishes. Failures are counted by cause (``source_gone``,
``source_failed``, ``no_kv_transfer``: the source answered without a transfer, a vLLM server without a
connector; ``target_gone``, ``target_busy``: it did not take the request, ``target_refused``: it failed it (a
vLLM server that cannot pull answers 500), ``timeout``, ``aborted``); a worker whose
copies fail for want of a connector (``no_kv_transfer``, ``target_refused``) is left out of the migrator's
looks for :data:`BROKEN_BACKOFF_S`, so a misconfigured server is not sent a one-token job every look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from thunderagent.config import Config, ConfigError, Policy, Role
from thunderagent.control.link_learning import LinkLearner
from thunderagent.engine.timing import make_timing
from thunderagent.execution.handle import OutputQueue, WorkerHandle
from thunderagent.kv.hashing import BASE_SEED
from thunderagent.kv.index import KvIndex
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.transfer.migration import Migration, Migrator, PrefixSource
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import EngineRequest, FinishReason, TokenOutput, WorkerState

log = logging.getLogger(__name__)

_DONE = (FinishReason.STOP, FinishReason.LENGTH)
#: engines whose servers can be either side of a copy (``sglang`` / ``openai``: no KV transfer ThunderAgent drives)
COPY_ENGINES = ("simulated", "vllm")
#: a copy is two one-token requests (the source's job, the target's pull): it may take longer than the
#: plane's estimate of its bytes (``timeout_factor`` x the link estimate), by their queueing and passes, and
#: by the first NIXL handshake between two vLLM servers (1-30 s seen on the CPU test servers)
MIN_COPY_TIMEOUT_S = 60.0
#: a worker whose copy failed for want of a KV connector is left out of the looks this long
BROKEN_BACKOFF_S = 300.0
_BROKEN = ("no_kv_transfer", "target_refused")


class CacheMigrationFlow:
    def __init__(self, migrator: Migrator, workers: Mapping[str, WorkerHandle], index: KvIndex,
                 clock: Callable[[], float]) -> None:
        self.migrator = migrator
        self.workers = workers
        self.index = index
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[bool]] = {}
        self._broken: dict[str, float] = {}  # worker -> until when its copies are not planned (``_BROKEN``)
        self.failures: dict[str, int] = {}  # copies failed, by cause (the plane may be shared with handoffs)
        #: teaches the plane's links from the copies that landed (set where the fleet's parts are built)
        self.learner: LinkLearner | None = None

    def observe(self, d: Dispatch, now: float) -> None:
        r = d.request
        self.migrator.observe(r.block_hashes, d.decision.best_overlap_blocks, now, r.check_hashes,
                              PrefixSource(r.prompt_tokens, r.hash_seed, r.cache_salt, r.lora_name))

    def tick(self, workers: Sequence[WorkerState], now: float) -> None:
        self.migrator.forget_departed(self.workers)  # (servers' measured prefill rates)
        if self._broken:
            self._broken = {w: t for w, t in self._broken.items() if t > now}
            workers = [w for w in workers if w.worker_id not in self._broken]
        self._start(self.migrator.tick(workers, self.index, now), now)

    def evacuate(self, worker_id: str, workers: Sequence[WorkerState], now: float) -> list[asyncio.Task[bool]]:
        """``worker_id`` is leaving (an operator's removal): copies of the prefixes it alone holds, by demand, to
        ``workers`` (:meth:`Migrator.evacuate`); their tasks, to wait for before it goes."""
        return self._start(self.migrator.evacuate(worker_id, workers, self.index, now), now)

    def _start(self, planned: list[Migration], now: float) -> list[asyncio.Task[bool]]:
        plane, tasks = self.migrator.plane, []
        for m in planned:
            t = plane.start(m.tid, m.src, m.dst, m.nbytes, now)
            assert t is not None, "the migrator plans a copy only when the plane has room"
            log.info("cache migration %s: %d blocks of a prefix (demand %.1f) from %s to %s", m.tid, m.blocks,
                     m.demand, m.src, m.dst)
            timeout = max(t.deadline - now, MIN_COPY_TIMEOUT_S)
            task = self._tasks[m.tid] = asyncio.create_task(self._copy(m, timeout), name=m.tid)
            tasks.append(task)
        return tasks

    def _request(self, m: Migration, request_id: str) -> EngineRequest:
        """One side's request: the prefix's tokens (simulated engines cache by the hashes given and take
        any tokens of the right length), one token asked."""
        n, src = len(m.hashes), m.source
        # a list: the HTTP adapters encode the prompt as JSON (the kept tokens are an array)
        tokens = list(src.tokens) if src is not None else [0] * (n * self.migrator.block_size + 1)
        return EngineRequest(request_id, tokens, list(m.hashes), BASE_SEED if src is None else src.hash_seed, 1,
                             True, cache_salt=None if src is None else src.cache_salt,
                             lora_name=None if src is None else src.lora_name,
                             check_hashes=None if m.checks is None else list(m.checks))

    async def _copy(self, m: Migration, timeout_s: float) -> bool:
        """Run copy ``m``; whether it landed."""
        ok, cause, side, pull = False, "aborted", None, None
        src_id = f"{m.tid}-source"
        try:
            async with asyncio.timeout(timeout_s):
                if (src := self.workers.get(m.src)) is None:
                    cause = "source_gone"
                    return False
                side = (src, src_id)
                out = await _last(src.submit(replace(self._request(m, src_id), remote_decode=True)))
                side = None
                if out.finish_reason not in _DONE:
                    cause = "source_failed"
                elif out.kv_transfer is None:
                    cause = "no_kv_transfer"
                elif (dst := self.workers.get(m.dst)) is None:
                    cause = "target_gone"
                else:
                    if self.learner is not None:
                        self.learner.started(m.src, m.dst, self.clock())
                    side = (dst, m.tid)
                    out = await _last(dst.submit(replace(self._request(m, m.tid), kv_from=out.kv_transfer)))
                    side, pull = None, out.kv_pull
                    ok = out.finish_reason in _DONE
                    cause = "ok" if ok else "target_busy" if out.finish_reason == FinishReason.UNAVAILABLE \
                        else "target_refused"
        except TimeoutError:
            cause = "timeout"
        finally:
            if side is not None:  # cut (timeout, stop) while a side ran: stop it there
                side[0].abort(side[1])
            self._tasks.pop(m.tid, None)
            now = self.clock()
            self.migrator.plane.finish(m.tid, now, ok=ok, cause=cause, learn=False)
            self.migrator.finished(m.tid, ok)
            if ok:
                self.migrator.landed(m, self.index, now)
                if self.learner is not None:  # the copy's own duration (two requests) teaches nothing: its pull does
                    self.learner.landed(m.src, m.dst, now, pull)
            else:
                log.warning("cache migration %s from %s to %s failed (%s)", m.tid, m.src, m.dst, cause)
                self.failures[cause] = self.failures.get(cause, 0) + 1
                if cause in _BROKEN:
                    bad = m.src if cause == "no_kv_transfer" else m.dst
                    self._broken[bad] = now + BROKEN_BACKOFF_S
                    log.warning("cache migration: %s left out of copies for %.0f s (%s: a vLLM server needs "
                                "a NixlConnector in kv_role kv_both)", bad, BROKEN_BACKOFF_S, cause)
        return ok

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def left_out(self) -> list[str]:
        now = self.clock()
        return sorted(w for w, t in self._broken.items() if t > now)

    def health(self, planning: bool = True) -> dict[str, object]:
        """``planning``: this frontend plans the copies (several NATS frontends: one of them does)."""
        return {"cache_migration": self.migrator.stats() | {"failures": dict(self.failures), "left_out": self.left_out(),
                                                             "planning": planning,
                                                             "demand_from": self.migrator.demand_from(self.clock())}}


class MigrationCollector:
    """Cache migration's counters as Prometheus series, read at each scrape (the policy's counters are plain fields:
    ``Migrator.stats``)."""

    def __init__(self, flow: CacheMigrationFlow) -> None:
        self._flow = flow

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        mig, failures = self._flow.migrator, self._flow.failures
        copies = CounterMetricFamily("thunderagent_cache_migration_copies", "Cache migration copies ended, by outcome "
                                     "(ok, or why it failed)", labels=["outcome"])
        copies.add_metric(["ok"], mig.completed)
        for cause, n in sorted(failures.items()):
            copies.add_metric([cause], n)
        yield copies
        refused = CounterMetricFamily("thunderagent_cache_migration_refusals", "Copies the policy did not plan, by "
                                      "cause (no_target, too_large, target_full, not_worth_it, plane_busy, "
                                      "rate_limited)", labels=["cause"])
        for cause, n in sorted(mig.refusals.items()):
            refused.add_metric([cause], n)
        yield refused
        yield CounterMetricFamily("thunderagent_cache_migration_bytes", "KV bytes of the copies that landed (the "
                                  "plane's estimate: blocks x bytes_per_token)", value=mig.bytes_moved)
        yield GaugeMetricFamily("thunderagent_cache_migration_inflight", "Copies in flight", value=mig.inflight)
        yield GaugeMetricFamily("thunderagent_cache_migration_left_out", "Workers left out of the copies for want of "
                                "a KV connector (BROKEN_BACKOFF_S)", value=len(self._flow.left_out()))


async def _last(q: OutputQueue) -> TokenOutput:
    """A one-token request's finished output, with the worker's pull of its KV (which rides on the first output)."""
    pull = None
    while not (out := await q.get()).finished:
        pull = pull or out.kv_pull
    if out.kv_pull is None and pull is not None:
        out = replace(out, kv_pull=pull)
    return out


def make_cache_migration(cfg: Config, plane: TransferPlane | None, workers: Mapping[str, WorkerHandle],
                         index: KvIndex, clock: Callable[[], float], policy: Policy) -> CacheMigrationFlow | None:
    """The live driver of ``routing.migration`` (None when off); ``plane``: the prefill/decode plane, if any;
    ``policy``: the router's."""
    mc = cfg.routing.migration
    if not mc.enabled:
        return None
    if policy is not Policy.kv_aware:
        raise ConfigError(f"routing.migration.enabled acts with policy kv_aware only (the router's is {policy.value})")
    nodes = cfg.execution_group.nodes
    if bad := sorted({n.engine for n in nodes if n.engine not in COPY_ENGINES}):
        raise ConfigError(f"routing.migration.enabled: copies need engines ThunderAgent can move KV between "
                          f"({' or '.join(COPY_ENGINES)}; vLLM servers with a NixlConnector in kv_role kv_both), "
                          f"not engine {' / '.join(bad)}")
    if (plane is None) != mc.link.enabled:
        raise ConfigError("routing.migration.link.enabled must be true without a prefill group (it is the copies' "
                          "plane) and false with one (that group's plane is shared)")
    decode = next(n for n in nodes if n.role is not Role.prefill)
    mig = Migrator(cfg.routing, plane if plane is not None else TransferPlane(mc.link), make_timing(decode.timing),
                   decode.block_size)
    return CacheMigrationFlow(mig, workers, index, clock)
