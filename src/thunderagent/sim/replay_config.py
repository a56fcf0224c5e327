"""What a replay changes in the serving config: the double-hash guard is off unless asked for.

The guard (``routing.double_hash``, :mod:`thunderagent.kv.check`) verifies blocks hashed by different
sources (a real engine's events, another frontend, a dump) against the router's own hashes. In a
replay every block is hashed by this code base, the router's predictions and the simulated engines'
events alike, so the guard can only catch a true 64-bit collision between two prompts of the trace
(which it would turn into a miss), and it cost a quarter of a replay's CPU (the full Mooncake trace:
25 s -> 17-20 s for round robin, 23 s -> 18-19 s for kv_aware, every figure identical). A config file that
sets ``routing.double_hash`` itself is followed, either way.
"""

from __future__ import annotations

from thunderagent.config import RoutingConfig

__all__ = ["replay_routing"]


def replay_routing(routing: RoutingConfig) -> RoutingConfig:
    """``routing`` for a replay: as given when it sets ``double_hash`` itself, else with the guard off."""
    if "double_hash" in routing.model_fields_set or not routing.double_hash:
        return routing
    return routing.model_copy(update={"double_hash": False})
