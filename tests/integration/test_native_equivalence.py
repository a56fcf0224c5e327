"""The compiled core (routing decision and simulated engine) runs exactly as its pure-Python source: the
same replay, run once on this install and once on a copy of the sources without the extension modules,
gives the same TTFT of every request, the same requests per worker and the same cache figures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from thunderagent import native

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "data" / "mooncake_excerpt.jsonl"

REPLAY = f"""
import json, sys
from thunderagent import native
from thunderagent.config import Config, Policy
from thunderagent.sim.driver import Simulator
from thunderagent.sim.generators import shared_prefix
from thunderagent.sim.traces import load_trace

cfg = Config()
node = cfg.execution_group.nodes[0]
small = node.model_copy(update={{"kv_blocks": 700}})  # the engines' pools overflow: preemptions, evictions
runs = {{}}
# the trace excerpt on 4 workers (scored whole), the same on 2 small workers, and shared prefixes on 24
# (routed through the selection)
for name, n, workers, reqs, speedup in (
        ("mooncake", node, 4, load_trace({str(TRACE)!r}), 4.0),
        ("small", small, 2, load_trace({str(TRACE)!r}), 1.0),
        ("shared", node, 24, shared_prefix(8, 2048, (64, 512), 600, 120.0, 16, seed=3), 1.0)):
    sim = Simulator(n, cfg.routing, workers, Policy.kv_aware, seed=3)
    out = sim.run(reqs, speedup)
    r = out.result
    runs[name] = {{"ttft": out.ttft_by_id, "per_worker": out.requests_per_worker, "reuse": r.prefix_reuse,
                  "recompute": r.prefill_recompute_rate, "requests": r.requests,
                  "itl": [r.itl_ms.mean, r.itl_ms.p99], "e2e": [r.e2e_ms.mean, r.e2e_ms.p99],
                  "engines": [[e.busy_ns, e.prefill_tokens, e.preemptions] for e in sim.engines]}}
json.dump({{"compiled": len(native.state().compiled), "runs": runs}}, sys.stdout)
"""


def _replay(pythonpath: str | None) -> dict:
    env = None
    if pythonpath is not None:
        import os

        env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", REPLAY], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_compiled_and_pure_python_replay_identically(tmp_path: Path) -> None:
    if not native.state().compiled:
        pytest.skip("this install runs the pure-Python modules (built without a C compiler or with "
                    "THUNDERAGENT_PURE_PYTHON=1): nothing compiled to compare")
    pure = tmp_path / "src"
    shutil.copytree(ROOT / "src", pure, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    compiled = _replay(None)
    interpreted = _replay(str(pure))
    assert compiled["compiled"] == len(native.MODULES) and interpreted["compiled"] == 0
    for name, n in (("mooncake", 200), ("small", 200), ("shared", 600)):
        a, b = compiled["runs"][name], interpreted["runs"][name]
        assert a["requests"] == b["requests"] == n
        assert a["ttft"] == b["ttft"]  # every request's TTFT, to the last bit
        assert a["per_worker"] == b["per_worker"]
        assert (a["reuse"], a["recompute"]) == (b["reuse"], b["recompute"])
        assert (a["itl"], a["e2e"]) == (b["itl"], b["e2e"])  # the engines' passes: every token's time
        assert a["engines"] == b["engines"]  # busy time, computed prompt tokens, preemptions per engine
    # the small workers' pools overflowed: the engines preempted (the compiled eviction path ran)
    assert sum(e[2] for e in compiled["runs"]["small"]["engines"]) > 0
    # the replays exercised the cache-aware choice across a fleet
    assert compiled["runs"]["shared"]["reuse"] > 0.5
    assert sum(1 for n in compiled["runs"]["shared"]["per_worker"] if n) > 8
