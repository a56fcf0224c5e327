"""The worker contract: what the control plane needs from a worker, whatever runs it.

A :class:`WorkerHandle` is the control plane's view of one worker: the in-process simulated engine
(:class:`~thunderagent.execution.local.LocalWorker`), a real engine behind HTTP + ZMQ (vLLM, SGLang:
:mod:`thunderagent.execution.vllm`), or a worker process reached over NATS
(:class:`~thunderagent.control.remote_worker.RemoteWorker`). Handles are created by a
:data:`WorkerFactory` chosen by the node's ``engine`` kind, report through :class:`WorkerCallbacks`,
and are driven from the event loop only (never from another thread).

The contract every handle keeps (``tests/engines/test_conformance.py`` checks it on each one):

- ``submit`` returns an :class:`OutputQueue`; the request's outputs arrive on it in order, the last
  one ``finished`` with a :class:`~thunderagent.types.FinishReason`; nothing arrives after it.
- A request the worker could not take (nothing generated) ends ``UNAVAILABLE``: the fleet routes it
  again. One that failed after it started ends ``ERROR``.
- **Liveness**: while a worker is alive it *touches* each of its requests' queues at least every
  :data:`KEEPALIVE_S` (an output counts as a touch). The fleet ends a request whose queue was not
  touched for :data:`STALL_TIMEOUT_S`, the same rule for every kind of worker.
- **Load is pushed**: after every engine step, poll, submission or abort the handle calls
  ``on_load`` with a report that already counts the requests it was given but its engine has not
  reported yet; routing reads the registry, never the handle. A handle may instead call
  ``on_load_stale`` (when given) with a reader of its load: the registry calls it before it is next
  read, so several changes between two reads cost one report (see ``WorkerRegistry.stale``).
- ``abort`` of an unknown or finished request is ignored; after ``abort`` nothing more arrives.
- ``reset_prefix_cache`` empties the worker's prefix cache (an operator's call: ``control/server_admin.py``); its
  KV events, if it has any, announce it (``AllBlocksCleared``); ``set_adapter`` loads or unloads a LoRA adapter;
  ``set_paused`` pauses or resumes the server's generation.
  Neither raises for the server's refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from thunderagent.config import NodeConfig
from thunderagent.types import EngineRequest, KvEvent, LoadReport, TokenOutput

#: a live worker touches each of its requests at least this often (seconds) ...
KEEPALIVE_S = 2.0
#: ... so the fleet ends a request that heard nothing for this long (its worker is lost or hung)
STALL_TIMEOUT_S = 4 * KEEPALIVE_S


class OutputQueue(asyncio.Queue[TokenOutput]):
    """A request's outputs, with the liveness facts the fleet's stall check reads.

    ``last_heard`` is the time (on the handle's clock, which is the fleet's) of the last output or
    keepalive; ``accepted`` says the worker took the request (an engine has it): a request lost
    after that ends ``ERROR``, before it ``UNAVAILABLE`` (routed again)."""

    def __init__(self, now: float) -> None:
        super().__init__()
        self.last_heard = now
        self.accepted = False
        self.produced = False  # a token was put: the request cannot be routed again unseen

    def put_output(self, out: TokenOutput, now: float) -> None:
        self.last_heard = now
        if out.token_ids:
            self.produced = True
        self.put_nowait(out)

    def touch(self, now: float) -> None:
        self.last_heard = now


class FollowingQueue(OutputQueue):
    """An output queue standing in for another one (``source``, once there is one): its liveness
    follows whichever heard last, the source (its keepalives) or this queue's own touches."""

    def __init__(self, now: float) -> None:
        self.source: OutputQueue | None = None
        self._heard = now
        super().__init__(now)

    @property  # type: ignore[override]
    def last_heard(self) -> float:
        src = self.source
        return self._heard if src is None else max(self._heard, src.last_heard)

    @last_heard.setter
    def last_heard(self, now: float) -> None:
        self._heard = now


@dataclass(slots=True, frozen=True)
class WorkerCallbacks:
    """How a worker reports to the control plane.

    - ``on_events``: KV events, in seq order;
    - ``on_heartbeat``: liveness (renews the worker's lease) with its load;
    - ``on_load``: a fresher load between heartbeats (no lease renewal);
    - ``on_unavailable``: the worker cannot serve (engine unreachable, block-size mismatch): it
      leaves routing at once and comes back with its next heartbeat (a worker that must stay out
      stops heartbeating).
    """

    on_events: Callable[[str, list[KvEvent]], None]
    on_heartbeat: Callable[[str, LoadReport], None]
    on_load: Callable[[str, LoadReport], None]
    on_unavailable: Callable[[str, str], None]
    #: the control plane's clock (seconds): queue liveness times are on it
    clock: Callable[[], float]
    #: ``on_load`` deferred to the next read: the handle's load changed, ``read`` returns it then
    #: (None: the receiver takes only pushed reports, call ``on_load``)
    on_load_stale: Callable[[str, Callable[[], LoadReport]], None] | None = None
    #: the engine stated how long a sequence / prompt it takes (vLLM's max_model_len): routing sends a
    #: worker only what it holds (None: not passed on)
    on_limits: Callable[[str, int, int], None] | None = None
    #: the LoRA adapters its server serves by name changed (vLLM's /v1/models; None: not passed on)
    on_adapters: Callable[[str, tuple[str, ...]], None] | None = None
    #: its server fell asleep or woke (vLLM's ``vllm:engine_sleep_state`` gauge; None: not passed on)
    on_asleep: Callable[[str, bool], None] | None = None
    #: its server's generation was paused or resumed (vLLM's ``/is_paused``, while it is awake; None: not passed on)
    on_paused: Callable[[str, bool], None] | None = None
    #: its server's own KV pulls so far, read with each load poll (vLLM's NIXL metrics: bytes, seconds, transfers,
    #: cumulative; None: not passed on)
    on_kv_pulls: Callable[[str, float, float, float], None] | None = None
    #: its server's computed prompt tokens and prefill seconds so far, read with each load poll (vLLM's request
    #: histograms' sums, cumulative; None: not passed on)
    on_prefill: Callable[[str, float, float], None] | None = None


@dataclass(slots=True, frozen=True)
class AdminResult:
    """How an operator's call on a worker's server went (a prefix-cache reset, a LoRA adapter loaded or unloaded):
    ``success``, or why not (``error``: refused by the server, e.g. blocks still in use, no such path, unreachable);
    ``answer``: the server's body, for a call that reads something (``server_call``)."""

    success: bool
    error: str | None = None
    answer: str | None = None


class WorkerHandle(Protocol):
    worker_id: str

    def start(self) -> None:
        """Start background tasks (engine loop, heartbeats, event subscriptions)."""

    async def stop(self) -> None:
        """Cancel background tasks and release sockets; in-flight requests end with "abort"."""

    def submit(self, req: EngineRequest) -> OutputQueue:
        """Start a request; its outputs arrive on the returned queue, the last one ``finished``."""

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone, stop sequence hit). Unknown ids are ignored."""

    async def reset_prefix_cache(self, running: bool, external: bool) -> AdminResult:
        """Empty the prefix cache (``running``: also the blocks of running requests, which are preempted;
        ``external``: a KV connector's cache too), as vLLM's ``/reset_prefix_cache`` does."""

    async def set_paused(self, paused: bool, mode: str, clear_cache: bool) -> AdminResult:
        """Pause the server's generation (``mode``: ``abort`` its requests in flight, ``wait`` for them, ``keep``
        them frozen; ``clear_cache``: empty its caches once drained) or resume it (``paused`` False), as vLLM's
        ``/pause`` and ``/resume`` do; new requests sent meanwhile wait in the server until it resumes."""

    async def server_call(self, path: str, query: str = "", body: bytes = b"") -> AdminResult:
        """One of vLLM's other operator paths (``execution/server_admin.SERVER_CALLS``: profiling, the multimodal
        caches' resets, ``/is_paused``, sleep mode, ``/collective_rpc``, the RL weight transfer), with its url-encoded
        ``query`` and JSON ``body`` as the caller gave them, its answer's body in ``answer``."""

    async def set_adapter(self, name: str, path: str | None, inplace: bool) -> AdminResult:
        """Load the LoRA adapter ``name`` from ``path`` on the server (``inplace``: replace one of that name), or
        unload it (``path`` None), as vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` do; once
        done, the worker's served names (``on_adapters``) say so."""

    def snapshot(self) -> Snapshot | None:
        """Cached block hashes and the last event seq they include, for an index resync, then
        (optional third item) their double-hash check hashes; None if the worker cannot dump its
        cache synchronously (the fleet's membership asks it otherwise)."""


#: a handle's cache dump: (hashes, last seq) or (hashes, last seq, check hashes or None). Without
#: check hashes, the dumped entries are unverified for the double-hash guard (``kv.check``).
Snapshot = tuple[list[int], int] | tuple[list[int], int, list[int] | None]


def snapshot_checks(snap: Snapshot) -> list[int] | None:
    """The check hashes of a snapshot (None: it has none)."""
    return snap[2] if len(snap) > 2 else None  # type: ignore[misc]


def with_pending(report: LoadReport, pending_requests: int, pending_tokens: int) -> LoadReport:
    """``report`` plus requests handed to the engine that its report does not include yet: counted
    as waiting, so two quick requests never both see an idle worker."""
    if not pending_requests:
        return report
    return replace(report, waiting=report.waiting + pending_requests,
                   queued_prefill_tokens=report.queued_prefill_tokens + pending_tokens)


async def cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel a handle's background tasks and wait until each has finished unwinding."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


#: builds the handle of worker ``worker_id`` of node group ``node`` (``index`` within the group)
WorkerFactory = Callable[[NodeConfig, str, int, WorkerCallbacks], WorkerHandle]
