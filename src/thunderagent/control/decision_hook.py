"""Where the live fleet reports its routing decisions: the DEBUG log line, and the decision log
(``control_plane.decision_log``, :mod:`thunderagent.observe.decision_log`) when one is configured.

Kept out of ``control/fleet.py``: the fleet calls :meth:`DecisionHook.record` after each dispatch it
submits (first routing, routed again, migrated) and :meth:`DecisionHook.close` at shutdown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Protocol

from thunderagent.config import DecisionLogConfig
from thunderagent.control.registry import Health, WorkerRegistry
from thunderagent.observe.decision_log import DecisionLog, decision_line
from thunderagent.scheduler.dispatch import Dispatch

log = logging.getLogger("thunderagent.control.fleet")  # the fleet's logger: its DEBUG lines stay where they were


class Fleet(Protocol):
    """What the hook reads of the fleet (``control.fleet.Fleet``; a protocol: no import cycle)."""

    @property
    def workers(self) -> Mapping[str, object]: ...

    @property
    def unavailable(self) -> Mapping[str, str]: ...

    @property
    def registry(self) -> WorkerRegistry: ...


class DecisionHook:
    def __init__(self, cfg: DecisionLogConfig) -> None:
        self.log = DecisionLog.from_config(cfg)

    def record(self, fleet: Fleet, d: Dispatch, program: str | None, tried: tuple[str, ...] = ()) -> None:
        """A decision the fleet submits: logged at DEBUG, and written to the decision log if its
        request is sampled in, with the fleet's workers that were no candidate and why."""
        dec = d.decision
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s -> %s (%s): %s", dec.request_id, dec.worker_id, dec.reason, dec.explain())
        dlog = self.log
        if dlog is None or not dlog.wants(dec.request_id):
            return
        dlog.write(_line(fleet, d, program, tried))

    def tick(self) -> None:
        """Periodic (the fleet's health check): lines buffered past ``FLUSH_S`` reach the file."""
        if self.log is not None:
            self.log.flush_due()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def _line(fleet: Fleet, d: Dispatch, program: str | None, tried: tuple[str, ...]) -> dict[str, object]:
    return decision_line(d, time.time(), program=program, tried=tried, skipped=skipped_workers(fleet, d, tried))


def skipped_workers(fleet: Fleet, d: Dispatch, tried: tuple[str, ...]) -> dict[str, str]:
    """The fleet's workers that were no candidate for ``d``, each with why."""
    cands = {c.worker_id for c in d.decision.candidates}
    out: dict[str, str] = {}
    breakers = dict(d.decision.skipped)
    for wid in fleet.workers:
        if wid in cands:
            continue
        why = fleet.unavailable.get(wid)
        if wid in breakers:
            out[wid] = breakers[wid]
        elif why is not None:
            out[wid] = f"unavailable: {why}"
        elif wid in tried:
            out[wid] = "could not take it (tried before)"
        elif fleet.registry.health(wid) is Health.unhealthy:
            out[wid] = "unhealthy (lease expired)"
        else:
            out[wid] = "excluded by the scheduler (pinned elsewhere or grouped)"
    return out
