"""The simulated engine's state, declared once: the base of its class chain.

:class:`~thunderagent.engine.simulated.SimulatedEngine` is split by concern into modules that each
hold one link of a single-inheritance chain (``EngineFields`` → ``Eviction`` → ``KvHandoff`` →
``DecodeStretch`` → ``PassEnd`` → ``SimulatedEngine``), so that every link reads and writes the same
typed fields. Why a chain and not mixins: mypyc (``setup.py``) compiles a class only under single
inheritance (other bases must be mypyc traits, a decorator from ``mypy_extensions``, which the runtime
does not install). The engine sets every field in its ``__init__``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from thunderagent.engine.sim_state import PassInfo, _Pass, _Seq
from thunderagent.types import KvEvent, TokenOutput

if TYPE_CHECKING:
    from thunderagent.engine.accounting import TokenAccounting
    from thunderagent.engine.blocks import BlockManager
    from thunderagent.engine.preemption import PriorityPreemption
    from thunderagent.engine.textgen import TextSource
    from thunderagent.engine.timing import TimingModel


class EngineFields:
    """Fields of the simulated engine (set in ``SimulatedEngine.__init__``), and the two methods the
    chain's links call on the engine itself."""

    # identity and shape
    worker_id: str
    block_size: int
    node: Any  # NodeConfig (pydantic: not a type the compiled build knows)
    eos_token_id: int
    _bs: int
    _max_seqs: int
    _max_tokens: int
    _chunked: bool
    _total_kv: int
    _timing: TimingModel
    _pp: PriorityPreemption | None
    _text: TextSource
    _tokens: Any  # the text source's optional bulk token accessor (None without one)
    _cache_gen: bool
    _acct: TokenAccounting | None
    # plain decode stretches (engine/stretch.py)
    _plain: _Pass  # the marker pass object of plain passes (reused; its lists stay empty)
    _plain_left: int  # plain passes still certain
    _plain_done: int  # plain passes ended since the per-request counters were last brought up to date
    _plain_A: int  # decoders' summed length in the next plain pass
    _ahead: deque[int]  # durations of the plain passes after the one in flight, computed ahead
    # requests and passes
    _bm: BlockManager
    _seqs: dict[str, _Seq]
    _arrivals: deque[_Seq]
    _waiting: deque[_Seq]
    _running: list[_Seq]
    _outbox: list[TokenOutput]
    _events: list[KvEvent]
    _pass: _Pass | None
    _pass_end: int
    _last_end: int
    _seen_ns: int
    _pid: int
    _stalled: bool
    _q_prefill: int
    _q_hit: int
    _dec_tokens: int
    # counters
    preemptions: int
    priority_preemptions: int
    busy_ns: int
    prefill_tokens: int
    last_pass: PassInfo | None
    # load reports (``watch_load``)
    _quiet_ns: int
    _watch: tuple[list[tuple[int, int]], int] | None
    # KV handoffs (engine/kv_handoff.py)
    _remote_jobs: dict[str, tuple[int, ...]]  # remote_decode request id -> its prompt's full-block hashes
    _pinned: dict[str, list[int]]  # finished remote_decode request id -> its pinned block table
    kv_imported_blocks: int
    kv_import_failed: int
    pin_transfers: bool

    def _enqueue(self, seq: _Seq, front: bool = False) -> None:
        raise NotImplementedError  # SimulatedEngine's

    def _touch(self) -> None:
        raise NotImplementedError  # SimulatedEngine's
