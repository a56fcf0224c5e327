"""A request in flight as the fleet tracks it (:class:`Generation`), and a caller waiting for its
held request to be dispatched (:class:`HeldCall`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from thunderagent.control.seed_metrics import Latency
from thunderagent.execution.handle import OutputQueue, WorkerHandle
from thunderagent.scheduler.dispatch import Dispatch
from thunderagent.types import Decision, EngineRequest


@dataclass(slots=True)
class Generation:
    request_id: str
    dispatch: Dispatch  # the latest routing of the request (it changes when routed again)
    worker: WorkerHandle
    queue: OutputQueue
    received: float  # fleet time the request arrived
    tried: tuple[str, ...] = ()  # workers that could not take it, or lost it
    program_id: str | None = None  # the agent program it belongs to
    produced: list[int] = field(default_factory=list)  # tokens streamed so far (``control.migration``)
    origin: EngineRequest | None = None  # the request as the client sent it, once it migrated
    migrations: int = 0
    lost: str | None = None  # why the fleet cut the attempt in progress
    latency: Latency | None = None  # its worker's and route key's TTFT/ITL histograms
    timer: asyncio.TimerHandle | None = None  # its deadline (control/deadline.py), while armed
    timed_out: bool = False  # ended by the fleet at its deadline: not routed again, not migrated

    @property
    def decision(self) -> Decision:
        return self.dispatch.decision

    @property
    def request(self) -> EngineRequest:
        return self.dispatch.request

    @property
    def prompt_tokens(self) -> int:
        return len((self.origin or self.dispatch.request).prompt_tokens)


@dataclass(slots=True)
class HeldCall:
    """A caller waiting for its held request to be dispatched."""

    fut: asyncio.Future[Generation]
    program_id: str | None
