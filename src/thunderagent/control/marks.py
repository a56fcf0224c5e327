"""An operator's marks on workers, each changed in one place: the cordon (out of routing until uncordoned) and the
sleep mark (``Fleet.asleep``: vLLM's sleep mode). A sleeping vLLM server holds new requests until it wakes, so
routing sends a request to one only while no awake worker can take it.

Three sources keep the sleep mark, all through :func:`apply_asleep`: a sleep or wake-up asked through this frontend
(``control/server_admin.py``, at once), the server's own ``vllm:engine_sleep_state`` gauge read with every load poll
(``execution/engine_poll.py``: a server put to sleep behind ThunderAgent's back, or before it started, is noticed
within a poll), and over NATS the worker process's heartbeats (``control/nats_membership.py``). The cordon: an
operator's call (``control/worker_admin.py``), over NATS also the worker's heartbeat, and a ``serve`` restart with
``control_plane.admin_state_file`` (``control/admin_state.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)


def apply_asleep(fleet: Fleet, worker_id: str, asleep: bool, why: str) -> None:
    """The one place a worker's sleep mark changes: routing prefers the awake, held requests pumped when one wakes;
    the gauge follows."""
    if asleep == (worker_id in fleet.asleep) or worker_id not in fleet.workers:
        return
    if asleep:
        fleet.asleep.add(worker_id)
    else:
        fleet.asleep.discard(worker_id)
        fleet.wake()
    fleet.metrics.asleep.labels(worker_id).set(1 if asleep else 0)
    log.warning("worker %s %s (%s)", worker_id, "asleep: routed to only while no awake worker can take a request"
                if asleep else "awake: back in routing", why)


def apply_paused(fleet: Fleet, worker_id: str, paused: bool, why: str) -> None:
    """The one place a worker's pause mark changes (vLLM's ``/pause`` and ``/resume`` through ThunderAgent; over NATS
    also the worker's heartbeat): a paused server holds new requests until it resumes, so routing sends it requests
    only while no other worker can take them (a fleet-wide pause: they wait in the servers, as before)."""
    if paused == (worker_id in fleet.paused) or worker_id not in fleet.workers:
        return
    if paused:
        fleet.paused.add(worker_id)
    else:
        fleet.paused.discard(worker_id)
        fleet.wake()
    log.warning("worker %s %s (%s)", worker_id, "paused: routed to only while no other worker can take a request"
                if paused else "resumed: back in routing", why)


def apply_cordon(fleet: Fleet, worker_id: str, cordoned: bool, why: str) -> None:
    """The one place a worker's cordon mark changes (an operator's call; over NATS also the worker's heartbeat,
    which carries the mark to every frontend): routing, the gauge, held requests pumped when it is back."""
    if cordoned == (worker_id in fleet.cordoned):
        return
    if cordoned:
        fleet.cordoned.add(worker_id)
    else:
        fleet.cordoned.discard(worker_id)
        fleet.wake()  # held requests may go there now
    fleet.metrics.cordoned.labels(worker_id).set(1 if cordoned else 0)
    log.warning("worker %s %s (%s)", worker_id, "cordoned: out of routing" if cordoned else
                "uncordoned: back in routing", why)
