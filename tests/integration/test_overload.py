"""Overload (issue 11 item 6): `thunderagent serve` with 2 simulated workers at 3x what they sustain.

Runs ``bench/overload.py``'s code for a short window (``THUNDERAGENT_OVERLOAD_S``, default 8 s; the
bench runs 60 s) against a real server process with the default admission (the scheduler's bounded
holding queue): no worker falsely marked unhealthy, nothing purged from the index, the excess refused
with 429 + Retry-After, the server's RSS bounded and back near its baseline, healthy and serving
right after."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "overload.py"


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_overload", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_bench_overload"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


async def test_three_times_capacity_is_refused_not_fatal(tmp_path):
    seconds = float(os.environ.get("THUNDERAGENT_OVERLOAD_S", "8"))
    rep = await _bench().run(seconds, 3.0, unloaded_s=2.0, capacity_s=4.0, settle_s=2.0,
                             log_path=tmp_path / "serve.log")
    report = "\n".join(rep.lines())
    ov = rep.overload
    assert rep.capacity_rps > 2, report
    # liveness: nobody falsely declared dead, nothing purged
    assert rep.counters["lease_expired"] == 0 and rep.counters["index_purged"] == 0, report
    assert rep.unhealthy_seen == 0, report
    # the excess is refused with 429 + Retry-After; what is admitted completes
    assert ov.count(429) > 0.3 * len(ov.shots), report
    assert all(s.retry_after and int(s.retry_after) >= 1 for s in ov.shots if s.status == 429), report
    assert set(s.status for s in ov.shots) <= {200, 429}, report
    assert ov.count(200) >= 0.6 * rep.capacity_rps * seconds, report
    # memory bounded during the load and back near its baseline after
    assert rep.rss_peak_mb < rep.rss_base_mb * 1.5 + 20, report
    assert rep.rss_after_mb < rep.rss_base_mb * 1.2 + 10, report
    # healthy and serving right after
    assert rep.health_after[0] == 200 and rep.health_after[1]["healthy_workers"] == 2, report
    assert rep.served_after == 200, report
    if rep.ttft_ratio_p99 > 2.0:
        pytest.xfail(f"admitted TTFT p99 is {rep.ttft_ratio_p99:.2f}x unloaded (target 2x): not met yet, see README "
                     f"'Overload'\n{report}")
