"""Token accounting of a replay without per-token outputs.

Live, the simulated engine hands every token to its driver as a ``TokenOutput`` (the server streams
them one by one). A replay only needs each request's first token (TTFT, followers), its finish
(end-to-end time, token count) and the multiset of inter-token latencies. Building 4 million output
objects for that was the largest single cost of a full Mooncake replay, so in accounting mode the
engine emits outputs only for first tokens and finishes and keeps the rest here:

* ``itl``: inter-token latency in ms -> how many tokens had it. The decoders of one pass that also
  emitted in the engine's previous pass share one value, so a pass costs one dict update. The value
  is computed exactly as a driver computes it from outputs, ``(t / 1e9 - t_prev / 1e9) * 1e3``, and
  the summary sorts its values before summing (:meth:`Dist.of_counts`), so the figures are
  bit-identical to the per-token path.
* ``finals``: request id -> (tokens generated, time of its last token in s, -1.0 if none), recorded
  when a request finishes or is aborted; the driver pops it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenAccounting:
    itl: dict[float, int] = field(default_factory=dict)
    finals: dict[str, tuple[int, float]] = field(default_factory=dict)

    def add_itl(self, value_ms: float, count: int) -> None:
        itl = self.itl
        itl[value_ms] = itl.get(value_ms, 0) + count

    def merge_into(self, total: dict[float, int]) -> None:
        for v, c in self.itl.items():
            total[v] = total.get(v, 0) + c
