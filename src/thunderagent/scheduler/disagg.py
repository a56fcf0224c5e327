"""Conditional prefill/decode disaggregation: per request, prefill on the prefill pool and move the
KV, or prefill where the request decodes.

Pure and synchronous; called by :class:`~thunderagent.scheduler.dispatch.Dispatcher` after the decode
worker was chosen (cache-aware, on the decode + both pool: a conversation's context lives there), so
both drivers share it. The prefill worker is chosen by the same :class:`KvRouter` on the prefill
pool (cache- and queue-aware). One index covers every role: the prompt's blocks are predicted on the
decode worker (by its routing) and, when the plan is remote, on the prefill worker too.

Modes (``routing.disaggregation.mode``):

* ``never``: every request prefills where it decodes.
* ``always``: every request whose decode worker lacks a full block of its prompt prefills remotely,
  unless the plane refuses the move (cache too large, decode worker's memory over the watermark); a
  full plane makes it wait for a slot.
* ``conditional``: remote only when it pays: the decode worker lacks more than
  ``min_uncached_tokens`` tokens, the plane would start the transfer at once, the chosen prefill
  worker's queue is under ``max_prefill_queue_passes`` passes, the transfer's estimate is below
  the prefill time it saves the decode worker (the engine's timing model on the uncached tokens),
  and the remote path's estimated TTFT (prefill backlog + prefill + transfer) is at most
  ``max_ttft_cost_s`` above the local one (decode backlog + prefill).

Whatever the decision, its one-line reason joins the routing decision's; a remote plan's numbers
are in ``Decision.pd`` (``explain()`` shows them).

Strict (``routing.fallback_to_local: false``, mode ``always`` only): a decode worker never prefills
what it does not hold. Where ``always`` would prefill locally for want of a prefill worker or of
room (the plane refuses the move: too large, or the decode worker's memory over the watermark), the
plan raises :class:`NoWorkerAvailable` instead: the request waits in the holding queue or is refused
with a retry time. A prompt the decode worker holds in full still runs there (only its tail is
computed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from thunderagent.config import Config, DisaggConfig, Role
from thunderagent.engine.timing import TimingModel, make_timing
from thunderagent.router.candidates import FleetView
from thunderagent.router.cost import is_busy
from thunderagent.router.router import KvRouter, NoWorkerAvailable
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import Decision, PdPlan, RouteRequest, WorkerState

PREFILL = Role.prefill.value


class Disaggregator:
    def __init__(self, cfg: DisaggConfig, plane: TransferPlane, timing: TimingModel, block_size: int,
                 strict: bool = False) -> None:
        self.cfg = cfg
        #: ``routing.fallback_to_local: false``: never a local prefill for want of a prefill worker or of room
        self.strict = strict
        self.plane = plane
        self.timing = timing
        self.block_size = block_size
        #: decisions by outcome: remote, or why local (short, too_large, target_full, plane_full,
        #: prefill_busy, not_paying, slower, cached, never)
        self.outcomes: dict[str, int] = {}

    def plan(self, router: KvRouter, req: RouteRequest, decision: Decision, decode: WorkerState,
             prefill_pool: Sequence[WorkerState], route_prefill: Callable[[], Decision],
             now: float) -> tuple[PdPlan | None, str]:
        """The plan for ``req``, routed to ``decode`` by ``decision`` (None: prefill locally), and
        a one-line reason. ``route_prefill``: the dispatcher's routing of ``req`` on the prefill pool
        without a prediction (routing is decided in the dispatcher only), called when needed."""
        mode = self.cfg.mode
        if mode == "never" or not prefill_pool:
            return self._local("never", "prefill local (disaggregation never)")
        conditional = mode == "conditional"
        bs = self.block_size
        n = req.num_tokens
        full = n // bs
        have = min(decision.overlap_blocks, full)
        blocks = full - have
        if blocks <= 0:
            return self._local("cached", "prefill local: the decode worker holds every full block")
        uncached = n - have * bs
        if conditional and uncached <= self.cfg.min_uncached_tokens:
            return self._local("short", f"prefill local: {uncached} uncached tokens <= min_uncached_tokens")
        plane = self.plane
        tokens = blocks * bs
        nbytes = plane.bytes_for(tokens)
        load = decode.load
        why = plane.refusal(nbytes, blocks, load.kv_active_blocks, load.kv_total_blocks)
        if why is not None:  # (lasting: refused even with the decode worker empty, so no wait helps)
            return self._local(why, f"prefill local: transfer refused ({why}, {nbytes} bytes)",
                               lasting=plane.refusal(nbytes, blocks, 0, load.kv_total_blocks) is not None)
        if conditional and not plane.room(nbytes):
            return self._local("plane_full", "prefill local: transfer plane at its in-flight cap")
        try:
            pd = route_prefill()
        except NoWorkerAvailable:
            return self._local("prefill_busy", "prefill local: every prefill worker is busy")
        p = next(w for w in prefill_pool if w.worker_id == pd.worker_id)
        if conditional:
            limit = self.cfg.max_prefill_queue_passes * p.max_num_batched_tokens
            if is_busy(p, router.cfg) or p.load.queued_prefill_tokens > limit:
                return self._local("prefill_busy", f"prefill local: {p.worker_id} has "
                                   f"{p.load.queued_prefill_tokens} queued prefill tokens (limit {limit:.0f})")
        est = plane.estimate(p.worker_id, decode.worker_id, nbytes)
        saved = self.timing.pass_time(uncached, 0, 1, False)
        if conditional and est >= saved:
            return self._local("not_paying", f"prefill local: transfer {est * 1e3:.1f} ms >= prefill it saves "
                               f"{saved * 1e3:.1f} ms")
        if conditional:
            remote = self._backlog_s(p) + self.timing.pass_time(n - pd.overlap_blocks * bs, 0, 1, False) + est
            local = self._backlog_s(decode) + saved
            if remote > local + self.cfg.max_ttft_cost_s:
                return self._local("slower", f"prefill local: TTFT ~{local * 1e3:.0f} ms here, ~{remote * 1e3:.0f} "
                                   f"ms via {p.worker_id}")
        if req.block_hashes:
            router.index.predict(p.worker_id, req.block_hashes, now, req.check_hashes)
        self._count("remote")
        reason = (f"prefill on {p.worker_id} ({pd.overlap_blocks} blocks cached there), {tokens} tokens "
                  f"({nbytes} bytes) moved in ~{est * 1e3:.1f} ms, saving ~{saved * 1e3:.1f} ms of prefill here")
        return PdPlan(p.worker_id, tokens, nbytes, est, saved, reason), reason

    def _backlog_s(self, w: WorkerState) -> float:
        """Seconds for ``w`` to prefill what it has queued, in full passes (the timing model's)."""
        q, m = w.load.queued_prefill_tokens, w.max_num_batched_tokens
        return q / m * self.timing.pass_time(m, 0, 1, False) if q > 0 else 0.0

    def _local(self, outcome: str, reason: str, lasting: bool = False) -> tuple[None, str]:
        """No remote prefill: prefill on the decode worker. Strict, only a prompt it holds in full (``cached``)
        goes there; anything else is refused (:class:`NoWorkerAvailable`, counted ``refused_<outcome>``;
        ``lasting``: no wait would change it)."""
        if self.strict and outcome != "cached":
            self._count(f"refused_{outcome}")
            raise NoWorkerAvailable(f"{reason.removeprefix('prefill local: ')}, and routing.fallback_to_local is "
                                    "false: a decode worker never prefills", lasting=lasting)
        self._count(outcome)
        return None, reason

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def split_pools(workers: Sequence[WorkerState]) -> tuple[Sequence[WorkerState], list[WorkerState]]:
    """(workers that serve requests end to end: decode and both, the prefill pool)."""
    if isinstance(workers, FleetView):  # the fleet's maintained view knows without a scan (1,000 workers: ~50 µs)
        if not workers.prefill_workers:
            return workers, []
    elif not any(w.role == PREFILL for w in workers):  # the common case: no copy
        return workers, []
    return [w for w in workers if w.role != PREFILL], [w for w in workers if w.role == PREFILL]


def make_disaggregator(cfg: Config) -> Disaggregator | None:
    """The fleet's disaggregator (None without a ``role: prefill`` group): the plane from the prefill
    group's ``kv_cache_transfer``, the saved-prefill estimate from a decoding group's timing model."""
    nodes = cfg.execution_group.nodes
    prefill = [n for n in nodes if n.role is Role.prefill]
    if not prefill:
        return None
    decode = next(n for n in nodes if n.role is not Role.prefill)
    return Disaggregator(cfg.routing.disaggregation, TransferPlane(prefill[0].kv_cache_transfer),
                         make_timing(decode.timing), decode.block_size, strict=not cfg.routing.fallback_to_local)
