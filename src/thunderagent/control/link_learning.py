"""What teaches a transfer plane's links (``TransferPlane.learn``) in the live fleet: the KV moves that landed.

Both movers of KV between workers report here when a move landed: the prefill/decode flow's handoffs
(``control/pd_plane.py``) and cache migration's copies (``control/cache_migration.py``). A move's own duration
never teaches its link (a handoff's includes the prefill, a copy's the source's one-token job and both sides'
queueing: they would teach a wrong bandwidth). What does:

- a worker that moved the bytes itself (simulated workers, ``execution/kv_bytes.py``) reports its pull's own
  duration (:class:`~thunderagent.types.KvPull`), one sample for the move's link;
- a vLLM server reports its NIXL connector's reads on its ``/metrics`` (bytes and seconds summed over its
  transfers, and their count: the transfer alone, from its post to its completion), read with each load poll.
  The growth between two readings is one sample for the links into that server from the workers whose moves
  started or landed there in the last :data:`LANDED_WINDOW_S` (a server's metrics do not name the source: with
  several, each of their links learns the server's mean rate). A move counts from its start: a reading taken
  between the server's pull and the move's end (its request's answer) already holds the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import Counter

from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import KvPull

#: a move that landed on a worker this recently (seconds) counts as a source of its server's next pulls
LANDED_WINDOW_S = 60.0
#: every this many server readings, those of workers that left are dropped
PRUNE_EVERY = 256


class LinkLearner:
    """One plane's links, taught by the moves that landed on it. ``learned``: the samples taken, by source
    (``pull``: a worker's own pull, ``server``: a server's NIXL metrics); ``workers``: the ids registered now."""

    def __init__(self, plane: TransferPlane, learned: Counter, workers: Callable[[], Iterable[str]]) -> None:
        self.plane = plane
        self._learned = learned
        self._workers = workers
        self._landed: dict[str, dict[str, float]] = {}  # target -> source -> when a move last landed
        self._pulls: dict[str, tuple[float, float, float]] = {}  # target -> its server's pulls at last reading
        self._readings = 0

    def started(self, src: str, dst: str, now: float) -> None:
        """A move of KV from ``src`` to ``dst`` starts: the server's readings from now on may hold its bytes."""
        self._landed.setdefault(dst, {})[src] = now

    def landed(self, src: str, dst: str, now: float, pull: KvPull | None) -> None:
        """A move of KV from ``src`` to ``dst`` landed; ``pull``: the target's own measure of it, if it moved the
        bytes itself (else its server's metrics will say how fast: :meth:`on_server_pulls`)."""
        if pull is not None and pull.cause == "ok":
            self.plane.learn(src, dst, pull.nbytes, pull.seconds)
            self._learned.labels("pull").inc()
        else:
            self._landed.setdefault(dst, {})[src] = now

    def on_server_pulls(self, dst: str, nbytes: float, seconds: float, transfers: float, now: float) -> None:
        """Worker ``dst``'s server read ``nbytes`` of KV in ``transfers`` transfers taking ``seconds`` in all, so far
        (cumulative: its NIXL metrics). What grew since the last reading teaches the links into ``dst`` from the
        workers whose moves landed there within :data:`LANDED_WINDOW_S`; a reading below the last (the server
        restarted) is only the new baseline."""
        last = self._pulls.get(dst)
        self._pulls[dst] = (nbytes, seconds, transfers)
        self._readings += 1
        if self._readings % PRUNE_EVERY == 0:
            self._forget_departed()
        if last is None or nbytes < last[0] or seconds < last[1] or transfers < last[2]:
            return
        db, ds, dn = nbytes - last[0], seconds - last[1], transfers - last[2]
        if dn < 1 or ds <= 0 or db <= 0:
            return
        landed = self._landed.get(dst, {})
        for src in [s for s, t in landed.items() if now - t > LANDED_WINDOW_S]:
            del landed[src]
        for src in landed:
            self.plane.learn(src, dst, int(db), ds, transfers=int(dn))
            self._learned.labels("server").inc()

    def _forget_departed(self) -> None:
        """Readings and landings of workers no longer registered go (one that comes back under its id starts
        again)."""
        here = set(self._workers())
        for w in [w for w in self._pulls if w not in here]:
            del self._pulls[w]
        for w in [w for w in self._landed if w not in here]:
            del self._landed[w]
        for landed in self._landed.values():
            for w in [w for w in landed if w not in here]:
                del landed[w]

    def links(self) -> list[dict[str, object]]:
        """The plane's link estimates (for ``/health``): configured, probed or learned."""
        return [{"src": src, "dst": dst, "bandwidth_gbps": round(ln.bandwidth_bps * 8 / 1e9, 6),
                 "latency_s": ln.latency_s, "samples": ln.samples} for (src, dst), ln in self.plane.links.items()]
