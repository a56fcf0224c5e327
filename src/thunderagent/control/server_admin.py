"""An operator's calls on the fleet's servers, each worker asked at once (``frontend/admin_api.py``): a prefix-cache
reset (``/v1/admin/reset_prefix_cache``, vLLM's own ``/reset_prefix_cache``, one worker's) and a LoRA adapter
loaded or unloaded on every server (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

Each goes through the worker's handle (``WorkerHandle.reset_prefix_cache`` / ``set_adapter``: vLLM's and SGLang's
paths, a simulated engine's pool, a worker process over NATS); a worker that refused or did not answer says why,
and the others' answers are kept.

Why a fleet needs the reset: after a model's weights change (an RL step, a hot fix), every server's cached KV is
stale, and the router's index must not send requests to caches that are gone. Once a worker says it reset, this
frontend drops the worker's index entries, its predictions included. The engine's own ``AllBlocksCleared`` event is
not waited for: an idle vLLM engine publishes its events only with its next step, so the event comes with the next
request's batch (and is applied in order: the clear, then that request's blocks); without events (``engine:
openai``) none comes. Other frontends of a NATS bus follow that event, and their predictions of a server without
events expire by their TTL. Entries stored between the server's reset and its answer reaching us are dropped with
the rest (the cache under-estimated, never over: they are found again when the engine stores them anew). A worker
that refused (blocks still in use, no such path, unreachable) keeps its cache and its entries.

Generation paused and resumed (vLLM's ``/pause`` and ``/resume``, for RL trainers that update weights between
rollouts): every server is asked, or those named (a rolling update: half the fleet paused while the other half
serves); a paused server is routed to only while no other can take a request (all paused: requests wait in the
servers until they resume, counted in flight); a pause that clears the caches drops the index entries as a reset
does.

Sleep mode (vLLM's ``/sleep``, ``/wake_up``; a server that sleeps holds new requests until it wakes): a server put
to sleep through ThunderAgent is routed to only while no awake worker can take a request, and from level 1 (its KV
cache discarded) its index entries go; woken whole, it is back. Over NATS the worker process keeps the mark and every
frontend reads it in its heartbeats. A server put to sleep behind ThunderAgent's back is noticed with the next load
poll (its ``vllm:engine_sleep_state`` gauge: ``control/marks.py``).

An adapter loaded or unloaded: the worker reads its server's model list at once (in ``serve``; over NATS its
next heartbeat carries it to every frontend), so routing sends the adapter's requests to the servers that hold it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from thunderagent.control.marks import apply_asleep, apply_paused
from thunderagent.execution.handle import AdminResult, WorkerHandle
from thunderagent.execution.server_admin import sleep_effect

if TYPE_CHECKING:
    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class WorkerAnswer:
    worker_id: str
    success: bool
    error: str | None = None
    answer: str | None = None  # the server's body (a parameterless call's)


async def reset_caches(fleet: Fleet, worker_ids: list[str], *, running: bool, external: bool) -> list[WorkerAnswer]:
    """Reset the prefix cache of each of ``worker_ids`` (known to the fleet), concurrently; in that order."""
    return await _fan_out(fleet, worker_ids, "reset_prefix_cache", "prefix cache reset",
                          lambda h: h.reset_prefix_cache(running, external), lambda wid, _: _forget(fleet, wid))


async def set_paused(fleet: Fleet, worker_ids: list[str], paused: bool, mode: str,
                     clear_cache: bool) -> list[WorkerAnswer]:
    """Pause (``mode``, ``clear_cache``: vLLM's) or resume the generation of each of ``worker_ids``. A pause that
    clears the caches (not with ``keep``) drops the workers' index entries as a reset does."""
    what = f"generation {'paused (' + mode + ')' if paused else 'resumed'}"
    cleared = paused and clear_cache and mode != "keep"

    def done(wid: str, _: str | None) -> None:
        if cleared:
            _forget(fleet, wid)
        apply_paused(fleet, wid, paused, f"{'/pause' if paused else '/resume'} through this frontend")

    return await _fan_out(fleet, worker_ids, "pause" if paused else "resume", what,
                          lambda h: h.set_paused(paused, mode, clear_cache), done)


async def call_servers(fleet: Fleet, worker_ids: list[str], path: str, query: str = "",
                       body: bytes = b"") -> list[WorkerAnswer]:
    """One of vLLM's other operator paths (``execution/server_admin.SERVER_CALLS``) on each server, with the caller's
    url-encoded ``query`` and JSON ``body``. A server put to sleep leaves routing while another can take requests
    (``Fleet.asleep``), and one whose KV cache was discarded (a sleep from level 1, a KV-memory release) its index
    entries; a server woken whole comes back."""
    def done(wid: str, answer: str | None) -> None:
        asleep, cleared = sleep_effect(path, query, answer)
        if cleared:
            _forget(fleet, wid)
        if asleep is not None:
            apply_asleep(fleet, wid, asleep, f"{path} through this frontend")
        if asleep is False:  # (vLLM resumes a server's scheduling once it is awake whole: a pause before is over)
            apply_paused(fleet, wid, False, f"{path} through this frontend")

    return await _fan_out(fleet, worker_ids, path.lstrip("/"), f"{path} called",
                          lambda h: h.server_call(path, query, body), done)


async def set_adapters(fleet: Fleet, worker_ids: list[str], name: str, path: str | None,
                       inplace: bool) -> list[WorkerAnswer]:
    """Load the LoRA adapter ``name`` from ``path`` on each of ``worker_ids`` (``path`` None: unload it)."""
    what = f"LoRA adapter {name!r} {'loaded' if path is not None else 'unloaded'}"
    call = "load_lora_adapter" if path is not None else "unload_lora_adapter"
    return await _fan_out(fleet, worker_ids, call, what, lambda h: h.set_adapter(name, path, inplace), None)


def _forget(fleet: Fleet, worker_id: str) -> None:
    """A worker's cache was emptied: its index entries and predictions go (its seq kept: the engine's
    ``AllBlocksCleared``, when it comes, is the next event)."""
    fleet.index.resync(worker_id, (), fleet.index.last_seq(worker_id))


async def _fan_out(fleet: Fleet, worker_ids: list[str], call_name: str, what: str,
                   call: Callable[[WorkerHandle], Awaitable[AdminResult]],
                   done: Callable[[str, str | None], None] | None) -> list[WorkerAnswer]:
    # The data-parallel ranks of one vLLM server are workers of their own but one server: it is called once,
    # through the first of them asked, and its answer stands for each (a weight update or an adapter load sent
    # once per rank would run again, or be refused as already done)
    groups: dict[str, list[str]] = {}
    for wid in worker_ids:
        groups.setdefault(_server(fleet, wid) or f"\0{wid}", []).append(wid)

    async def one(ids: list[str]) -> list[WorkerAnswer]:
        handle = fleet.workers.get(ids[0])
        if handle is None:
            return [WorkerAnswer(wid, False, "it left the fleet") for wid in ids]
        try:
            r = await call(handle)
        except Exception as e:  # a handle's bug must not lose the other workers' answers
            log.exception("%s on %s failed", what, ids[0])
            r = AdminResult(False, f"failed: {e!r}")
        out = []
        for wid in ids:
            fence = getattr(fleet.workers.get(wid), "marks_changed", None)  # (an engine worker's load polls)
            if r.success and fence is not None and wid != ids[0]:
                fence()  # the other ranks' polls begun before the call must not undo what it marked
            if r.success and done is not None and wid in fleet.workers:
                done(wid, r.answer)
            fleet.metrics.server_calls.labels(call_name, "done" if r.success else "refused").inc()
            log.warning("%s on %s by an operator: %s", what, wid, "done" if r.success else f"refused: {r.error}")
            out.append(WorkerAnswer(wid, r.success, r.error, r.answer))
        return out

    answered = {a.worker_id: a for batch in await asyncio.gather(*(one(ids) for ids in groups.values()))
                for a in batch}
    return [answered[wid] for wid in worker_ids]


def _server(fleet: Fleet, worker_id: str) -> str:
    """The server ``worker_id`` shares with other workers (a data-parallel rank's), else empty."""
    try:
        return fleet.registry.info(worker_id).server
    except KeyError:  # (not registered any more)
        return ""
