"""The ramp workload (sim.generators.ramp): rate up, hold, down; shared prefixes; deterministic."""

from __future__ import annotations

import pytest

from thunderagent.sim.generators import ramp


def test_ramp_shape() -> None:
    reqs = ramp(4, 100, 10, 20.0, base_rate=2.0, ramp_up_s=100, hold_s=100, ramp_down_s=100, seed=3)
    assert reqs == ramp(4, 100, 10, 20.0, base_rate=2.0, ramp_up_s=100, hold_s=100, ramp_down_s=100, seed=3)
    counts = [sum(1 for r in reqs if k * 50 <= r.arrival_s < (k + 1) * 50) for k in range(6)]
    assert counts[0] < counts[1] < counts[2] and counts[5] < counts[4] < counts[3]
    assert sum(counts[2:4]) == pytest.approx(2000, rel=0.1)  # the hold at 20 req/s for 100 s
    assert all(r.input_length == 128 + 10 for r in reqs)  # prefix rounded up to 2 blocks of 64, + suffix
    groups = {tuple(r.block_ids[:2]) for r in reqs}
    assert len(groups) == 4 and reqs[0].arrival_s == 0.0
    with pytest.raises(ValueError, match="base_rate <= peak_rate"):
        ramp(1, 64, 1, 1.0, base_rate=2.0, ramp_up_s=1, hold_s=1, ramp_down_s=1)
