"""Which workers' servers sleep (vLLM's sleep mode), as the fleet routes: ``Fleet.asleep``. A sleeping vLLM server
holds new requests until it wakes, so routing sends a request to one only while no awake worker can take it.

Three sources keep the mark, all through :func:`apply_asleep`: a sleep or wake-up asked through this frontend
(``control/server_admin.py``, at once), the server's own ``vllm:engine_sleep_state`` gauge read with every load poll
(``execution/engine_poll.py``: a server put to sleep behind ThunderAgent's back, or before it started, is noticed
within a poll), and over NATS the worker process's heartbeats (``control/nats_membership.py``).
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
