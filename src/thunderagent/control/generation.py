"""A request in flight as the fleet tracks it (:class:`Generation`), a caller waiting for its held request to be
dispatched (:class:`HeldCall`), and the end of held requests by vLLM's ``/abort_requests`` (:func:`abort_held`)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass, field

from thunderagent.control.seed_metrics import Latency
from thunderagent.execution.handle import OutputQueue, WorkerHandle
from thunderagent.scheduler.dispatch import Dispatch, Dispatcher
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
    client_id: str | None = None  # the client's ``x-request-id``: what ``/abort_requests`` may name it by


#: vLLM's request ids for a client's ``x-request-id`` X: ``chatcmpl-X`` (chat), ``cmpl-X`` (completions)
_VLLM_PREFIXES = ("chatcmpl-", "cmpl-")


class HeldAborted(Exception):
    """A held request was ended by ``/abort_requests`` before any worker started it: its caller answers as vLLM
    answers a request aborted while it waited (nothing generated, ``finish_reason: abort``)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} aborted (/abort_requests) before a worker started it")
        self.request_id = request_id


def abort_held(held: dict[str, HeldCall], dispatcher: Dispatcher, ids: Collection[str] | None, now: float) -> int:
    """End the requests held in the scheduler that ``ids`` names (None: all of them): each leaves the scheduler
    (queue, grouping, pacing) and its caller gets :class:`HeldAborted`. A held request is named by its client's
    ``x-request-id`` X, bare or as vLLM's id for it (``chatcmpl-X``, ``cmpl-X``): the ids an abort sent to vLLM
    uses for a request it runs. Returns how many ended."""
    names = None if ids is None else {
        i.removeprefix(p) for i in ids for p in ("", *_VLLM_PREFIXES)}
    ended = 0
    for rid, call in list(held.items()):
        if call.fut.done() or (names is not None and call.client_id not in names):
            continue  # (done: dispatched, or its caller left, and its cleanup has not run yet)
        del held[rid]
        dispatcher.cancel(rid)
        if call.program_id is not None:  # a program's request is no step of it (as a refused one)
            dispatcher.finished(call.program_id, 0, now, completed=False)
        call.fut.set_exception(HeldAborted(rid))
        ended += 1
    return ended
