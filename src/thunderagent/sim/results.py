"""Result records of simulation runs (ours and Dynamo's), in the JSON shape `thunderagent sim` writes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field


@dataclass(slots=True, frozen=True)
class Dist:
    """Summary of a latency distribution in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values_ms: Sequence[float]) -> Dist:
        """Exact mean; percentiles by nearest rank ``round((n-1)*q)`` (Dynamo's rank rule)."""
        if not values_ms:
            return Dist(math.nan, math.nan, math.nan, math.nan)
        return Dist._of_sorted(sorted(values_ms))

    @staticmethod
    def _of_sorted(xs: list[float]) -> Dist:
        n = len(xs)

        def pct(q: float) -> float:
            return xs[min(n - 1, int(math.floor((n - 1) * q + 0.5)))]

        return Dist(sum(xs) / n, pct(0.5), pct(0.9), pct(0.99))

    @staticmethod
    def of_counts(counts: Mapping[float, int]) -> Dist:
        """:meth:`of` for a value -> multiplicity map: the same sorted list, summed in the same
        order, so the figures are bit-identical (without sorting one entry per token)."""
        xs: list[float] = []
        for v in sorted(counts):
            xs.extend(itertools.repeat(v, counts[v]))
        return Dist._of_sorted(xs) if xs else Dist.of(xs)


@dataclass(slots=True)
class RunResult:
    system: str  # "thunderagent" | "dynamo"
    policy: str  # round_robin | kv_aware | kv_router ...
    requests: int
    ttft_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    prefix_reuse: float  # prompt tokens served from cache / prompt tokens
    prefill_recompute_rate: float  # prompt tokens prefilled although some worker held them / prompt tokens
    throughput_rps: float
    wall_s: float
    extra: dict[str, object] = field(default_factory=dict)
    #: wall time of one routing decision in µs (ours: prompt hashing, admission and routing, timed by the
    #: simulator's driver; None where not measured). Like ``wall_s``, it varies from run to run.
    decision_us: Dist | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)
