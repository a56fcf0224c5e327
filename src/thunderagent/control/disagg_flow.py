"""Prefill/decode disaggregation in the live control plane: run a :class:`~thunderagent.types.PdPlan`.

A request routed with ``Dispatch.pd`` set runs in two halves, behind one output queue the fleet reads
like any other (one normal stream for the client):

1. a copy with ``remote_decode=True`` goes to the plan's prefill worker; its finished output carries
   the :class:`~thunderagent.types.KvTransfer` (vLLM: the ``kv_transfer_params`` its prefill answer
   returned);
2. the original request goes to the decode worker (the decision's) with ``kv_from`` set, and its
   outputs are relayed to the client.

Any failure of the first half (prefill worker unknown, lost, silent, erroring, not taking it, out
of time, no ``kv_transfer`` returned), and a decode worker refusing the transfer before any output,
fall back to submitting the original request, without ``kv_from``, to the decode worker: it
prefills there. Nothing is lost; the cause is counted
(``thunderagent_pd_fallbacks{cause}``). Aborting the request (client gone, the fleet cutting it)
aborts both halves.

Strict (``routing.fallback_to_local: false``, the observer's ``strict``): the decode worker never
prefills it. A plan that finds the plane at its cap waits for room (at most ``prefill_timeout``); a
failed first half, or a refused transfer, ends the relay ``UNAVAILABLE`` before any output, so the
fleet routes the request again (``control.migration.route_again``) without the worker at fault
(:attr:`PdAttempt.blamed`: the prefill worker when its half failed, the decode worker when it refused
the transfer), counted in ``thunderagent_pd_rerouted{cause}``; with no worker left the client gets the
refusal.

The flow reports each transfer's start and end to a :class:`TransferObserver`, the seam the
transfer plane's in-flight accounting plugs into. A transfer *ends* when the decode worker produced
its first output (a real engine cannot produce one before the KV it pulls arrived) or when the
first half failed; its seconds run from the prefill submission to that point.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol

from thunderagent.control.liveness import LoopLag
from thunderagent.control.metrics import Metrics
from thunderagent.execution.handle import (KEEPALIVE_S, STALL_TIMEOUT_S, FollowingQueue, OutputQueue, Snapshot,
                                           WorkerHandle)
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.types import EngineRequest, FinishReason, KvPull, KvTransfer, PdPlan, TokenOutput

__all__ = ["DisaggFlow", "PdAttempt", "RelayQueue", "TransferObserver", "PREFILL_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: longest a prefill half may take before the request prefills on its decode worker instead
PREFILL_TIMEOUT_S = 120.0

# fallback causes (metric labels)
GONE = "prefill_worker_gone"  # the plan names a worker the fleet no longer has, or it left meanwhile
SILENT = "prefill_silent"  # the prefill worker stopped touching the job (lost or hung)
UNAVAILABLE = "prefill_unavailable"  # it could not take the job
FAILED = "prefill_error"  # the job ended without finishing normally
TIMEOUT = "prefill_timeout"
NO_TRANSFER = "no_kv_transfer"  # finished, but the engine returned nothing to pull
DECODE_REFUSED = "decode_refused_transfer"  # the decode worker refused the transfer before any output
ABORTED = "aborted"  # the client request ended first (a failure, not a fallback)
PLANE_FULL = "plane_full"  # the transfer plane was at its in-flight cap when the plan started
#: strict: how often a plan waiting for the plane's room looks again (transfers end at a decode worker's first output)
PLANE_POLL_S = 0.01
_REFUSALS = (FinishReason.UNAVAILABLE, FinishReason.ERROR)


class TransferObserver(Protocol):
    """Told of each transfer the flow runs (the transfer plane's in-flight accounting)."""

    #: ``routing.fallback_to_local: false``: never prefill on the decode worker (module docstring)
    strict: bool

    def on_planned(self, plan: PdPlan) -> None:
        """A plan was handed to the flow; its prefill half starts in a task, after this call returns."""

    def on_transfer_start(self, request_id: str, plan: PdPlan, decode_worker: str, now: float) -> bool:
        """A plan starts (its prefill half first): True to go on, False when the plane has no room
        for its transfer now (the request then prefills on its decode worker: backpressure; strict:
        it waits and asks again)."""

    def on_transfer_end(self, request_id: str, plan: PdPlan, ok: bool, cause: str, nbytes: int, seconds: float,
                        now: float, pull: KvPull | None = None) -> None:
        """``cause`` is "ok" or a fallback cause; ``nbytes`` the plan's bytes when ok, else 0;
        ``pull`` the decode worker's own measure of its pull, when it moved the bytes itself."""


class RelayQueue(FollowingQueue):
    """The queue the fleet reads for a disaggregated request. Its liveness facts follow the queue
    of the half in progress (``source``); the flow touches it itself while it watches the prefill."""

    def __init__(self, now: float) -> None:
        self._accepted = False
        super().__init__(now)  # ``source``: the decode half's queue, once submitted

    @property  # type: ignore[override]
    def accepted(self) -> bool:
        # only the decode half counts: a request cut while prefilling elsewhere is routed again
        return self._accepted or (self.source is not None and self.source.accepted)

    @accepted.setter
    def accepted(self, value: bool) -> None:
        self._accepted = value


class PdAttempt:
    """The fleet's handle on a disaggregated request: the decode worker's, with an ``abort`` that
    also stops the prefill half. ``decode`` is the worker the request belongs to (``Fleet`` finds a
    worker's requests through it)."""

    def __init__(self, request_id: str, plan: PdPlan, decode: WorkerHandle) -> None:
        self.worker_id = decode.worker_id
        self.decode = decode
        self.plan = plan
        self.request_id = request_id
        self.prefill: WorkerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        #: strict: the worker at fault when the attempt ended ``UNAVAILABLE`` (routing again leaves it out)
        self.blamed = decode.worker_id
        #: the transfer's end as reported to the observer: (ok, cause); None until then
        self.outcome: tuple[bool, str] | None = None

    def start(self) -> None:  # the decode worker's own lifecycle is the fleet's business
        pass

    async def stop(self) -> None:
        pass

    def submit(self, req: EngineRequest) -> OutputQueue:
        return self.decode.submit(req)

    def abort(self, request_id: str) -> None:
        # the prefill half is aborted here, not when the task unwinds: the fleet may submit this
        # request id again at once (routed again), possibly to the prefill worker itself
        if self.prefill is not None:
            self.prefill.abort(request_id)
            self.prefill = None
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the task reports the transfer's end
        self.decode.abort(request_id)

    def snapshot(self) -> Snapshot | None:
        return self.decode.snapshot()


class DisaggFlow:
    """Runs plans on the fleet's workers (``workers``: the fleet's live map, read at each step)."""

    def __init__(self, workers: Mapping[str, WorkerHandle], metrics: Metrics, clock: Callable[[], float],
                 loop_lag: LoopLag, *, observer: TransferObserver | None = None,
                 prefill_timeout: float = PREFILL_TIMEOUT_S, stall_timeout: float = STALL_TIMEOUT_S) -> None:
        self.workers = workers
        self.metrics = metrics
        self.clock = clock
        self.loop_lag = loop_lag  # the fleet's: silence is judged on on-time loop, as its stall rule is
        self.observer = observer
        self.prefill_timeout = prefill_timeout
        # half the fleet's stall rule: a silent prefill worker falls back here before the fleet
        # would cut the whole request
        self.silence_s = stall_timeout / 2
        self.tick_s = min(KEEPALIVE_S, self.silence_s / 2)

    def submit(self, d: Dispatch, decode: WorkerHandle) -> tuple[WorkerHandle, OutputQueue]:
        """Start ``d`` on ``decode`` (its decision's worker): as planned when ``d.pd`` is set, else
        plainly. Returns the handle and queue the fleet keeps for the request."""
        plan = d.pd
        if plan is None or plan.prefill_worker == decode.worker_id:
            return decode, decode.submit(d.request)
        attempt = PdAttempt(d.request.request_id, plan, decode)
        if self.observer is not None:
            self.observer.on_planned(plan)
        relay = RelayQueue(self.clock())
        attempt.task = asyncio.create_task(self._run(attempt, d.request, relay), name=f"pd-{d.request.request_id}")
        return attempt, relay

    async def run_plan(self, req: EngineRequest, plan: PdPlan, decode: WorkerHandle) -> tuple[bool, str, TokenOutput]:
        """Run one plan for no client (a link warm-up: ``control/link_warmup.py``), with the halves, plane
        accounting and fallbacks of a routed request's: whether its transfer landed (and the cause when not) and
        the finished output a client would have got. Cancelled, it aborts both halves."""
        a = PdAttempt(req.request_id, plan, decode)
        if self.observer is not None:
            self.observer.on_planned(plan)
        relay = RelayQueue(self.clock())
        a.task = asyncio.create_task(self._run(a, req, relay), name=f"pd-{req.request_id}")
        out = None
        try:
            while not (out := await relay.get()).finished:
                pass
        finally:
            if out is None or not out.finished:  # cut short: stop both halves
                a.abort(req.request_id)
        ok, cause = a.outcome if a.outcome is not None else (False, ABORTED)
        return ok, cause, out

    # -- the two halves -------------------------------------------------------------------------
    async def _run(self, a: PdAttempt, req: EngineRequest, relay: RelayQueue) -> None:
        t0 = self.clock()
        obs = self.observer
        strict = obs is not None and obs.strict
        if obs is not None and not obs.on_transfer_start(a.request_id, a.plan, a.worker_id, t0):
            a.outcome = (False, PLANE_FULL)  # (until the plane takes it: strict waits for room)
            if strict:
                if not await self._wait_room(a, relay, t0 + self.prefill_timeout):
                    self._reroute(a, relay, PLANE_FULL, a.worker_id)
                    return
                t0 = self.clock()  # the transfer's seconds start once the plane took it
            else:
                self.metrics.pd_fallbacks.labels(PLANE_FULL).inc()  # backpressure: the plane is at its cap
                await self._relay(a.decode.submit(req), relay, None)
                return
        self.metrics.pd_started.inc()
        ended = False

        def end(ok: bool, cause: str, pull: KvPull | None = None) -> None:
            nonlocal ended
            ended = True
            a.outcome = (ok, cause)
            now = self.clock()
            self.metrics.observe_pd_end(ok, cause, now - t0)
            if pull is not None and ok:
                self.metrics.observe_kv_pull(pull)
            if self.observer is not None:
                self.observer.on_transfer_end(a.request_id, a.plan, ok, cause, a.plan.transfer_bytes if ok else 0,
                                              now - t0, now, pull)

        try:
            transfer, cause = await self._prefill(a, req, relay)
            if transfer is None:
                end(False, cause)
                if strict:
                    log.warning("request %s: remote prefill on %s failed (%s): routing it again", a.request_id,
                                a.plan.prefill_worker, cause)
                    self._reroute(a, relay, cause, a.plan.prefill_worker)
                    return
                log.warning("request %s: remote prefill on %s failed (%s): prefilling on %s", a.request_id,
                            a.plan.prefill_worker, cause, a.worker_id)
                self.metrics.pd_fallbacks.labels(cause).inc()
                await self._relay(a.decode.submit(req), relay, None)
            elif (refused := await self._relay(a.decode.submit(replace(req, kv_from=transfer)), relay, end)):
                # the decode worker refused the transfer before any output (vLLM: HTTP 500 for an
                # engine id it cannot reach; a simulated worker: its pull of the bytes failed): the
                # same worker prefills it itself (strict: it is routed again, without that worker)
                if strict:
                    log.warning("request %s: %s refused the KV transfer (%s): routing it again", a.request_id,
                                a.worker_id, refused)
                    self._reroute(a, relay, refused, a.worker_id)
                    return
                log.warning("request %s: %s refused the KV transfer (%s): prefilling there", a.request_id,
                            a.worker_id, refused)
                self.metrics.pd_fallbacks.labels(refused).inc()
                await self._relay(a.decode.submit(req), relay, None)
        except asyncio.CancelledError:
            if not ended:
                end(False, ABORTED)
            raise

    async def _wait_room(self, a: PdAttempt, relay: RelayQueue, deadline: float) -> bool:
        """Strict: wait until the plane takes the plan's transfer (True), or ``deadline`` (False)."""
        assert self.observer is not None
        while True:
            await asyncio.sleep(PLANE_POLL_S)
            now = self.clock()
            relay.touch(now)  # waiting on purpose: the fleet's stall rule must not cut it
            if self.observer.on_transfer_start(a.request_id, a.plan, a.worker_id, now):
                return True
            if now >= deadline:
                return False

    def _reroute(self, a: PdAttempt, relay: RelayQueue, cause: str, blamed: str) -> None:
        """Strict: end the relay ``UNAVAILABLE`` before any output: the fleet routes the request again
        without ``blamed``."""
        a.blamed = blamed
        self.metrics.pd_rerouted.labels(cause).inc()
        now = self.clock()
        relay.source = None
        relay.put_output(TokenOutput(a.request_id, [], now, 0, 0, True, FinishReason.UNAVAILABLE), now)

    async def _prefill(self, a: PdAttempt, req: EngineRequest,
                       relay: RelayQueue) -> tuple[KvTransfer | None, str]:
        """Run the prefill half; its transfer, or None and why not."""
        worker = self.workers.get(a.plan.prefill_worker)
        if worker is None:
            return None, GONE
        a.prefill = worker
        q = worker.submit(replace(req, remote_decode=True, kv_from=None))
        deadline = self.clock() + self.prefill_timeout
        # one getter across the watch ticks (a wait_for per tick could drop an output that arrives
        # just as the tick times out)
        getter = asyncio.ensure_future(q.get())
        try:
            while True:
                asked = self.clock()
                done, _ = await asyncio.wait((getter,), timeout=self.tick_s)
                now = self.clock()
                relay.touch(now)  # the flow is watching: the fleet's stall rule waits for it
                if not done:
                    if self.workers.get(a.plan.prefill_worker) is not worker:
                        return None, GONE
                    # while our loop is starved, what the worker sent waits unread in a socket: this
                    # watch's late wake-up is loop lag (the health loop's may not be recorded yet)
                    self.loop_lag.tick(asked + self.tick_s, now)
                    if self.loop_lag.silent_for(q.last_heard, now) > self.silence_s:
                        return None, SILENT
                    if now >= deadline:
                        return None, TIMEOUT
                    continue
                out = getter.result()
                if not out.finished:  # an engine streaming its one token before the finished output
                    getter = asyncio.ensure_future(q.get())
                    continue
                a.prefill = None  # done there: nothing to abort
                if out.finish_reason == FinishReason.UNAVAILABLE:
                    return None, UNAVAILABLE
                if out.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                    return None, FAILED
                if out.kv_transfer is None:
                    return None, NO_TRANSFER
                return out.kv_transfer, "ok"
        finally:
            getter.cancel()
            if a.prefill is not None:  # failed while it ran: stop it there
                a.prefill.abort(a.request_id)
                a.prefill = None

    @staticmethod
    async def _relay(q: OutputQueue, relay: RelayQueue, end: Callable[[bool, str, KvPull | None], None] | None
                     ) -> str | None:
        """Copy the decode half's outputs to the fleet's queue. With ``end`` (a transfer's decode
        half), the transfer is reported at the first output, and a refusal before any output
        (``UNAVAILABLE`` / ``ERROR``, no token) is not passed on: its cause is returned (the
        worker's pull's, else ``DECODE_REFUSED``), the caller falls back. None: relayed to the end."""
        relay.source = q
        while True:
            out: TokenOutput = await q.get()
            if end is not None:
                refused = out.finished and not out.token_ids and out.finish_reason in _REFUSALS
                pull = out.kv_pull
                cause = (pull.cause if pull is not None and pull.cause != "ok" else DECODE_REFUSED) if refused else "ok"
                end(not refused, cause, pull)
                end = None
                if refused:
                    relay.source = None
                    return cause
            relay.put_output(out, q.last_heard)
            if out.finished:
                return None

