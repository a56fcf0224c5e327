"""Mid-stream migration: a request whose worker was lost after it started goes on elsewhere.

A worker can die (``kill -9``: its lease expires), hang (the stall check hears nothing for
``stall_timeout``), leave, or fail in its engine while it streams a request. The request then ends
``ERROR`` on its queue. Instead of passing that on, :meth:`Fleet.outputs
<thunderagent.control.fleet.Fleet.outputs>` asks :func:`migrate` to build a *continuation*: the
original prompt plus every token streamed so far, asking for the tokens still to come, with the same
sampling, priority, cache salt and adapter. It is hashed and dispatched like any request, excluding
the workers that already failed it, and its outputs go on in the same stream: the client sees one
stream, with no gap and no duplicate, up to ``routing.migration_limit`` times. Only when no worker
can take it does the request end ``ERROR``.

What a continuation reproduces:

- greedy decoding: the tokens an unbroken run would have produced (the model is given the same
  sequence; a real engine prefills what it had decoded, so only a numerical near-tie could differ);
- the simulated engine: exactly (``EngineRequest.resumed`` tells it where its completion stood);
- seeded sampling: a valid continuation, not the unbroken run's tokens: an engine's per-request
  generator restarts from the seed on the new worker.

Usage stays the client's: ``prompt_tokens`` is the original prompt's length, completion tokens count
every token across workers, and cached tokens are capped at the prompt (a continuation's cache hits
on its own generated tokens are no prompt cache hits).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from thunderagent.config import Config
from thunderagent.control.metrics import Metrics
from thunderagent.execution.handle import OutputQueue, WorkerHandle
from thunderagent.router.router import NoWorkerAvailable
from thunderagent.scheduler.dispatch import Dispatch, Dispatcher
from thunderagent.types import EngineRequest, FinishReason, TokenOutput, WorkerState

log = logging.getLogger(__name__)


class Generation(Protocol):
    """What migration reads and moves of a request in flight (``control.fleet.Generation``)."""

    request_id: str
    dispatch: Dispatch
    worker: WorkerHandle
    queue: OutputQueue
    tried: tuple[str, ...]
    program_id: str | None
    produced: list[int]
    origin: EngineRequest | None
    migrations: int
    lost: str | None

    @property
    def request(self) -> EngineRequest: ...

    @property
    def prompt_tokens(self) -> int: ...


class Fleet(Protocol):
    """What migration needs of the fleet (``control.fleet.Fleet``; a protocol: no import cycle)."""

    cfg: Config
    dispatcher: Dispatcher
    metrics: Metrics

    def routable(self) -> list[WorkerState]: ...

    def now(self) -> float: ...

    def resubmit(self, gen: Generation, d: Dispatch, tried: tuple[str, ...]) -> None: ...

#: metric label of why a request moved, from the reason the fleet cut it (else the worker ended it)
_CAUSES = (("stalled", "stalled"), ("lease expired", "lease_expired"), ("left", "worker_left"),
           ("removed by an operator", "removed"))


def route_again(fleet: Fleet, gen: Generation) -> bool:
    """Submit ``gen``'s request to another worker after its worker could not take it (nothing
    was streamed yet). False when no other worker is left. The worker left out is the one at fault:
    the request's, or a disaggregated attempt's ``blamed`` (strict: its prefill worker, when that half failed)."""
    tried = (*gen.tried, getattr(gen.worker, "blamed", gen.worker.worker_id))
    fleet.dispatcher.retract(gen.dispatch)
    try:
        d = fleet.dispatcher.dispatch(gen.request, fleet.routable(), fleet.now(), exclude=tried)
    except NoWorkerAvailable:
        return False
    log.info("request %s: %s could not take it, routed again to %s", gen.request_id, gen.worker.worker_id,
             d.decision.worker_id)
    fleet.metrics.rerouted.inc()
    fleet.resubmit(gen, d, tried)
    return True


def is_lost(gen: Generation, out: TokenOutput) -> bool:
    """``out``, a finished output, ends a request its worker lost after taking it: the fleet cut it,
    or its worker ended it ``ERROR`` after output (an ``ERROR`` before any output is a refusal)."""
    return (out.finish_reason == FinishReason.ERROR and not out.token_ids
            and (gen.lost is not None or gen.queue.produced or bool(gen.produced)))


def cause(gen: Generation) -> str:
    lost = gen.lost
    if lost is None:
        return "engine_error"
    return next((label for key, label in _CAUSES if key in lost), "lost")


def continuation(fleet: Fleet, gen: Generation) -> EngineRequest | str:
    """The request that carries ``gen`` on, hashed; or why there is none."""
    origin = gen.origin or gen.request
    done = gen.produced
    if gen.migrations >= fleet.cfg.routing.migration_limit:
        return f"migration_limit ({fleet.cfg.routing.migration_limit}) reached"
    if -1 in done:  # an engine that streams text without ids: the prompt cannot be extended
        return "its engine streamed no token ids"
    req = fleet.dispatcher.prepare(
        origin.request_id, [*origin.prompt_tokens, *done], origin.max_tokens - len(done),
        cache_salt=origin.cache_salt, lora_name=origin.lora_name, priority=origin.priority,
        ignore_eos=origin.ignore_eos, sampling=origin.sampling, arrival=origin.arrival,
    )
    req.resumed, req.headers = origin.resumed + len(done), origin.headers
    return req


def migrate(fleet: Fleet, gen: Generation) -> bool:
    """Move ``gen``, lost by its worker, to another worker; True when its continuation was
    submitted (its outputs arrive on ``gen.queue``), False when it cannot move."""
    lost_on, why = gen.worker.worker_id, cause(gen)
    gen.worker.abort(gen.request_id)  # a hung worker may still be running it
    if len(gen.produced) >= (gen.origin or gen.request).max_tokens:
        return False  # only its final output was lost: :func:`settle` ends it ``length``
    req = continuation(fleet, gen)
    failed = (*gen.tried, lost_on)
    if not isinstance(req, str):
        try:
            d = fleet.dispatcher.dispatch(req, fleet.routable(), fleet.now(), exclude=failed, program=gen.program_id)
        except NoWorkerAvailable as exc:
            req = f"no other worker can take it ({exc})"
    if isinstance(req, str):
        log.warning("request %s lost on %s (%s) after %d tokens, not migrated: %s", gen.request_id, lost_on, why,
                    len(gen.produced), req)
        fleet.metrics.migration_failed.inc()
        return False
    log.warning("request %s lost on %s (%s) after %d tokens: migrated to %s (%s), %d tokens to go",
                gen.request_id, lost_on, why, len(gen.produced), d.decision.worker_id, d.decision.reason,
                req.max_tokens)
    fleet.metrics.migrations.labels(why).inc()
    gen.origin = gen.origin or gen.request
    gen.migrations += 1
    gen.lost = None
    fleet.resubmit(gen, d, failed)
    return True


def settle(gen: Generation, out: TokenOutput) -> TokenOutput:
    """``out`` as the client's request sees it: counted against the original prompt (a
    continuation's cache hits are capped at it); a request lost after output ends ``length`` when
    every token it asked for came, else ``ERROR`` (never ``UNAVAILABLE``: that one is routed again)."""
    reason = out.finish_reason
    if out.finished and gen.produced and reason in (FinishReason.ERROR, FinishReason.UNAVAILABLE):
        full = len(gen.produced) >= (gen.origin or gen.request).max_tokens
        reason = FinishReason.LENGTH if full else FinishReason.ERROR
    if gen.origin is None and reason == out.finish_reason:
        return out
    plen = gen.prompt_tokens
    # A continuation's engine text is not the client's: vLLM primes its detokenizer with the whole
    # prompt, and when the cut fell inside a character (bytes it held back) its first text repeats
    # much of the prompt. The frontend decodes the ids instead, going on from where the text stopped.
    text = None if gen.origin is not None else out.text
    return dataclasses.replace(out, prompt_tokens=plen, cached_tokens=min(out.cached_tokens, plen),
                               finish_reason=reason, text=text)
