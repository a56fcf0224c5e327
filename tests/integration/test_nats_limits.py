"""A mixed fleet over NATS, as an operator runs it: a ``thunderagent worker`` with a small KV pool and
one with a large pool, one frontend. Each worker states its limits in its heartbeats; the frontend
routes a long prompt only to the worker that holds it and refuses what none holds."""

from __future__ import annotations

import openai
import pytest

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

from nats_cluster import Cluster, cluster, wait_until  # noqa: E402, F401  (on sys.path; cluster: a fixture)

pytestmark = [pytest.mark.nats, pytest.mark.integration]

MODEL = "thunderagent-sim"
WORKER = "x-thunderagent-worker"
SMALL = """\
control_plane: {heartbeat_interval: 0.2, heartbeat_misses: 3}
simulation: {speedup: 10.0}
execution_group:
  nodes: [{count: 1, kv_blocks: 16, block_size: 64}]
"""


def test_a_long_prompt_goes_to_the_worker_that_holds_it(cluster: Cluster):
    small = cluster.tmp / "small.yaml"
    small.write_text(SMALL)
    cluster.start_nats()
    cluster.start_worker("small", config=small)  # 16 blocks x 64 = 1,024 tokens
    cluster.start_worker("big")  # the cluster's config: 8,192 blocks x 64
    cluster.start_frontend("f")
    wait_until(lambda: cluster.workers("f") == {"small", "big"}, 30, "2 workers")
    limits = {w["id"]: w["max_seq_tokens"] for w in cluster.health("f")["workers"]}
    assert limits == {"small": 1024, "big": 8192 * 64}
    client = cluster.client("f")
    seen = set()  # short ones first: routing balances them on recent prefill traffic
    for i in range(10):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"short {i}", max_tokens=4)
        seen.add(raw.headers[WORKER])
    assert seen == {"small", "big"}
    for i in range(4):  # ~1,500 tokens with the byte tokenizer: only "big" holds it
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"{i} " + "long " * 300, max_tokens=8)
        assert raw.headers[WORKER] == "big" and raw.parse().usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|exceeds"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=8192 * 64)
