"""The transfer plane: which KV moves between workers, when, and what it is expected to cost.

Pure and synchronous (``now`` is passed in); a driver moves the bytes (the simulator on its virtual
clock, the live fleet over a connection) and reports each transfer's end with :meth:`finish`.

* **Admission** (:meth:`refusal`): a cache larger than ``max_transfer_bytes`` is not moved; a
  transfer that would push the decode worker's active KV over ``target_watermark`` is refused.
* **Backpressure**: at most ``max_inflight`` transfers and ``max_inflight_bytes`` bytes move at once.
  :meth:`start` of one more returns None and queues it (FIFO); :meth:`finish` starts the queued ones
  that now fit and returns them. :meth:`room` says whether a new one would start at once (the
  conditional decision prefills locally rather than wait).
* **Estimates** per link (source, destination): ``bytes / bandwidth + latency``, the bandwidth the
  configured default until transfers on that link completed, then an EWMA of what they measured.
* **Counters** as plain fields: started, completed, failures and fallbacks by cause, bytes moved,
  peaks, a duration histogram.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from thunderagent.config import KvTransferConfig

#: upper bounds (seconds) of the duration histogram's buckets; the last bucket is open
DURATION_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class Transfer:
    """One KV transfer: ``tid`` is the driver's key (the request id)."""

    tid: str
    src: str
    dst: str
    nbytes: int
    queued_at: float
    started_at: float = -1.0  # -1 while queued
    estimate_s: float = 0.0  # at start: the link's estimate then
    deadline: float = 0.0  # at start: past it the transfer is cut (``timeout_factor`` x the estimate)


@dataclass(slots=True)
class Link:
    bandwidth_bps: float  # bytes per second
    latency_s: float
    samples: int = 0  # completed transfers measured on this link


@dataclass(slots=True)
class PlaneStats:
    started: int = 0
    completed: int = 0
    bytes_moved: int = 0
    waited: int = 0  # transfers that queued behind the in-flight cap
    peak_inflight: int = 0
    peak_inflight_bytes: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # by cause (timeout, interrupted, ...)
    fallbacks: dict[str, int] = field(default_factory=dict)  # requests prefilled locally after all, by cause
    durations: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS_S) + 1))

    def as_dict(self) -> dict[str, object]:
        return {"started": self.started, "completed": self.completed, "bytes_moved": self.bytes_moved,
                "waited": self.waited, "peak_inflight": self.peak_inflight,
                "peak_inflight_bytes": self.peak_inflight_bytes, "failures": dict(self.failures),
                "fallbacks": dict(self.fallbacks),
                "duration_buckets_s": {f"le_{b}": n for b, n in zip((*DURATION_BUCKETS_S, "inf"), self.durations)}}


class TransferPlane:
    def __init__(self, cfg: KvTransferConfig) -> None:
        self.cfg = cfg
        self.default_bps = cfg.bandwidth_gbps * 1e9 / 8
        self.links: dict[tuple[str, str], Link] = {}
        self.inflight: dict[str, Transfer] = {}
        self.inflight_bytes = 0
        self.queue: deque[Transfer] = deque()
        self.stats = PlaneStats()
        for m in cfg.links:  # measured by ``thunderagent probe-links``: the starting estimates
            self.links[(m.src, m.dst)] = Link(m.bandwidth_gbps * 1e9 / 8, m.latency_s)

    # ------------------------------------------------------------------------------ estimates
    def link(self, src: str, dst: str) -> Link:
        ln = self.links.get((src, dst))
        if ln is None:
            ln = self.links[(src, dst)] = Link(self.default_bps, self.cfg.latency_s)
        return ln

    def estimate(self, src: str, dst: str, nbytes: int) -> float:
        """Seconds to move ``nbytes`` from ``src`` to ``dst`` (bytes / bandwidth + latency)."""
        ln = self.links.get((src, dst))
        if ln is None:
            return nbytes / self.default_bps + self.cfg.latency_s
        return nbytes / ln.bandwidth_bps + ln.latency_s

    def learn(self, src: str, dst: str, nbytes: int, seconds: float, transfers: int = 1) -> None:
        """``nbytes`` moved from ``src`` to ``dst`` in ``transfers`` transfers taking ``seconds`` in all (each
        one's latency included): the link's bandwidth estimate takes it in (EWMA). The live fleet calls it with
        the decode worker's own measure of its pulls (a plan's duration there includes the prefill)."""
        ln = self.link(src, dst)
        moving = seconds - transfers * ln.latency_s
        if moving > 0 and nbytes:
            a = self.cfg.ewma_alpha
            ln.bandwidth_bps = (1 - a) * ln.bandwidth_bps + a * (nbytes / moving)
            ln.samples += 1

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.cfg.bytes_per_token

    # ------------------------------------------------------------------------------ admission
    def refusal(self, nbytes: int, blocks: int, target_active: int, target_total: int) -> str | None:
        """Why a transfer of ``nbytes`` (``blocks`` KV blocks) to a worker with ``target_active`` of
        ``target_total`` blocks active must not happen (None: it may)."""
        cfg = self.cfg
        if nbytes > cfg.max_transfer_bytes or nbytes > cfg.max_inflight_bytes:
            return "too_large"
        if target_active + blocks > cfg.target_watermark * target_total:
            return "target_full"
        return None

    def room(self, nbytes: int) -> bool:
        """A transfer of ``nbytes`` would start at once (nothing queued, under both caps)."""
        return (not self.queue and len(self.inflight) < self.cfg.max_inflight
                and self.inflight_bytes + nbytes <= self.cfg.max_inflight_bytes)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, tid: str, src: str, dst: str, nbytes: int, now: float) -> Transfer | None:
        """Begin moving ``tid``'s KV: returned when it starts now, None when it waits behind the cap
        (it starts in a later :meth:`finish`). The caller checked :meth:`refusal` first."""
        if tid in self.inflight or any(t.tid == tid for t in self.queue):
            raise ValueError(f"transfer {tid!r} already started")
        t = Transfer(tid, src, dst, nbytes, now)
        if self.room(nbytes):
            self._go(t, now)
            return t
        self.queue.append(t)
        self.stats.waited += 1
        return None

    def finish(self, tid: str, now: float, *, ok: bool, cause: str = "failed", learn: bool = True) -> list[Transfer]:
        """``tid`` ended at ``now`` (``ok``: its bytes arrived; else failed with ``cause``). Its link's
        bandwidth estimate learns from a success (``learn``: False when the duration is not the
        transfer's alone). Returns the queued transfers that start now."""
        t = self.inflight.pop(tid)
        self.inflight_bytes -= t.nbytes
        st = self.stats
        secs = now - t.started_at
        if ok:
            st.completed += 1
            st.bytes_moved += t.nbytes
            if learn:
                self.learn(t.src, t.dst, t.nbytes, secs)
            k = 0
            while k < len(DURATION_BUCKETS_S) and secs > DURATION_BUCKETS_S[k]:
                k += 1
            st.durations[k] += 1
        else:
            st.failures[cause] = st.failures.get(cause, 0) + 1
        return self._drain(now)

    def cancel(self, tid: str) -> bool:
        """Drop a queued transfer (its request went away). True if it was queued."""
        for k, t in enumerate(self.queue):
            if t.tid == tid:
                del self.queue[k]
                return True
        return False

    def fallback(self, cause: str) -> None:
        """A planned remote prefill ended up prefilling locally, because of ``cause``."""
        fb = self.stats.fallbacks
        fb[cause] = fb.get(cause, 0) + 1

    def _go(self, t: Transfer, now: float) -> None:
        t.started_at = now
        t.estimate_s = self.estimate(t.src, t.dst, t.nbytes)
        t.deadline = now + self.cfg.timeout_factor * t.estimate_s
        self.inflight[t.tid] = t
        self.inflight_bytes += t.nbytes
        st = self.stats
        st.started += 1
        n = len(self.inflight)
        assert n <= self.cfg.max_inflight and self.inflight_bytes <= self.cfg.max_inflight_bytes, "cap exceeded"
        st.peak_inflight = max(st.peak_inflight, n)
        st.peak_inflight_bytes = max(st.peak_inflight_bytes, self.inflight_bytes)

    def _drain(self, now: float) -> list[Transfer]:
        out: list[Transfer] = []
        q, cfg = self.queue, self.cfg
        while (q and len(self.inflight) < cfg.max_inflight
               and self.inflight_bytes + q[0].nbytes <= cfg.max_inflight_bytes):
            t = q.popleft()
            self._go(t, now)
            out.append(t)
        return out
