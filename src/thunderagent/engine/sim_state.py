"""Per-request and per-pass state records of the simulated engine (kept apart so the engine
module stays about scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from thunderagent.types import EngineRequest, KvEvent


class SeqState(IntEnum):
    """Where a request is inside the simulated engine."""

    BUFFERED = 0  # arrived, not yet due (arrival after the pass being packed)
    WAITING = 1
    RUNNING = 2
    DONE = 3


class ScheduleResult(IntEnum):
    """What scheduling one request into a pass did."""

    SCHEDULED = 0
    BLOCKED = 1  # no room: stop packing
    SELF_PREEMPTED = 2  # it preempted itself out of ``running``


# Module-level names for the engine's hot loops: a global load is cheaper than an attribute lookup.
BUFFERED, WAITING, RUNNING, DONE = SeqState
SCHEDULED, BLOCKED, SELF_PREEMPTED = ScheduleResult
NEVER = -(1 << 62)


@dataclass(slots=True, eq=False)
class _Seq:
    """Engine-side state of one request."""

    req: EngineRequest
    plen: int  # prompt tokens
    hashes: list[int]  # hashes of the full blocks known so far (prompt's, then generated ones)
    seed: int  # text seed
    natural: int  # index of the EOS token, -1 with ignore_eos
    arrival_ns: int
    own_hashes: bool = False  # ``hashes`` is our copy (the prompt's list is shared with the frontend)
    generated: int = 0
    computed: int = 0  # tokens whose KV is computed (or reused from cache)
    table: list[int] = field(default_factory=list)  # physical block ids, in sequence order
    cached: int = 0  # prompt tokens reused from cache, max over admissions
    state: int = BUFFERED
    s_pass: int = -1  # pass that last scheduled it, and ``computed`` before that (to undo a preemption)
    s_before: int = 0
    expect: int = 0  # prompt tokens expected from cache while queued (load reporting only)


@dataclass(slots=True)
class PassInfo:
    """What one forward pass held: for metrics and tests."""

    start: float  # seconds
    end: float
    prefill_tokens: int  # T: new prompt tokens in the batch
    decode_kv_tokens: int  # A: summed sequence length of the decoding requests
    num_prefills: int
    num_decodes: int
    scheduled_tokens: int


@dataclass(slots=True, eq=False)
class _Pass:
    """Accumulators of the pass being packed."""

    pid: int
    budget: int
    n_pf: int = 0
    isl: int = 0  # sum of (prefix + chunk) over prefill entries
    prefix: int = 0  # sum of prefix over prefill entries
    A: int = 0
    n_dec: int = 0
    preempted: int = 0
    progress: bool = False
    emit: list[_Seq] = field(default_factory=list)
    rejected: list[_Seq] = field(default_factory=list)
    events: list[KvEvent] = field(default_factory=list)
