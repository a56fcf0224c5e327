"""The bus wire of cache migration's demand shared between frontends (``bus.wire`` has the other messages). Pure.

    <p>.frontend.<id>.demand   frontend -> frontends   MigrationDemand: its most-demanded prefixes, every look

One frontend plans the copies (``control/leadership.py``); every frontend running ``routing.migration`` reports
what its own requests asked for, so the planning one weighs the fleet's demand, not its share of it
(``control/migration_peers.py``). Frontends' NATS users already publish and subscribe ``<p>.frontend.>``.
"""

from __future__ import annotations

import msgspec

from thunderagent.bus.wire import Subjects


class MigrationDemand(msgspec.Struct, array_like=True, frozen=True):
    """Frontend ``origin``'s demand now: (prefix key, decayed requests) pairs, most demanded first. A prefix's
    key is its last block's hash (the same on every frontend: the hashes are the fleet's)."""

    origin: str
    entries: list[tuple[int, float]]


def demand_subject(subjects: Subjects, frontend_id: str) -> str:
    return f"{subjects.prefix}.frontend.{frontend_id}.demand"


def all_demand(subjects: Subjects) -> str:
    return f"{subjects.prefix}.frontend.*.demand"


decode_migration_demand = msgspec.msgpack.Decoder(MigrationDemand).decode
