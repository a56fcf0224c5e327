"""KV events an engine published before our subscription took effect (ZMQ's slow joiner, or a
reconnect) reach the index although no later batch comes to reveal the gap: the engine adapter's
pump asks the engine's replay socket for them once its subscription's handshake completes
(``execution/kv_pump.py``). A fake engine server (``support.fake_engine``, real ZMQ sockets on
127.0.0.1) in vLLM's and in SGLang's flavour."""

from __future__ import annotations

import random

import pytest

from support.callbacks import Recorder
from support.fake_engine import FakeEngine
from support.waiting import wait_until
from thunderagent.config import EndpointConfig, NodeConfig
from thunderagent.execution.engine_metrics import VLLM
from thunderagent.execution.sglang import SGLANG
from thunderagent.execution.vllm import EngineWorker
from thunderagent.kv.hashing import BASE_SEED, block_hashes
from thunderagent.types import BlockStored

BS = 16


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
async def test_blocks_published_before_the_subscription_reach_the_index(flavour: str) -> None:
    server = FakeEngine(flavor=flavour, block_size=BS)
    await server.start()
    rec = Recorder()
    prompt = [random.Random(flavour).randrange(10, 500) for _ in range(4 * BS + 3)]
    assert server.cache_prompt(prompt) == 0  # batch 0, published while nobody is subscribed
    node = NodeConfig(engine=flavour, block_size=BS, kv_blocks=512,
                      endpoints=[EndpointConfig(url=server.url, kv_events=server.events, kv_replay=server.replay)])
    handle = EngineWorker(f"{flavour}-0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.05,
                          flavor=VLLM if flavour == "vllm" else SGLANG)
    handle.start()
    try:
        want = set(block_hashes(prompt, BS, BASE_SEED))
        assert len(want) == 4
        # nothing else is published: only the catch-up replay can bring batch 0
        try:
            await wait_until(lambda: want <= {h for e in rec.events if isinstance(e, BlockStored)
                                              for h in e.block_hashes}, 20, "the blocks cached before we subscribed")
        except AssertionError as exc:  # say how far the stream got
            raise AssertionError(f"{exc}; stream {handle.stream.stats}, replaying {handle.stream.replaying}") from exc
        stats = handle.stream.stats
        assert stats.catch_ups >= 1 and stats.gaps == 0 and stats.resyncs == 0
        assert [e.seq for e in rec.events] == list(range(len(rec.events)))
        assert not handle.stream.replaying and handle.stream.next_seq == 1
    finally:
        await handle.stop()
        await server.stop()
