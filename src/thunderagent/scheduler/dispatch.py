"""The one dispatch path: a request in, a decision and an engine request out.

Pure and synchronous (``now`` is passed in). Both drivers call it: the live fleet
(:mod:`thunderagent.control.fleet`) and the simulator (:mod:`thunderagent.sim.driver`), so what the
simulator measures is what serves traffic. The path, once per request:

1. **hash once** (:meth:`Dispatcher.prepare`): the prompt's chained block hashes, with the tenant
   salt and LoRA name in the seed; reused by the router, the index and the engine;
2. **scheduler hook**: the scheduler decides whether the request goes now (today a pass-through;
   the holding queue plugs in here);
3. **route**: index match + cost + policy over the routable workers (``KvRouter.route``, called
   from here and nowhere else);
4. **predict**: the router records the request's blocks on the winner (done inside ``route``);
5. the driver **submits** the returned :class:`EngineRequest` to the chosen worker.

After the requests of one instant are dispatched the driver calls :meth:`Dispatcher.settle`
(bounded sweep of expired predictions), so the index's bookkeeping is the same in both drivers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from thunderagent.kv.hashing import block_hashes, hash_seed
from thunderagent.router.router import KvRouter
from thunderagent.types import Decision, EngineRequest, RouteRequest, Sampling, WorkerState

#: expired predictions swept per settle (bounded work per instant; ``predict`` sweeps too)
EXPIRE_PER_SETTLE = 64


class SchedulerHook(Protocol):
    """Where the scheduler meets the dispatch path. ``admit`` says whether ``req`` may be routed
    now; the scheduler keeps what it holds back and hands it over later."""

    def admit(self, req: EngineRequest, now: float) -> bool: ...


class PassThrough:
    """The scheduler hook of a fleet without a scheduler: every request goes at once."""

    __slots__ = ()

    def admit(self, req: EngineRequest, now: float) -> bool:
        return True


class Held(Exception):
    """The scheduler hook held the request back (not raised by the pass-through)."""


@dataclass(slots=True)
class Dispatch:
    """A routed request: what to submit, where, and what the index knew when it was decided."""

    request: EngineRequest
    decision: Decision
    #: most prompt tokens any worker held per the index at routing time (the engine recomputes
    #: the last prompt token, so at most ``(len - 1) // block_size`` blocks can hit)
    best_known_tokens: int
    #: prompt tokens the chosen worker is believed to hold
    predicted_tokens: int


class Dispatcher:
    def __init__(self, router: KvRouter, block_size: int, scheduler: SchedulerHook | None = None) -> None:
        self.router = router
        self.index = router.index
        self.block_size = block_size
        self.scheduler: SchedulerHook = scheduler or PassThrough()

    def prepare(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        ignore_eos: bool = False,
        sampling: Sampling | None = None,
        arrival: float = 0.0,
    ) -> EngineRequest:
        """Hash the prompt once; the engine request carries the hashes from here on."""
        seed = hash_seed(cache_salt, lora_name)
        hashes = block_hashes(prompt, self.block_size, seed)
        return EngineRequest(request_id, prompt, hashes, seed, max_tokens, ignore_eos=ignore_eos, priority=priority,
                             arrival=arrival, cache_salt=cache_salt, lora_name=lora_name, sampling=sampling)

    def dispatch(self, req: EngineRequest, workers: Sequence[WorkerState], now: float,
                 exclude: tuple[str, ...] = ()) -> Dispatch:
        """Route ``req`` among ``workers`` (less ``exclude``: workers that already could not take
        it). Raises :class:`~thunderagent.router.router.NoWorkerAvailable`, or :class:`Held` when
        the scheduler keeps the request."""
        if not self.scheduler.admit(req, now):
            raise Held(req.request_id)
        if exclude:
            workers = [w for w in workers if w.worker_id not in exclude]
        n = len(req.prompt_tokens)
        decision = self.router.route(RouteRequest(req.request_id, n, req.block_hashes, req.priority), workers, now)
        bs = self.block_size
        best = max((c.overlap_blocks for c in decision.candidates), default=0)
        best_known = min(best, (n - 1) // bs) * bs
        predicted = min(decision.overlap_blocks * bs, n)
        return Dispatch(req, decision, best_known, predicted)

    def settle(self, now: float) -> None:
        """End of an instant's dispatches: sweep a bounded number of expired predictions."""
        self.index.expire(now, EXPIRE_PER_SETTLE)
