"""What the control plane needs from a worker, whatever runs it.

A :class:`WorkerHandle` is the frontend's view of one worker: the in-process simulated engine
(:class:`~thunderagent.server.local_worker.LocalWorker`), a real engine behind HTTP + ZMQ (vLLM,
SGLang), or a worker process reached over NATS. Handles are created by a :data:`WorkerFactory`
chosen by the node's ``engine`` kind, receive the control plane's callbacks, and are driven from the
event loop only (never from another thread).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from thunderagent.config import NodeConfig
from thunderagent.types import EngineRequest, KvEvent, LoadReport, TokenOutput


#: finish reason of a request a worker could not take (its engine unreachable or failing before any
#: output): the fleet routes it again to another worker
UNAVAILABLE = "unavailable"


@dataclass(slots=True, frozen=True)
class WorkerCallbacks:
    """How a worker reports to the control plane: KV events (in seq order) and heartbeats; and, for
    workers that can tell, that they cannot serve (``on_unavailable(worker_id, reason)``: engine
    unreachable, block-size mismatch): the worker leaves routing at once and comes back with its
    next heartbeat (a worker that must stay out stops heartbeating)."""

    on_events: Callable[[str, list[KvEvent]], None]
    on_heartbeat: Callable[[str, LoadReport], None]
    on_unavailable: Callable[[str, str], None] | None = None


class WorkerHandle(Protocol):
    worker_id: str
    #: tests pause heartbeats to simulate a hung worker
    heartbeats_paused: bool

    def start(self) -> None:
        """Start background tasks (engine loop, heartbeats, event subscriptions)."""

    async def stop(self) -> None:
        """Cancel background tasks and release sockets; in-flight requests end with "abort"."""

    def submit(self, req: EngineRequest) -> asyncio.Queue[TokenOutput]:
        """Start a request; its outputs arrive on the returned queue, the last one ``finished``."""

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone, stop sequence hit). Unknown ids are ignored."""

    def load(self) -> LoadReport:
        """The freshest load known, including requests dispatched but not yet reported."""

    def snapshot(self) -> tuple[list[int], int] | None:
        """Cached block hashes and the last event seq they include, for an index resync; None if
        the worker cannot dump its cache (the index then waits for events)."""


async def cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel a handle's background tasks and wait until each has finished unwinding."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


#: builds the handle of worker ``worker_id`` of node group ``node`` (``index`` within the group)
WorkerFactory = Callable[[NodeConfig, str, int, WorkerCallbacks], WorkerHandle]
