"""Which frontend of a bus acts for the fleet: the one that runs the scaling planner's actions.

Every frontend replica (``thunderagent frontend``) runs the planner (README: "Scaling planner"), so with
two replicas both would call the operator's command for the same step and scale twice. One acts: among
the frontends heard within the lease whose planner can act (on, with a command, a webhook or a Deployment
to scale), the one that started first (ties: the smaller id). Each frontend computes this from the same
beats (``<p>.frontend.<id>.hb`` carries its start time), so they agree without a vote; a frontend that
starts later never takes over from a live leader, and when the leader stops beating the next oldest takes
over one lease later. The others still compute and show their advice; they do not act on it.

Cache migration's copies (``routing.migration``) are planned by one frontend the same way, chosen among those
that run it (their beats say so): two migrators would copy the same hot prefix twice (:meth:`Leadership.copying`).

Time is measured on the beats themselves: a frontend hears its own beat on the same subscription as the
others', and a peer counts as gone only once this frontend heard its *own* beat more than a lease after
the peer's last one. So a frontend whose event loop stalled (the peers' beats wait unread) does not
declare them gone and itself leader when it wakes; until it hears its own beat again it holds (neither
it nor, through it, anyone is sure). A frontend that never hears its own beat (no permission to subscribe
to the beats) cannot know its peers: after ``DEAF_LEASES`` leases it acts on its own, as every frontend
did before leadership existed, and says so (``summary()["state"]: "deaf"``). One that heard its own beat
before and no longer does (a stalled loop, a bus down) holds until it hears it again.

Pure: time passed in (the fleet's clock); start times are wall-clock seconds from each frontend, compared
only with each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: leases without hearing its own beat after which a frontend stops waiting for the bus and acts alone
DEAF_LEASES = 3
#: a peer silent this many leases is forgotten (its id is random per process: restarts would pile up)
FORGET_LEASES = 20


@dataclass(slots=True)
class Peer:
    frontend_id: str
    started_at: float  # its wall clock at start
    acts: bool  # its planner can act (on, with a command, webhook or Kubernetes Deployment)
    seen: float  # when its latest beat arrived here (our clock)
    copies: bool = False  # it runs cache migration


class Leadership:
    def __init__(self, self_id: str, started_at: float, acts: bool, lease_s: float, now: float,
                 copies: bool = False) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.self_id = self_id
        self.started_at = started_at
        self.acts = acts
        self.copies = copies
        self.lease_s = lease_s
        self._created = now
        self._self_seen: float | None = None  # when our own beat last came back
        self._peers: dict[str, Peer] = {}

    def heard(self, frontend_id: str, started_at: float, acts: bool, now: float, copies: bool = False) -> None:
        """A frontend's beat arrived (ours included)."""
        if frontend_id == self.self_id:
            self._self_seen = now
            self._forget(now)
            return
        peer = self._peers.get(frontend_id)
        if peer is None:
            self._peers[frontend_id] = Peer(frontend_id, started_at, acts, now, copies)
        else:
            peer.started_at, peer.acts, peer.seen, peer.copies = started_at, acts, now, copies

    def state(self, now: float) -> str:
        """``alone``: hears no other frontend (acts if its planner can); ``leader`` / ``follower``;
        ``starting``: its own beat not heard yet; ``unsure``: its own beat, heard before, is now late (a
        stalled loop or bus: it holds however long that lasts, as its view of the fleet is stale too);
        ``deaf``: never heard its own beat ``DEAF_LEASES`` leases after start, acts alone."""
        if self._self_seen is None:
            return "starting" if now - self._created <= DEAF_LEASES * self.lease_s else "deaf"
        if now - self._self_seen > self.lease_s:
            return "unsure"
        if not self.live_peers():
            return "alone"
        return "leader" if self.leader() == self.self_id else "follower"

    def acting(self, now: float) -> bool:
        """Whether this frontend's planner should act now."""
        if not self.acts:
            return False
        return self.state(now) in ("alone", "leader", "deaf")

    def copying(self, now: float) -> bool:
        """Whether this frontend's cache migration should plan copies now: it runs it and, among the live frontends
        that do, started first (alone or deaf: it does; starting or unsure: it holds, as for the planner)."""
        if not self.copies:
            return False
        st = self.state(now)
        return st in ("alone", "deaf") or (st in ("leader", "follower") and self.copier() == self.self_id)

    def copier(self) -> str | None:
        """The frontend planning cache migration's copies among the live ones (None: none of them runs it)."""
        return self._oldest(self.copies, [p for p in self.live_peers() if p.copies])

    def live_peers(self) -> list[Peer]:
        """Other frontends heard within a lease of our own latest beat (none before we heard it)."""
        if self._self_seen is None:
            return []
        ref = self._self_seen
        return [p for p in self._peers.values() if ref - p.seen <= self.lease_s]

    def leader(self) -> str | None:
        """The acting frontend among the live ones (None: none of them can act)."""
        return self._oldest(self.acts, [p for p in self.live_peers() if p.acts])

    def _oldest(self, mine: bool, peers: list[Peer]) -> str | None:
        """The first started (ties: the smaller id) of ``peers`` and, when ``mine``, this frontend."""
        best: tuple[float, str] | None = (self.started_at, self.self_id) if mine else None
        for p in peers:
            if best is None or (p.started_at, p.frontend_id) < best:
                best = (p.started_at, p.frontend_id)
        return None if best is None else best[1]

    def summary(self, now: float) -> dict[str, Any]:
        return {"id": self.self_id, "state": self.state(now), "acting": self.acting(now),
                "leader": self.leader() if self._self_seen is not None else None,
                "frontends": sorted([self.self_id, *(p.frontend_id for p in self.live_peers())])}

    def _forget(self, now: float) -> None:
        gone = [f for f, p in self._peers.items() if now - p.seen > FORGET_LEASES * self.lease_s]
        for f in gone:
            del self._peers[f]
