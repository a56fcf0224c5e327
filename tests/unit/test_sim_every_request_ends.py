"""Every replayed request ends, whatever the fleet's shape: a random search (seeded, so any failure
reproduces) over small KV pools, batch limits, chunked prefill on and off, the holding queue,
priorities with preemption, and policies. A request that can never run on its worker is refused (it
ends without a token); none may stay queued when the replay stops. This found three ways requests
were lost: a request outgrowing the pool while decoding idled its engine for good, rejections ended
inside a load report were never collected, and a prompt longer than a pass without chunking blocked
its queue."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from thunderagent.config import Policy, parse_config
from thunderagent.sim.driver import Simulator
from thunderagent.sim.traces import load_traces

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake_excerpt.jsonl"


@pytest.mark.parametrize("trial", range(24))
def test_every_request_ends(trial: int) -> None:
    rng = random.Random(trial)
    node = {"count": rng.randint(1, 3), "kv_blocks": rng.choice([2, 16, 64, 256, 520, 4096]),
            "block_size": rng.choice([16, 64]), "max_num_batched_tokens": rng.choice([512, 2048, 8192]),
            "max_batch_size": rng.choice([4, 256]), "enable_chunked_prefill": rng.random() < 0.6}
    cfg = parse_config({"execution_group": {"nodes": [node]}, "scheduler": {"enabled": rng.random() < 0.5},
                        "routing": {"preempt_enabled": rng.random() < 0.5}})
    reqs = sorted(rng.sample(load_traces([EXCERPT]), rng.randint(10, 60)), key=lambda r: r.arrival_s)
    if rng.random() < 0.5:
        reqs = [dataclasses.replace(r, priority=rng.choice([0, 0, 1, 5])) for r in reqs]
    policy = rng.choice([Policy.kv_aware, Policy.round_robin, Policy.least_loaded])
    out = Simulator(cfg.execution_group.nodes[0], cfg.routing, node["count"], policy, seed=trial,
                    scheduler=cfg.scheduler).run(reqs, rng.choice([1.0, 4.0, 20.0]))
    extra = out.result.extra
    assert (out.result.requests, extra["incomplete_requests"], extra.get("held_at_end", 0)) == (len(reqs), 0, 0), node
    assert set(out.times_by_id) == {r.request_id for r in reqs}
