"""The engine interface every worker engine implements (simulated, vLLM, SGLang).

Lifecycle (all calls synchronous, driven by one owner, never concurrently):

1. construct with the node's config part;
2. ``add_request(req, now)`` buffers an arrival; ``abort(request_id, now)`` cancels one (its blocks
   are released, a final ``TokenOutput`` with ``finish_reason="abort"`` is returned by the next
   ``advance``);
3. ``advance(now)`` runs every engine pass that ends at or before ``now`` and starts the next pass
   if there is work; it returns the tokens produced, each stamped with its pass end time;
4. ``next_wakeup()`` says when the pass in progress ends (None when idle), so a driver knows when to
   call ``advance`` again;
5. ``drain_events()`` hands over the KV events produced since the last call, in sequence order;
6. ``load(now)`` reports running / waiting requests, queued prefill tokens and KV usage;
7. ``cache_snapshot()`` lists the hashes the engine holds, for an index resync, and
   ``cache_checks()`` their double-hash check hashes in the same order (None: it has none).

An engine never reads a clock: ``now`` always comes from the driver (wall clock in the server,
virtual clock in the simulator).
"""

from __future__ import annotations

from typing import Protocol

from thunderagent.types import EngineRequest, KvEvent, LoadReport, TokenOutput


class Engine(Protocol):
    worker_id: str
    block_size: int

    def add_request(self, req: EngineRequest, now: float) -> None: ...

    def abort(self, request_id: str, now: float) -> None: ...

    def advance(self, now: float) -> list[TokenOutput]: ...

    def next_wakeup(self) -> float | None: ...

    def drain_events(self) -> list[KvEvent]: ...

    def load(self, now: float) -> LoadReport: ...

    def cache_snapshot(self) -> list[int]: ...

    def cache_checks(self) -> list[int] | None: ...

    def reset(self) -> None: ...  # forget the prefix cache (``AllBlocksCleared``); running requests keep their blocks
