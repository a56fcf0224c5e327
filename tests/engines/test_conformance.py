"""One behavioural suite for every worker handle: the simulated engine's and a real vLLM server's.

Each check drives a :class:`WorkerHandle` directly (no router): submit, stream, abort, load, events.
The vLLM variant needs a real server (``real_engine``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from tests.engines.conftest import wait_until
from tests.engines.vllm_env import BLOCK_SIZE
from thunderagent.config import NodeConfig
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.execution.vllm import EngineWorker
from thunderagent.kv.hashing import BASE_SEED, block_hashes
from thunderagent.execution.local import LocalWorker, ScaledClock
from thunderagent.execution.handle import WorkerCallbacks, WorkerHandle
from thunderagent.types import BlockStored, EngineRequest, KvEvent, LoadReport, TokenOutput

BS = BLOCK_SIZE
HANDLES = ["simulated", pytest.param("vllm", marks=pytest.mark.real_engine)]


@dataclass
class Harness:
    handle: WorkerHandle
    vocab: int
    events: list[KvEvent] = field(default_factory=list)
    heartbeats: list[LoadReport] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random())
    n: int = 0

    def prompt(self, tokens: int) -> list[int]:
        # fresh random tokens: a real server keeps its cache across tests
        return [self.rng.randrange(10, self.vocab) for _ in range(tokens)]

    def request(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> EngineRequest:
        self.n += 1
        return EngineRequest(f"conf-{self.rng.getrandbits(32):08x}-{self.n}", prompt,
                             block_hashes(prompt, BS, BASE_SEED), BASE_SEED, max_tokens, ignore_eos=ignore_eos)

    def stored(self) -> set[int]:
        return {h for e in self.events if isinstance(e, BlockStored) for h in e.block_hashes}


async def drain(q: asyncio.Queue[TokenOutput], timeout: float = 120) -> list[TokenOutput]:
    outs: list[TokenOutput] = []
    while not outs or not outs[-1].finished:
        outs.append(await asyncio.wait_for(q.get(), timeout))
    return outs


def busy(load: LoadReport) -> int:
    return load.running + load.waiting


@pytest.fixture(params=HANDLES)
async def h(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    events: list[KvEvent] = []
    heartbeats: list[LoadReport] = []
    cb = WorkerCallbacks(lambda wid, evs: events.extend(evs), lambda wid, load: heartbeats.append(load))
    handle: WorkerHandle
    if request.param == "simulated":
        node = NodeConfig(block_size=BS, kv_blocks=4096)
        engine = SimulatedEngine("sim-0", node, eos_token_id=256)
        handle = LocalWorker(engine, ScaledClock(20.0), cb.on_events, cb.on_heartbeat, 0.05)
        vocab = 256
    else:
        server = request.getfixturevalue("vllm_servers")[0]
        node = NodeConfig(engine="vllm", block_size=BS, endpoints=[server.endpoint()])
        handle = EngineWorker("vllm-0", node, node.endpoints[0], cb, heartbeat_interval=0.2)
        vocab = 500
    harness = Harness(handle, vocab, events, heartbeats, random.Random(request.node.name))
    handle.start()
    try:
        await wait_until(lambda: len(heartbeats) > 0, 30, "first heartbeat")
        yield harness
    finally:
        await handle.stop()


async def test_outputs_stream_in_order_and_end_finished(h: Harness) -> None:
    q = h.handle.submit(h.request(h.prompt(40), 16))
    outs = await drain(q)
    assert sum(len(o.token_ids) for o in outs) == 16
    assert len(outs) > 1, "tokens are streamed, not delivered in one piece"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length"
    assert all(o.prompt_tokens == 40 for o in outs)
    times = [o.time for o in outs]
    assert times == sorted(times)
    await asyncio.sleep(0.2)
    assert q.empty(), "nothing after the finished output"


async def test_load_counts_a_request_at_dispatch(h: Harness) -> None:
    before = h.handle.load()
    q = h.handle.submit(h.request(h.prompt(3 * BS), 4))
    now = h.handle.load()  # no await in between: nothing has run yet
    assert busy(now) == busy(before) + 1
    # its prompt is work ahead of the worker: still to prefill, or admitted into a pass already
    assert now.queued_prefill_tokens > before.queued_prefill_tokens or now.kv_active_blocks >= 3
    await drain(q)

    def idle() -> bool:
        load = h.handle.load()
        return busy(load) == 0 and load.queued_prefill_tokens == 0 and load.decode_tokens == 0

    await wait_until(idle, 10, "load back to idle")


async def test_abort_releases_the_request(h: Harness) -> None:
    q = h.handle.submit(h.request(h.prompt(BS), 1500))
    first = await asyncio.wait_for(q.get(), 60)
    assert not first.finished
    h.handle.abort(first.request_id)
    h.handle.abort("no-such-request")  # ignored
    await wait_until(lambda: busy(h.handle.load()) == 0, 15, "aborted request released by the engine")
    await asyncio.sleep(0.2)
    late = [o for o in iter_queue(q) if o.finished and o.finish_reason != "abort"]
    assert not late, "an aborted request does not run to its end"


def iter_queue(q: asyncio.Queue[TokenOutput]) -> list[TokenOutput]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


async def test_repeat_prompt_reports_cached_tokens(h: Harness) -> None:
    prompt = h.prompt(5 * BS + 7)
    first = await drain(h.handle.submit(h.request(prompt, 2)))
    assert max(o.cached_tokens for o in first) == 0
    second = await drain(h.handle.submit(h.request(prompt, 2)))
    assert max(o.cached_tokens for o in second) == 5 * BS


async def test_events_carry_the_routers_hashes(h: Harness) -> None:
    """The engine's stored blocks arrive as exactly the hashes the frontend computes."""
    prompt = h.prompt(4 * BS + 3)
    await drain(h.handle.submit(h.request(prompt, 1)))
    want = set(block_hashes(prompt, BS, BASE_SEED))
    await wait_until(lambda: want <= h.stored(), 10, "BlockStored events for the prompt")
    seqs = [e.seq for e in h.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "event seqs are contiguous"
    snap = h.handle.snapshot()
    assert snap is not None and want <= set(snap[0]) and snap[1] == seqs[-1]


async def test_heartbeats_report_load(h: Harness) -> None:
    n = len(h.heartbeats)
    await wait_until(lambda: len(h.heartbeats) >= n + 2, 10, "heartbeats keep coming")
    last = h.heartbeats[-1]
    assert last.worker_id == h.handle.worker_id and last.kv_total_blocks > 0
    assert 0.0 <= last.kv_usage <= 1.0
