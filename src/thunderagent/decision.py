"""A routing decision and what explains it: every scored worker's cost terms, a hot prefix's note, a
disaggregated request's plan.

Built once per request (a score once per scored worker) on the routing hot path, so these classes have their
own module, which the build compiles (``native.py``): a compiled class is built several times faster than a
dataclass, and the compiled router reads its fields without attribute lookups. No imports from the package:
``types.py`` re-exports every class here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def literal(text: str) -> str:
    """``text`` as literal text inside a ``str.format`` string (worker ids may hold braces)."""
    return text.replace("{", "{{").replace("}", "}}")


@dataclass
class CandidateScore:
    """A worker's score for one request: the routing cost's terms (``router/cost.py``)."""

    worker_id: str
    overlap_blocks: int
    prefill_tokens: int  # uncached prompt tokens after the overlap credit
    queued_prefill_tokens: int
    decode_tokens: int
    kv_usage: float
    busy: bool
    cost: float

    # Written out (dataclass keeps a class's own __init__): compiled, a generated __init__ stays an interpreted
    # function, which took most of a score's construction time.
    def __init__(self, worker_id: str, overlap_blocks: int, prefill_tokens: int, queued_prefill_tokens: int,
                 decode_tokens: int, kv_usage: float, busy: bool, cost: float) -> None:
        self.worker_id = worker_id
        self.overlap_blocks = overlap_blocks
        self.prefill_tokens = prefill_tokens
        self.queued_prefill_tokens = queued_prefill_tokens
        self.decode_tokens = decode_tokens
        self.kv_usage = kv_usage
        self.busy = busy
        self.cost = cost


@dataclass(frozen=True)
class HotPrefixNote:
    """Why a request went to a replica of a hot prefix (``router/hot.py``)."""

    prefix_blocks: int  # the prefix: the request's leading blocks held by its deepest holders
    holders: tuple[str, ...]  # workers holding it, all overloaded when a replica was added
    replicas: tuple[str, ...]  # the prefix's replica set after this decision, oldest first
    added: bool  # this request warms a new replica


@dataclass(frozen=True)
class PdPlan:
    """A disaggregated request's plan (prefill on one worker, KV moved, decode on another).

    The decode worker is the :class:`Decision`'s ``worker_id``; a request without a plan prefills
    where it decodes. Drivers run it as: a ``remote_decode`` job on ``prefill_worker``, its
    ``KvTransfer`` moved by the transfer plane, then the request on the decode worker with
    ``kv_from`` set; any failure on the way falls back to prefilling on the decode worker."""

    prefill_worker: str
    transfer_tokens: int  # prompt tokens whose KV moves (full blocks the decode worker lacks)
    transfer_bytes: int
    estimate_s: float  # estimated transfer time on that link (bytes / bandwidth + latency)
    saved_s: float  # estimated local prefill time it saves on the decode worker
    reason: str


@dataclass  # not frozen: built once per request on the hot path (a frozen init costs more)
class Decision:
    """A routing decision and its explanation.

    The one-line reason is kept as a format string and its arguments (``why``, ``why_args``) and formatted
    when read (:attr:`reason`): most decisions are never explained, and formatting every one took about 5 %
    of a decision's time (``bench/route_decision.py``). What metrics need from it is kept as plain fields (``fallback``,
    ``busy_filtered``)."""

    request_id: str
    worker_id: str
    policy: str
    why: str  # the reason; with ``why_args``, its format string (``str.format``)
    # every routable worker's score, in the workers' order; a decision that scored part of the fleet
    # holds a lazy sequence (router/candidates.py LazyScores) that computes them on first read
    candidates: Sequence[CandidateScore] = ()
    overlap_blocks: int = 0  # blocks the winner is believed to hold
    hot_prefix: HotPrefixNote | None = None  # set when the winner is a hot prefix's replica
    best_overlap_blocks: int = 0  # the most blocks any routable worker is believed to hold
    #: workers routing left out because their breaker is open or probing (``control/breaker.py``): (id, why)
    skipped: tuple[tuple[str, str], ...] = ()
    pd: PdPlan | None = None  # prefill elsewhere, KV moved here (``scheduler/disagg.py``)
    why_args: tuple[object, ...] = ()
    fallback: bool = False  # every worker was busy: the ``routing.fallback`` rule chose
    busy_filtered: int = 0  # workers left out as busy

    # Written out, as CandidateScore's is (the defaults are the fields' above).
    def __init__(self, request_id: str, worker_id: str, policy: str, why: str,
                 candidates: Sequence[CandidateScore] = (), overlap_blocks: int = 0,
                 hot_prefix: HotPrefixNote | None = None, best_overlap_blocks: int = 0,
                 skipped: tuple[tuple[str, str], ...] = (), pd: PdPlan | None = None,
                 why_args: tuple[object, ...] = (), fallback: bool = False, busy_filtered: int = 0) -> None:
        self.request_id = request_id
        self.worker_id = worker_id
        self.policy = policy
        self.why = why
        self.candidates = candidates
        self.overlap_blocks = overlap_blocks
        self.hot_prefix = hot_prefix
        self.best_overlap_blocks = best_overlap_blocks
        self.skipped = skipped
        self.pd = pd
        self.why_args = why_args
        self.fallback = fallback
        self.busy_filtered = busy_filtered

    @property
    def reason(self) -> str:
        """The one-line reason, formatted on each read (a decision is explained at most a few times)."""
        return self.why.format(*self.why_args) if self.why_args else self.why

    def why_plus(self, text: str) -> str:
        """``why`` followed by ``"; "`` and ``text`` as literal text (braces escaped where ``why`` is a
        format string), for ``dataclasses.replace(decision, why=...)``: the reason stays unformatted."""
        return f"{self.why}; {literal(text) if self.why_args else text}"

    def explain(self) -> dict[str, object]:
        """JSON-ready explanation (returned in the response body when asked)."""
        out: dict[str, object] = {
            "worker": self.worker_id,
            "policy": self.policy,
            "reason": self.reason,
            "overlap_blocks": self.overlap_blocks,
            "candidates": [
                {
                    "worker": c.worker_id,
                    "overlap_blocks": c.overlap_blocks,
                    "prefill_tokens": c.prefill_tokens,
                    "queued_prefill_tokens": c.queued_prefill_tokens,
                    "decode_tokens": c.decode_tokens,
                    "kv_usage": round(c.kv_usage, 4),
                    "busy": c.busy,
                    "cost": round(c.cost, 3),
                }
                for c in self.candidates
            ],
        }
        hot = self.hot_prefix
        if hot is not None:
            out["hot_prefix"] = {"prefix_blocks": hot.prefix_blocks, "holders": list(hot.holders),
                                 "replicas": list(hot.replicas), "added": hot.added}
        if self.skipped:
            out["skipped"] = {wid: why for wid, why in self.skipped}
        pd = self.pd
        if pd is not None:
            out["pd"] = {"prefill_worker": pd.prefill_worker, "decode_worker": self.worker_id,
                         "transfer_tokens": pd.transfer_tokens, "transfer_bytes": pd.transfer_bytes,
                         "estimate_s": round(pd.estimate_s, 6), "saved_s": round(pd.saved_s, 6), "reason": pd.reason}
        return out
