"""An operator's marks on workers, each changed in one place: the cordon (out of routing until uncordoned), the sleep
mark (``Fleet.asleep``: vLLM's sleep mode) and the pause mark (``Fleet.paused``: vLLM's ``/pause``). A sleeping or
paused vLLM server holds new requests until it wakes or resumes, so routing sends a request to one only while no
other worker can take it.

Three sources keep the sleep mark, all through :func:`apply_asleep`: a sleep or wake-up asked through this frontend
(``control/server_admin.py``, at once), the server's own ``vllm:engine_sleep_state`` gauge read with every load poll
(``execution/engine_poll.py``: a server put to sleep behind ThunderAgent's back, or before it started, is noticed
within a poll), and over NATS the worker process's heartbeats (``control/nats_membership.py``). The pause mark
likewise, its poll reading the server's ``/is_paused`` (vLLM serves it in dev mode, where alone a pause can be sent;
no metric says it), and followed only while the server is awake (a sleep pauses too). The cordon: an
operator's call (``control/worker_admin.py``), over NATS also the worker's heartbeat, and a ``serve`` restart with
``control_plane.admin_state_file`` (``control/admin_state.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)


def apply_asleep(fleet: Fleet, worker_id: str, asleep: bool, why: str) -> None:
    """The one place a worker's sleep mark changes: routing prefers the awake, held requests pumped when one wakes;
    the gauge follows."""
    if worker_id in fleet.workers:
        _mark(fleet, fleet.asleep, worker_id, asleep, fleet.metrics.asleep, why,
              ("asleep: routed to only while no awake worker can take a request", "awake: back in routing"))


def apply_paused(fleet: Fleet, worker_id: str, paused: bool, why: str) -> None:
    """The one place a worker's pause mark changes (vLLM's ``/pause`` and ``/resume`` through ThunderAgent, the
    server's ``/is_paused`` read with every load poll while it is awake; over NATS also the worker's heartbeat): a
    paused server holds new requests until it resumes, so routing sends it requests
    only while no other worker can take them (a fleet-wide pause: they wait in the servers, as before)."""
    if worker_id in fleet.workers:
        _mark(fleet, fleet.paused, worker_id, paused, fleet.metrics.paused, why,
              ("paused: routed to only while no other worker can take a request", "resumed: back in routing"))


def apply_cordon(fleet: Fleet, worker_id: str, cordoned: bool, why: str) -> None:
    """The one place a worker's cordon mark changes (an operator's call; over NATS also the worker's heartbeat,
    which carries the mark to every frontend): routing, the gauge, held requests pumped when it is back."""
    _mark(fleet, fleet.cordoned, worker_id, cordoned, fleet.metrics.cordoned, why,
          ("cordoned: out of routing", "uncordoned: back in routing"))


def _mark(fleet: Fleet, marked: set[str], worker_id: str, on: bool, gauge: Gauge | None, why: str,
          said: tuple[str, str]) -> None:
    if on == (worker_id in marked):
        return
    if on:
        marked.add(worker_id)
    else:
        marked.discard(worker_id)
        fleet.wake()  # held requests may go there now
    if gauge is not None:
        gauge.labels(worker_id).set(1 if on else 0)
    log.warning("worker %s %s (%s)", worker_id, said[0] if on else said[1], why)
