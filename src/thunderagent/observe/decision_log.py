"""The decision log: one JSON line per routing decision, sampled by request id, rotated by size.

Both drivers write it through :class:`DecisionLog` (the live fleet, ``control/decision_hook.py``;
the simulator, ``thunderagent sim --decision-log``): the line is built from the same
:class:`~thunderagent.scheduler.dispatch.Dispatch`. ``thunderagent explain --log`` reads it back
(:mod:`thunderagent.observe.decision_summary`).

Writes are buffered: a line is encoded (msgspec) and appended to a list; the list goes to the file
when it holds ``FLUSH_BYTES``, when ``FLUSH_S`` passed since the last write (checked at the next
line and by :meth:`flush_due`, which the live fleet calls from its health check), or on
:meth:`flush` / :meth:`close`. A write is one ``write`` of at most ``FLUSH_BYTES`` per file, so the event loop is
never held for long. Rotation is by size, like ``logging.handlers.RotatingFileHandler``: before a
line would take the file past ``max_bytes``, ``path`` becomes ``path.1`` (``path.1`` becomes
``path.2``, ..., the oldest beyond ``backups`` is dropped); with ``backups: 0`` the file starts over.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from thunderagent.config import DecisionLogConfig
from thunderagent.scheduler.dispatch import Dispatch

__all__ = ["DecisionLog", "decision_line", "sampled"]

#: buffered bytes that trigger a write (bounded: one write never blocks the loop for long)
FLUSH_BYTES = 64 * 1024
#: seconds a line may wait in the buffer (checked when the next line comes)
FLUSH_S = 1.0

_SCALE = float(1 << 64)


def sampled(request_id: str, rate: float) -> bool:
    """Whether ``request_id`` is logged at ``rate``: a pure function of the id, so every decision of
    one request (routed again, migrated) is logged or none is; 1.0 logs all, 0.0 none."""
    if rate >= 1.0:
        return True
    h = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")
    return h < rate * _SCALE


def decision_line(d: Dispatch, t: float, *, program: str | None = None, tried: Iterable[str] = (),
                  skipped: dict[str, str] | None = None, run: str | None = None) -> dict[str, object]:
    """The log line of one decision: ``t`` (the driver's time: wall clock live, virtual in the
    simulator), the decision's explanation, what the index knew, and the workers left out."""
    dec = d.decision
    line: dict[str, object] = {
        "t": round(t, 6),
        "request_id": dec.request_id,
        "worker": dec.worker_id,
        "policy": dec.policy,
        "reason": dec.reason,
        "prompt_tokens": len(d.request.prompt_tokens),
        "overlap_blocks": dec.overlap_blocks,
        "predicted_tokens": d.predicted_tokens,
        "best_known_tokens": d.best_known_tokens,
        "queue_wait": round(d.queue_wait, 6),
        "candidates": [
            {"worker": c.worker_id, "overlap_blocks": c.overlap_blocks, "busy": c.busy, "cost": round(c.cost, 3),
             "queued_prefill_tokens": c.queued_prefill_tokens, "kv_usage": round(c.kv_usage, 4)}
            for c in dec.candidates
        ],
    }
    if d.affinity:  # sent ahead of the queue's next for its cache on a free worker (scheduler/affinity.py)
        line["affinity"] = True
    if program is not None:
        line["program"] = program
    tried = list(tried)
    if tried:
        line["tried"] = tried
    if skipped:
        line["skipped"] = skipped
    hot = dec.hot_prefix
    if hot is not None:
        line["hot_prefix"] = {"prefix_blocks": hot.prefix_blocks, "holders": list(hot.holders),
                              "replicas": list(hot.replicas), "added": hot.added}
    if run is not None:
        line["run"] = run
    return line


class DecisionLog:
    """Writer of the decision log (see the module docstring). Not thread-safe: one event loop or one
    simulator writes it. ``clock`` (monotonic seconds) only paces buffer flushes."""

    def __init__(self, cfg: DecisionLogConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        if cfg.path is None:
            raise ValueError("DecisionLog needs decision_log.path")
        self.path = Path(cfg.path)
        self.sample_rate = cfg.sample_rate
        self.max_bytes = cfg.max_bytes
        self.backups = cfg.backups
        self._clock = clock
        self._enc = msgspec.json.Encoder()
        self._buf: list[bytes] = []
        self._buffered = 0
        self._last_write = clock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")  # noqa: SIM115 - held open for the log's life, closed by close()
        self._size = self._fh.tell()
        self.written = 0  # lines logged (sampled in)

    @classmethod
    def from_config(cls, cfg: DecisionLogConfig) -> DecisionLog | None:
        """The writer, or None when the log is off (no path)."""
        return None if cfg.path is None else cls(cfg)

    def wants(self, request_id: str) -> bool:
        return sampled(request_id, self.sample_rate)

    def record(self, d: Dispatch, t: float, **extra: object) -> bool:
        """Log ``d`` if its request is sampled in (``extra``: :func:`decision_line`'s keywords).
        Returns whether it was logged."""
        if not sampled(d.decision.request_id, self.sample_rate):
            return False
        self.write(decision_line(d, t, **extra))  # type: ignore[arg-type]
        return True

    def write(self, line: dict[str, object]) -> None:
        """Append one line (already sampled)."""
        data = self._enc.encode(line) + b"\n"
        self._buf.append(data)
        self._buffered += len(data)
        self.written += 1
        if self._buffered >= FLUSH_BYTES or self._clock() - self._last_write >= FLUSH_S:
            self.flush()

    def flush_due(self) -> None:
        """Flush if lines waited ``FLUSH_S`` (called periodically, so a quiet server's lines land too)."""
        if self._buf and self._clock() - self._last_write >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Write the buffered lines, rotating before a line would take the file past ``max_bytes``."""
        chunk: list[bytes] = []
        size = self._size
        for data in self._buf:
            if size and size + len(data) > self.max_bytes:
                self._fh.write(b"".join(chunk))
                chunk = []
                self._rotate()
                size = 0
            chunk.append(data)
            size += len(data)
        if chunk:
            self._fh.write(b"".join(chunk))
        self._fh.flush()
        self._size = size
        self._buf.clear()
        self._buffered = 0
        self._last_write = self._clock()

    def _rotate(self) -> None:
        self._fh.close()
        if self.backups:
            for k in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{k}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{k + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fh = open(self.path, "wb")  # noqa: SIM115 - see __init__
        self._size = 0

    def close(self) -> None:
        """Flush and close (shutdown); idempotent."""
        if self._fh.closed:
            return
        self.flush()
        self._fh.close()
