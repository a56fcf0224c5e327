"""The holding queue's gate on the prefill tier, with disaggregation ``always`` (``Dispatcher``).

In mode ``always`` every request prefills on a prefill worker, and the decode workers prefill nothing, so they
always look free: without this gate the overload would queue in the prefill engines, out of reach of the
scheduler's bounds (``max_queued``, ``max_queue_delay_s``: 429; ``max_wait_s``).

- A request of the default priority or below waits for a prefill worker that is not busy and whose reported
  prefill backlog is under ``engine_backlog_passes`` passes.
- A request above it is not held behind lower tiers' backlog: the prefill engine runs its queue by priority,
  so it overtakes that backlog at the next pass, while held here it would go out only after a pass ended and
  miss the pass formed then (simulated: high-priority TTFT p99 692 against 530 ms when every tier waited for
  the backlog). It waits only for work of its own priority or higher, which it cannot overtake: what this
  gate sent to the worker at such priorities, counted until each request's first token (or end), must be
  under the same number of passes. So a flood of high-priority requests is held here too.

Pure and synchronous; the dispatcher calls :meth:`sent` for every planned request above the default priority
and :meth:`done` when it produced its first token, ended, or was retracted.
"""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.config import RoutingConfig
from thunderagent.router.cost import is_busy
from thunderagent.types import WorkerState


class PrefillGate:
    def __init__(self, passes: float) -> None:
        self.passes = passes  # scheduler.engine_backlog_passes
        self._ahead: dict[str, dict[int, int]] = {}  # prefill worker -> priority > 0 -> tokens sent, not done
        self._of: dict[str, tuple[str, int, int]] = {}  # request id -> (prefill worker, priority, tokens)

    def room(self, workers: Sequence[WorkerState], priority: int, routing: RoutingConfig) -> bool:
        """Some prefill worker can take a request of ``priority`` now (no prefill worker routable: True, the
        plan then falls back, or strict raises). ``routing``: the router's config (busy thresholds)."""
        prefill = False
        for w in workers:
            if w.role != "prefill":
                continue
            prefill = True
            bound = self.passes * w.max_num_batched_tokens
            if priority > 0:
                # (one pass more: this count also holds the pass running there and the KV moving out, which a
                # reported backlog does not)
                tiers = self._ahead.get(w.worker_id)
                if not tiers or sum(t for p, t in tiers.items() if p >= priority) < bound + w.max_num_batched_tokens:
                    return True
            elif not is_busy(w, routing) and w.load.queued_prefill_tokens < bound:
                return True
        return not prefill

    def sent(self, request_id: str, worker_id: str, priority: int, tokens: int) -> None:
        """A request above the default priority was planned on prefill worker ``worker_id``."""
        self.done(request_id)  # routed again (strict): counted once, where it goes now
        tiers = self._ahead.setdefault(worker_id, {})
        tiers[priority] = tiers.get(priority, 0) + tokens
        self._of[request_id] = (worker_id, priority, tokens)

    def done(self, request_id: str) -> bool:
        """Its first token, its end, or it never ran: no longer ahead of anyone there. True if it was counted."""
        entry = self._of.pop(request_id, None)
        if entry is None:
            return False
        wid, priority, tokens = entry
        tiers = self._ahead[wid]
        left = tiers[priority] - tokens
        if left:
            tiers[priority] = left
        else:
            del tiers[priority]
            if not tiers:
                del self._ahead[wid]
        return True

    def pending(self) -> int:
        """Requests counted (for tests and leak checks)."""
        return len(self._of)
