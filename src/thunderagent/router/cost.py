"""The KV-aware cost of sending a request to a worker.

Cost is in *prefill-token equivalents* (the unit the engine's pass time grows with):

    cost = w_prefill * (prompt_tokens - credit * cached_tokens)
         + w_queue   * queued_prefill_tokens
         + w_decode  * decode_tokens
         + w_memory  * over_watermark * max_num_batched_tokens
         + w_prefill * contention * (waiting_requests + held) * (best_cached_tokens - cached_tokens)

* ``cached_tokens`` is the worker's leading overlap (index match) in tokens. The credit shrinks as
  the worker's backlog rises above the least backlogged candidate's:
  ``credit = overlap_credit / (1 + excess_passes / credit_load_scale)``, with
  ``excess_passes = (queued_prefill_tokens - min queued over candidates) / max_num_batched_tokens``.
  A hit on a worker passes behind the others buys less than the same hit elsewhere, which keeps a
  hot prefix from pinning every request onto one drowning worker. The shrink is *relative*: when
  the whole fleet is backlogged, hits are worth the most (they cut the work everyone waits for),
  and an absolute shrink would turn overload into cache thrashing.
* ``over_watermark = (kv_usage - watermark) / (1 - watermark)`` above the watermark, else 0: a
  worker near memory exhaustion would evict (or preempt) to admit us, so it costs up to one extra
  full pass of work.
* ``held``: requests the scheduler's holding queue keeps behind this one, per routable worker
  (``RouteRequest.held``). They wait for this fleet as surely as an engine's waiting requests do,
  but no engine reports them: with the queue on, engines hold at most a request or two, and without
  this term a saturated fleet would look idle to the contention charge (we measured the chosen
  worker's cache hits fall from 28 % of prompt tokens known to the index to 14 % on the Mooncake
  trace at x8; README, "Scheduler").
* A worker is *busy* (filtered out) when its waiting queue reached ``queue_depth_threshold`` or its
  KV usage reached ``busy_kv_usage``.

Pure functions over plain data; no I/O, no clock.
"""

from __future__ import annotations

from thunderagent.config import RoutingConfig
from thunderagent.decision import CandidateScore
from thunderagent.types import WorkerState


def queued_prefill(w: WorkerState) -> int:
    return w.load.queued_prefill_tokens


def is_busy(w: WorkerState, cfg: RoutingConfig) -> bool:
    return w.load.waiting >= w.queue_depth_threshold or (
        w.load.kv_usage >= cfg.busy_kv_usage
    )


def load_key(w: WorkerState) -> tuple[int, int, int]:
    """Ordering of workers by load, for least_loaded / power_of_two and tie-breaks."""
    return (
        w.load.running + w.load.waiting,
        queued_prefill(w),
        w.load.decode_tokens,
    )


def base_load(w: WorkerState, cfg: RoutingConfig) -> float:
    """The part of a worker's cost that does not depend on the request: queue, decode and memory
    terms. A worker holding none of the request's blocks costs at least
    ``weights.prefill * num_tokens + base_load`` (the contention term is >= 0): the fleet view
    (``router/candidates.py``) orders free workers by it, and the router stops scoring them once that
    bound exceeds the best cost found."""
    weights = cfg.weights
    usage = w.load.kv_usage
    over = 0.0
    if usage > cfg.memory_watermark and cfg.memory_watermark < 1.0:
        over = min(1.0, (usage - cfg.memory_watermark) / (1.0 - cfg.memory_watermark))
    return (
        weights.queue * w.load.queued_prefill_tokens
        + weights.decode * w.load.decode_tokens
        + weights.memory * over * w.max_num_batched_tokens
    )


def round_half_even(x: float) -> int:
    """``round(x)``, exactly (halves to even). Compiled, ``round`` is a generic call on a boxed float; this is
    native arithmetic. ``x - int(x)`` is exact for any float below 2**52, so the half test is too."""
    n = int(x)
    frac = x - n
    if frac > 0.5 or (frac == 0.5 and n & 1):
        return n + 1
    if frac < -0.5 or (frac == -0.5 and n & 1):
        return n - 1
    return n


#: the cost's constants, read off ``RoutingConfig`` once per decision (:func:`cost_terms`): weights
#: prefill, queue, decode, memory, overlap_credit, credit_load_scale, contention, then memory_watermark
#: and busy_kv_usage
CostTerms = tuple[float, float, float, float, float, float, float, float, float]


def cost_terms(cfg: RoutingConfig) -> CostTerms:
    w = cfg.weights
    return (w.prefill, w.queue, w.decode, w.memory, w.overlap_credit, w.credit_load_scale, w.contention,
            cfg.memory_watermark, cfg.busy_kv_usage)


def score(
    w: WorkerState,
    num_tokens: int,
    overlap_blocks: int,
    cfg: RoutingConfig,
    min_queued: int = 0,
    best_cached: int = 0,
    held: int = 0,
) -> CandidateScore:
    return score_terms(w, num_tokens, overlap_blocks, cost_terms(cfg), min_queued, best_cached, held)


def score_terms(
    w: WorkerState,
    num_tokens: int,
    overlap_blocks: int,
    terms: CostTerms,
    min_queued: int = 0,
    best_cached: int = 0,
    held: int = 0,
) -> CandidateScore:
    """:func:`score` with the config's constants read once (``cost_terms``): a decision scoring several
    workers reads the frozen config once instead of nine attributes per worker."""
    # Hot path (once per scored worker per decision): builtins and properties inlined, the
    # arithmetic kept term for term as written in the module docstring (the fleet view's bound and
    # the tests rely on exact values).
    prefill_w, queue_w, decode_w, memory_w, overlap_credit, credit_load_scale, contention_w, watermark, busy_usage \
        = terms
    load = w.load
    mnbt = w.max_num_batched_tokens
    cached = overlap_blocks * w.block_size
    if cached > num_tokens:
        cached = num_tokens
    queued = load.queued_prefill_tokens
    excess = queued - min_queued
    excess_passes = (excess if excess > 0 else 0) / mnbt
    credit = overlap_credit / (1.0 + excess_passes / credit_load_scale)
    prefill = num_tokens - credit * cached
    total = load.kv_total_blocks
    usage = load.kv_active_blocks / total if total else 0.0  # LoadReport.kv_usage
    over = 0.0
    if usage > watermark and watermark < 1.0:
        over = (usage - watermark) / (1.0 - watermark)
        if over > 1.0:
            over = 1.0
    # Contention: recomputing tokens another candidate holds (``best_cached - cached``) delays
    # this request *and* every request that will queue behind it on this worker; in steady state
    # about as many as wait there now. Idle fleet: no charge (plain TTFT-greedy). Saturated
    # fleet: avoidable recomputation is charged per waiting request, so a hit wins over queue
    # differences (fewer recomputed tokens is what raises a saturated fleet's throughput).
    # Tokens nobody holds are not charged: a miss is balanced on queue alone.
    avoidable = (best_cached if best_cached < num_tokens else num_tokens) - cached
    waiting = load.waiting
    contention = contention_w * (waiting + held) * (avoidable if avoidable > 0 else 0)
    decode = load.decode_tokens
    cost = (
        prefill_w * (prefill + contention)
        + queue_w * queued
        + decode_w * decode
        + memory_w * over * mnbt
    )
    return CandidateScore(
        w.worker_id, overlap_blocks, round_half_even(prefill), queued, decode, usage,
        waiting >= w.queue_depth_threshold or usage >= busy_usage,  # is_busy
        cost,
    )
