"""The simulator's side of prefill/decode disaggregation: prefill jobs, transfers on the virtual
clock, local fallbacks.

The decision is the dispatcher's (``scheduler/disagg.py``) and the plane's (``transfer/plane.py``);
this module only carries a plan out, as the live fleet does with real workers:

1. the request's prefill job (``remote_decode``, one token) goes to the plan's prefill engine;
2. when it ends, its :class:`KvTransfer` starts on the plane (or waits behind the in-flight cap);
   the decode worker's memory is checked again first (``target_full``);
3. the transfer takes ``bytes / bandwidth + latency`` of virtual time (the true link, which
   ``PdFaults.slow_link`` slows down while the plane's estimate does not know it); past the plane's
   deadline it is cut (``timeout``); ``PdFaults.interrupt_p`` fails it halfway (``interrupted``);
4. the prefill engine unpins the blocks; the request goes to the decode engine with ``kv_from``, or,
   after any failure, without it: it prefills there (local fallback, counted by cause).

Strict (``routing.fallback_to_local: false``, the disaggregator's ``strict``): a decode worker never
prefills. A failure is routed again through the driver's ``reroute`` without the worker at fault (the
prefill worker for ``prefill_failed``, else the decode worker), counted by cause in ``rerouted``; the
router may refuse it then (no other prefill worker, no room), and it ends without a token, as the live
relay's ``UNAVAILABLE`` does. A transfer waiting for the plane's cap waits (both modes).

Every request completes or, strict, is refused: no failure path drops one.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.scheduler.disagg import Disaggregator
from thunderagent.transfer.plane import Transfer
from thunderagent.types import EngineRequest, KvTransfer, TokenOutput

JOB_SUFFIX = "#prefill"


@dataclass(slots=True, frozen=True)
class PdFaults:
    """Injected failures (tests, robustness runs)."""

    slow_link: float = 1.0  # true transfer time = the configured link's time x this
    interrupt_p: float = 0.0  # a transfer fails halfway with this probability
    target_full_p: float = 0.0  # the decode worker looks full when a transfer is about to start
    seed: int = 0

    def __post_init__(self) -> None:
        if self.slow_link <= 0:
            raise ValueError(f"slow_link must be > 0, got {self.slow_link}")
        for name in ("interrupt_p", "target_full_p"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be within [0, 1], got {v}")


@dataclass(slots=True)
class _Job:
    req: EngineRequest  # the client's request (decoded on ``decode``)
    prefill: int  # engine index
    decode: int
    dispatch: Dispatch  # the plan's dispatch (strict: ``reroute`` retracts its decode worker's predicted blocks)
    kv: KvTransfer | None = None
    transfer: Transfer | None = None
    ok: bool = True
    cause: str = ""


class PdSim:
    def __init__(self, engines: list[SimulatedEngine], pos: dict[str, int], disagg: Disaggregator,
                 faults: PdFaults) -> None:
        self.engines = engines
        self.pos = pos
        self.disagg = disagg
        self.plane = disagg.plane
        self.faults = faults
        self.rng = random.Random(faults.seed)
        self.jobs: dict[str, _Job] = {}  # by job id (request id + JOB_SUFFIX)
        self.heap: list[tuple[float, int, str]] = []  # (transfer end, tie-break, job id)
        self._n = 0
        self.touched: list[int] = []  # engines given a request since the driver last looked
        self.remote = 0  # requests decoded with a moved KV
        #: per request decoded with a moved KV: prompt tokens moved (its engine counts them as cached; the
        #: run's prefix reuse does not)
        self.moved: dict[str, int] = {}
        self.inflight_trace: list[int] = []  # in-flight transfers after every plane change (tests)
        self.strict = disagg.strict
        #: strict: routes a dispatch's request again without a worker (its blocks predicted on the decode worker
        #: retracted first: they never arrived); the engine given work, -1 when refused (the driver's)
        self.reroute: Callable[[Dispatch, str, float], int] | None = None
        self.rerouted: dict[str, int] = {}  # strict: failures routed again, by cause

    def place(self, d: Dispatch, now: float) -> int:
        """Start ``d``'s plan: its prefill job on the prefill engine (returned)."""
        assert d.pd is not None
        req = d.request
        p, dec = self.pos[d.pd.prefill_worker], self.pos[d.decision.worker_id]
        jid = req.request_id + JOB_SUFFIX
        self.jobs[jid] = _Job(req, p, dec, d)
        job = replace(req, request_id=jid, max_tokens=1, remote_decode=True, kv_from=None)
        self.engines[p].add_request(job, now)
        return p

    def job_output(self, o: TokenOutput, now: float) -> None:
        """An output of a prefill job: on its end, its transfer starts (or the request falls back)."""
        if not o.finished:
            return
        job = self.jobs[o.request_id]
        if o.kv_transfer is None:
            return self._fallback(o.request_id, job, "prefill_failed", now, blame_prefill=True)
        job.kv = o.kv_transfer
        dec = self.engines[job.decode]
        bm = dec.blocks
        have = bm.match_prefix(job.kv.block_hashes, len(job.kv.block_hashes))[0]
        blocks = len(job.kv.block_hashes) - have
        nbytes = self.plane.bytes_for(blocks * dec.block_size)
        why = self.plane.refusal(nbytes, blocks, bm.active_blocks, bm.num_blocks)
        if self.faults.target_full_p and self.rng.random() < self.faults.target_full_p:
            why = "target_full"
        if why is not None:
            return self._fallback(o.request_id, job, why, now)
        src, dst = self.engines[job.prefill].worker_id, dec.worker_id
        t = self.plane.start(o.request_id, src, dst, nbytes, now)
        self.inflight_trace.append(len(self.plane.inflight))
        if t is not None:
            self._schedule(t, now)

    def next_time(self) -> float:
        return self.heap[0][0] if self.heap else float("inf")

    def complete(self, now: float) -> list[int]:
        """Transfers ending at ``now``: their requests go to their decode engines (returned)."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, jid = heapq.heappop(heap)
            job = self.jobs[jid]
            for t in self.plane.finish(jid, now, ok=job.ok, cause=job.cause):
                self._schedule(t, now)
            self.inflight_trace.append(len(self.plane.inflight))
            if job.ok:
                self._decode(jid, job, now)
            else:
                self._fallback(jid, job, job.cause, now)
        return self.take_touched()

    def take_touched(self) -> list[int]:
        out, self.touched = self.touched, []
        return out

    def _schedule(self, t: Transfer, now: float) -> None:
        """The transfer's true end on the virtual clock, and whether it succeeds."""
        job = self.jobs[t.tid]
        cfg = self.plane.cfg
        true_s = t.nbytes / self.plane.default_bps * self.faults.slow_link + cfg.latency_s
        end = now + true_s
        if self.faults.interrupt_p and self.rng.random() < self.faults.interrupt_p:
            end, job.ok, job.cause = now + true_s / 2, False, "interrupted"
        if end > t.deadline:
            end, job.ok, job.cause = t.deadline, False, "timeout"
        self._n += 1
        heapq.heappush(self.heap, (end, self._n, t.tid))

    def _decode(self, jid: str, job: _Job, now: float) -> None:
        self.engines[job.prefill].release_transfer(jid)
        del self.jobs[jid]
        kv = job.kv
        assert kv is not None
        job.req.kv_from = kv
        self.remote += 1
        dec = self.engines[job.decode]
        cap = (len(job.req.prompt_tokens) - 1) // dec.block_size  # the engine recomputes the last token
        have = dec.blocks.match_prefix(kv.block_hashes, cap)[0]
        self.moved[job.req.request_id] = (min(len(kv.block_hashes), cap) - have) * dec.block_size
        dec.add_request(job.req, now)
        self.touched.append(job.decode)

    def _fallback(self, jid: str, job: _Job, cause: str, now: float, blame_prefill: bool = False) -> None:
        self.engines[job.prefill].release_transfer(jid)
        del self.jobs[jid]
        if self.strict:
            assert self.reroute is not None  # (the driver's, set when it builds this)
            self.rerouted[cause] = self.rerouted.get(cause, 0) + 1
            blamed = self.engines[job.prefill if blame_prefill else job.decode].worker_id
            j = self.reroute(job.dispatch, blamed, now)
            if j >= 0:
                self.touched.append(j)
            return
        self.plane.fallback(cause)
        self.engines[job.decode].add_request(job.req, now)
        self.touched.append(job.decode)

    def stats(self) -> dict[str, object]:
        return {"remote_prefills": self.remote, "decisions": dict(self.disagg.outcomes),
                "plane": self.plane.stats.as_dict(),
                "kv_imported_blocks": sum(e.kv_imported_blocks for e in self.engines),
                "kv_import_failed": sum(e.kv_import_failed for e in self.engines),
                **({"rerouted": dict(self.rerouted)} if self.strict else {})}
