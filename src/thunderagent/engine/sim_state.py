"""Per-request and per-pass state records of the simulated engine, and the hashing of a request's
generated blocks (kept apart so the engine module stays about scheduling)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from thunderagent.engine.textgen import TextSource
from thunderagent.kv.hashing import check_block, check_seed, hash_block
from thunderagent.types import EngineRequest, KvEvent

# Where a request is inside the simulated engine (``_Seq.state``). Final ints, not an IntEnum: the
# compiled build (``native.py``) inlines them as native constants in the hot loops, where an enum member
# is a global lookup and an object comparison.
BUFFERED: Final = 0  # arrived, not yet due (arrival after the pass being packed)
WAITING: Final = 1
RUNNING: Final = 2
DONE: Final = 3

# What scheduling one request into a pass did.
SCHEDULED: Final = 0
BLOCKED: Final = 1  # no room: stop packing
SELF_PREEMPTED: Final = 2  # it preempted itself out of ``running``

NEVER: Final = -(1 << 62)


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
    #: check hashes of ``hashes`` (double-hash guard on: the request carried them), extended alongside
    checks: list[int] | None = None
    generated: int = 0
    computed: int = 0  # tokens whose KV is computed (or reused from cache)
    table: list[int] = field(default_factory=list)  # physical block ids, in sequence order
    cached: int = 0  # prompt tokens reused from cache, max over admissions
    state: int = BUFFERED
    s_pass: int = -1  # pass that last scheduled it, and ``computed`` before that (to undo a preemption)
    s_before: int = 0
    expect: int = 0  # prompt tokens expected from cache while queued (load reporting only)
    last_ns: int = -1  # when its latest token came out (accounting mode: inter-token latencies)


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

    def undo(self, seq: _Seq) -> None:
        """Take back what this pass scheduled for ``seq`` (it is being preempted)."""
        P = seq.plen
        L = P + seq.generated
        self.budget += seq.computed - seq.s_before
        pb = min(seq.s_before, P)
        pa = min(seq.computed, P)
        if pa > pb:
            self.n_pf -= 1
            self.isl -= pa
            self.prefix -= pb
        if seq.computed == L:
            self.emit.remove(seq)
            if seq.generated:
                self.A -= L
                self.n_dec -= 1


def extend_hashes(seq: _Seq, upto: int, bs: int, text: TextSource,
                  many: Callable[[int, int, int], list[int]] | None) -> list[int]:
    """Hash ``seq``'s generated blocks up to block ``upto`` (chained onto the prompt's hashes);
    ``many`` is the text source's optional bulk token accessor (faster than one call per token)."""
    if not seq.own_hashes:  # copy on first write: the prompt's list belongs to the frontend
        seq.hashes = list(seq.hashes)
        if seq.checks is not None:
            seq.checks = list(seq.checks)
        seq.own_hashes = True
    hs, cs = seq.hashes, seq.checks
    P, prompt, seed, r = seq.plen, seq.req.prompt_tokens, seq.seed, seq.req.resumed
    for j in range(len(hs), upto):
        lo, hi = j * bs, (j + 1) * bs
        g0 = (lo - P if lo > P else 0) + r
        gen = many(seed, g0, hi - P + r) if many else [text.token(seed, k) for k in range(g0, hi - P + r)]
        # prompt may be a list or an array('I') (the simulator's synthetic prompts): concatenate generically
        block = [*prompt[lo:P], *gen] if lo < P else gen
        hs.append(hash_block(block, hs[j - 1] if j else seq.req.hash_seed))
        if cs is not None:  # the check chain over the same tokens, as the next turn's frontend hashes them
            cs.append(check_block(block, cs[j - 1] if j else check_seed(seq.req.hash_seed)))
    return hs


def text_seed(req: EngineRequest, bs: int) -> int:
    """The completion's text seed: the chained hash of the prompt the client sent. A migrated
    request's prompt ends with ``resumed`` generated tokens, which are not part of it; the prompt's
    block hashes are prefix-stable, so the original prompt's full blocks are the first ones."""
    prompt, hashes = req.prompt_tokens, req.block_hashes
    end = len(prompt) - req.resumed
    n = end // bs  # only the partial tail needs hashing here
    return hash_block(prompt[n * bs : end], hashes[n - 1] if n else req.hash_seed)
