"""One behavioural suite for every worker handle: the worker contract of ``execution/handle.py``.

Each check drives a :class:`WorkerHandle` directly (no router): submit, stream, abort, pushed load,
events, heartbeats. The handles: the simulated engine's :class:`LocalWorker`; the reference
:class:`~support.fake_worker.FakeWorker` the fleet tests use; the real-engine adapter in vLLM's and
in SGLang's flavour against a fake engine server (``support.fake_engine``: HTTP + ZMQ events); a
:class:`RemoteWorker` talking over a real nats-server to a worker process's
:class:`WorkerService` (``nats``); and a real vLLM server (``real_engine``).

No check proves silence by sleeping: "nothing more arrives" is asserted once the worker's own pushed
load says it holds no request any more.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from support.callbacks import Recorder
from support.fake_engine import FakeEngine
from support.fake_worker import FakeWorker
from support.waiting import wait_until
from tests.engines.conftest import note
from tests.engines.vllm_env import BLOCK_SIZE
from thunderagent.config import EndpointConfig, NodeConfig
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.execution.engine_metrics import VLLM
from thunderagent.execution.handle import STALL_TIMEOUT_S, OutputQueue, WorkerHandle
from thunderagent.execution.local import LocalWorker, ScaledClock
from thunderagent.execution.openai import OpenAIWorker
from thunderagent.execution.sglang import SGLANG
from thunderagent.execution.vllm import EngineWorker
from thunderagent.kv.hashing import BASE_SEED, block_hashes
from thunderagent.types import AllBlocksCleared, BlockStored, EngineRequest, FinishReason, LoadReport, TokenOutput

BS = BLOCK_SIZE
# How long a load report may take to show a change. A real server on a loaded 2-core CI machine has
# taken 13 s to answer one /metrics poll; the fakes answer at once, so a pass never waits this long.
PATIENCE = 30.0
HANDLES = [
    "simulated",
    "fake",
    "vllm-flavour",
    "sglang-flavour",
    "openai",
    pytest.param("remote", marks=pytest.mark.nats),
    pytest.param("vllm", marks=pytest.mark.real_engine),
    pytest.param("openai-vllm", marks=pytest.mark.real_engine),
]


@dataclass
class Harness:
    handle: WorkerHandle
    vocab: int
    rec: Recorder
    caches: bool = True  # reports cached_tokens on a repeated prompt
    resets: bool = True  # its server serves a prefix-cache reset (vLLM's dev mode, SGLang's /flush_cache)
    loads_adapters: bool = False  # its server loads LoRA adapters at runtime
    pauses: bool = False  # its server pauses and resumes its generation (vLLM's dev mode)
    events: bool = True  # publishes KV events
    snapshot: bool = True  # can dump its cache synchronously
    rng: random.Random = field(default_factory=lambda: random.Random())
    cleanup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    ready: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # awaited once the handle started
    n: int = 0
    real: bool = False  # a real server (slow and noisy on CI's shared cores), not a fake
    #: the (max_seq, max_prompt) it states through ``on_limits`` (None: states none; a simulated
    #: worker's are static, in its WorkerInfo; a relay counts prompts by an estimate)
    states: tuple[int, int] | None = None

    def prompt(self, tokens: int) -> list[int]:
        # fresh random tokens: a real server keeps its cache across tests
        return [self.rng.randrange(10, self.vocab) for _ in range(tokens)]

    def request(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> EngineRequest:
        self.n += 1
        return EngineRequest(f"conf-{self.rng.getrandbits(32):08x}-{self.n}", prompt,
                             block_hashes(prompt, BS, BASE_SEED), BASE_SEED, max_tokens, ignore_eos=ignore_eos)

    def stored(self) -> set[int]:
        return {h for e in self.rec.events if isinstance(e, BlockStored) for h in e.block_hashes}

    @property
    def load(self) -> LoadReport:
        """The freshest load the handle pushed (what routing reads)."""
        return self.rec.load

    def idle(self) -> bool:
        load = self.load
        return busy(load) == 0 and load.queued_prefill_tokens == 0


async def drain(q: asyncio.Queue[TokenOutput], timeout: float = 120) -> list[TokenOutput]:
    outs: list[TokenOutput] = []
    while not outs or not outs[-1].finished:
        outs.append(await asyncio.wait_for(q.get(), timeout))
    return outs


def busy(load: LoadReport) -> int:
    return load.running + load.waiting


async def _simulated(rec: Recorder, request: pytest.FixtureRequest) -> Harness:
    node = NodeConfig(block_size=BS, kv_blocks=4096)
    engine = SimulatedEngine("sim-0", node, eos_token_id=256)
    return Harness(LocalWorker(engine, ScaledClock(20.0), rec.callbacks(), 0.05), 256, rec)


async def _fake(rec: Recorder, request: pytest.FixtureRequest) -> Harness:
    return Harness(FakeWorker("fake-0", rec.callbacks(), block_size=BS), 256, rec)


async def _engine_flavour(rec: Recorder, flavour: str) -> Harness:
    server = FakeEngine(flavor=flavour, block_size=BS, max_model_len=4096, dev_mode=True, lora_updating=True)
    await server.start()
    node = NodeConfig(engine=flavour, block_size=BS, kv_blocks=512,
                      endpoints=[EndpointConfig(url=server.url, kv_events=server.events, kv_replay=server.replay)])
    handle = EngineWorker(f"{flavour}-0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.05,
                          flavor=VLLM if flavour == "vllm" else SGLANG)
    return Harness(handle, 500, rec, cleanup=[server.stop], ready=[server.wait_subscribed], states=(4096, 0),
                   loads_adapters=True, pauses=flavour == "vllm")


async def _vllm_flavour(rec: Recorder, request: pytest.FixtureRequest) -> Harness:
    return await _engine_flavour(rec, "vllm")


async def _sglang_flavour(rec: Recorder, request: pytest.FixtureRequest) -> Harness:
    return await _engine_flavour(rec, "sglang")


async def _openai(rec: Recorder, request: pytest.FixtureRequest) -> Harness:
    """Any OpenAI-compatible server (engine openai): the fake engine's HTTP side, its events unused."""
    server = FakeEngine(flavor="sglang", block_size=BS, max_model_len=4096)  # text streams without token ids
    await server.start()
    node = NodeConfig(engine="openai", block_size=BS, kv_blocks=512, endpoints=[EndpointConfig(url=server.url)])
    handle = OpenAIWorker("openai-0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.05)
    return Harness(handle, 500, rec, events=False, resets=False, cleanup=[server.stop])  # (no vLLM reset path)


async def _openai_vllm(rec: Recorder, request: pytest.FixtureRequest) -> Harness:
    """A real vLLM server as a plain OpenAI-compatible one: its KV events are not subscribed to."""
    server = request.getfixturevalue("vllm_servers")[0]
    node = NodeConfig(engine="openai", block_size=BS, endpoints=[EndpointConfig(url=server.endpoint()["url"])])
    handle = OpenAIWorker("openai-vllm-0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.2)
    return Harness(handle, 500, rec, events=False, real=True, pauses=True)


async def _remote(rec: Recorder, request: pytest.FixtureRequest) -> Harness:
    pytest.importorskip("nats", reason="the NATS worker needs the nats extra")
    from support.remote_pair import remote_pair

    handle, cleanup = await remote_pair(rec, request.getfixturevalue("nats_url"), BS)
    return Harness(handle, 256, rec, snapshot=False, cleanup=[cleanup])


async def _vllm(rec: Recorder, request: pytest.FixtureRequest) -> Harness:
    server = request.getfixturevalue("vllm_servers")[0]
    node = NodeConfig(engine="vllm", block_size=BS, endpoints=[server.endpoint()])
    handle = EngineWorker("vllm-0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.2)
    return Harness(handle, 500, rec, real=True, states=(2048, 0),  # vllm_env starts it with --max-model-len 2048
                   pauses=True)


BUILDERS = {"simulated": _simulated, "fake": _fake, "vllm-flavour": _vllm_flavour,
            "sglang-flavour": _sglang_flavour, "remote": _remote, "vllm": _vllm,
            "openai": _openai, "openai-vllm": _openai_vllm}


@pytest.fixture(scope="module")
def nats_url():
    from support.nats_server import nats_server

    with nats_server() as url:
        yield url


@pytest.fixture(params=HANDLES)
async def h(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    rec = Recorder(clock=asyncio.get_running_loop().time)
    harness = await BUILDERS[request.param](rec, request)
    harness.rng = random.Random(request.node.name)
    harness.handle.start()
    try:
        await wait_until(lambda: len(rec.heartbeats) > 0, 30, "first heartbeat")
        for ready in harness.ready:
            await ready()
        yield harness
    finally:
        await harness.handle.stop()
        for fn in harness.cleanup:
            await fn()


async def test_outputs_stream_in_order_and_end_finished(h: Harness) -> None:
    q = h.handle.submit(h.request(h.prompt(40), 16))
    assert isinstance(q, OutputQueue)
    outs = await drain(q)
    assert sum(len(o.token_ids) for o in outs) == 16
    assert len(outs) > 1, "tokens are streamed, not delivered in one piece"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert all(o.prompt_tokens == 40 for o in outs)
    times = [o.time for o in outs]
    assert times == sorted(times)
    assert q.accepted and q.produced
    await wait_until(h.idle, PATIENCE, "the worker reports it holds nothing")
    assert q.empty(), "nothing after the finished output"


async def test_load_counts_a_request_at_dispatch(h: Harness) -> None:
    await wait_until(h.idle, PATIENCE, "idle before")
    before = h.load
    q = h.handle.submit(h.request(h.prompt(3 * BS), 4))
    now = h.load  # pushed by submit itself: no await in between, nothing has run yet
    assert busy(now) == busy(before) + 1
    # its prompt is work ahead of the worker: still to prefill, or admitted into a pass already
    assert now.queued_prefill_tokens > before.queued_prefill_tokens or now.kv_active_blocks >= 3
    await drain(q)
    await wait_until(lambda: h.idle() and h.load.decode_tokens == 0, PATIENCE, "load back to idle")


async def test_abort_releases_the_request(h: Harness) -> None:
    """An abort ends the request: nothing that finishes it arrives after the abort. A real server on a
    loaded machine can stream a whole answer while the test's process waits for the CPU: outputs
    already queued when the abort is issued were made before it, and a request that finished
    before its abort proves nothing, so it is tried again with a fresh one."""
    for _ in range(5):  # (a fresh-clone CI run once saw three of 1,500 tokens end before their aborts)
        q = h.handle.submit(h.request(h.prompt(BS), 2000))  # (the real servers hold 2,048 tokens)
        first = await asyncio.wait_for(q.get(), 60)
        assert not first.finished
        before = iter_queue(q)  # no await from here to the abort: these outputs came before it
        h.handle.abort(first.request_id)
        h.handle.abort("no-such-request")  # ignored
        await wait_until(h.idle, PATIENCE, "aborted request released by the engine")
        if any(o.finished for o in before):
            continue  # it had run to its end before the abort: try again
        late = [o for o in iter_queue(q) if o.finished and o.finish_reason != FinishReason.ABORT]
        assert not late, "an aborted request does not run to its end"
        return
    pytest.fail("five requests of 2,000 tokens each finished before the test could abort them")


def iter_queue(q: asyncio.Queue[TokenOutput]) -> list[TokenOutput]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


async def test_repeat_prompt_reports_cached_tokens(h: Harness) -> None:
    if not h.caches:
        pytest.skip("this handle reports no cached tokens")
    prompt = h.prompt(5 * BS + 7)
    first = await drain(h.handle.submit(h.request(prompt, 2)))
    assert max(o.cached_tokens for o in first) == 0
    second = await drain(h.handle.submit(h.request(prompt, 2)))
    assert max(o.cached_tokens for o in second) == 5 * BS


async def test_events_carry_the_routers_hashes(h: Harness) -> None:
    """The engine's stored blocks arrive as exactly the hashes the frontend computes."""
    if not h.events:
        pytest.skip("this handle publishes no KV events (the index holds the router's predictions only)")
    prompt = h.prompt(4 * BS + 3)
    await drain(h.handle.submit(h.request(prompt, 1)))
    want = set(block_hashes(prompt, BS, BASE_SEED))
    await wait_until(lambda: want <= h.stored(), 30, "BlockStored events for the prompt")
    seqs = [e.seq for e in h.rec.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "event seqs are contiguous"
    snap = h.handle.snapshot()
    if h.snapshot:
        assert snap is not None and want <= set(snap[0]) and snap[1] == seqs[-1]
    else:
        assert snap is None  # dumps are asynchronous for this handle (its membership asks)


async def test_a_prefix_cache_reset_empties_the_cache(h: Harness) -> None:
    """``reset_prefix_cache``: the cache emptied (a repeated prompt finds nothing), announced by the worker's KV
    events when it has them (an idle vLLM engine publishes with its next step: by the next request's end), before
    that request's blocks; a server without the call says so and keeps its cache."""
    prompt = h.prompt(4 * BS + 3)
    want = set(block_hashes(prompt, BS, BASE_SEED))
    await drain(h.handle.submit(h.request(prompt, 1)))
    if h.events:
        await wait_until(lambda: want <= h.stored(), 30, "the prompt's blocks")
    await wait_until(h.idle, PATIENCE, "its request done")  # (vLLM refuses a reset while blocks are in use)
    n = len(h.rec.events)
    r = await h.handle.reset_prefix_cache(False, False)
    if not h.resets:
        assert not r.success and "/reset_prefix_cache" in (r.error or ""), r
        return
    assert r.success, r.error
    again = await drain(h.handle.submit(h.request(prompt, 1)))
    if h.caches:
        assert max(o.cached_tokens for o in again) == 0
    if h.events:
        def after() -> list[object]:
            return h.rec.events[n:]

        await wait_until(lambda: any(isinstance(e, AllBlocksCleared) for e in after()), 30, "AllBlocksCleared")
        await wait_until(lambda: want <= {x for e in after() if isinstance(e, BlockStored) for x in e.block_hashes},
                         30, "the prompt's blocks stored again")
        kinds = [type(e).__name__ for e in after()]
        assert kinds.index("AllBlocksCleared") < kinds.index("BlockStored")


async def test_a_lora_adapter_is_loaded_and_unloaded_or_refused_with_a_reason(h: Harness) -> None:
    """``set_adapter``: on a server that loads adapters at runtime the served names follow at once (``on_adapters``);
    elsewhere a refusal that says why (a simulated engine has none, a server without the path); never a raise."""
    name = f"conf-{h.rng.getrandbits(24):06x}"
    loaded = await h.handle.set_adapter(name, f"/loras/{name}", False)
    if not h.loads_adapters:
        assert not loaded.success and loaded.error, loaded
        return
    assert loaded.success, loaded.error
    assert h.rec.adapters and name in h.rec.adapters[-1]
    again = await h.handle.set_adapter(name, f"/loras/{name}", False)
    assert not again.success and "already been loaded" in (again.error or "")
    gone = await h.handle.set_adapter(name, None, False)
    assert gone.success and name not in h.rec.adapters[-1]


async def test_generation_is_paused_and_resumed_or_refused_with_a_reason(h: Harness) -> None:
    """``set_paused``: a request sent to a paused server waits there (no output) and completes once it resumes;
    elsewhere a refusal that says why; never a raise."""
    paused = await h.handle.set_paused(True, "keep", False)
    if not h.pauses:
        assert not paused.success and paused.error, paused
        state = await h.handle.server_call("/is_paused")
        assert not state.success and state.error and state.answer is None, state
        return
    assert paused.success, paused.error
    state = await h.handle.server_call("/is_paused")  # (a parameterless operator call, its answer read back)
    assert state.success and json.loads(state.answer or "") == {"is_paused": True}, state
    try:
        q = h.handle.submit(h.request(h.prompt(BS), 2))
        await asyncio.sleep(1.0)
        assert not any(o.token_ids for o in list(q._queue))  # (nothing generated while paused)
    finally:
        resumed = await h.handle.set_paused(False, "abort", False)
    assert resumed.success, resumed.error
    outs = await drain(q)
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 2
    assert json.loads((await h.handle.server_call("/is_paused")).answer or "") == {"is_paused": False}
    refused = await h.handle.server_call("/shutdown")  # not one of the calls sent to servers
    assert not refused.success and "not one of the calls" in (refused.error or "")


async def test_a_server_sleeps_and_wakes_or_refuses_with_a_reason(h: Harness) -> None:
    """vLLM's sleep mode through ``server_call`` (query and answer as the server has them): asleep, a request waits
    in the server; woken whole, it completes. Elsewhere a refusal that says why. A query the path does not take, or
    a body where it takes none, never leaves."""
    for path, query, body in (("/sleep", "level=1&x=\r\n", b""), ("/is_sleeping", "a=1", b""), ("/sleep", "", b"{}")):
        bad = await h.handle.server_call(path, query, body)
        assert not bad.success and bad.error, (path, query, bad)
    asleep = await h.handle.server_call("/sleep", "level=1")
    if not h.pauses:
        assert not asleep.success and asleep.error, asleep
        return
    assert asleep.success and json.loads(asleep.answer or "") == {"status": "sleeping", "level": 1}, asleep
    assert json.loads((await h.handle.server_call("/is_sleeping")).answer or "") == {"is_sleeping": True}
    try:
        q = h.handle.submit(h.request(h.prompt(BS), 2))
        await asyncio.sleep(1.0)
        assert not any(o.token_ids for o in list(q._queue))  # (nothing generated while asleep)
    finally:
        woken = await h.handle.server_call("/wake_up")
    assert woken.success and json.loads(woken.answer or "")["status"] == "awake", woken
    outs = await drain(q)
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 2
    assert json.loads((await h.handle.server_call("/is_sleeping")).answer or "") == {"is_sleeping": False}


async def test_heartbeats_report_load(h: Harness) -> None:
    n = len(h.rec.heartbeats)
    await wait_until(lambda: len(h.rec.heartbeats) >= n + 2, PATIENCE, "heartbeats keep coming")
    last = h.rec.heartbeats[-1]
    assert last.worker_id == h.handle.worker_id and last.kv_total_blocks > 0
    assert 0.0 <= last.kv_usage <= 1.0


async def test_a_server_states_its_length_limit(h: Harness) -> None:
    """vLLM's and SGLang's model cards carry ``max_model_len``: the worker states it once it has read
    the card (by its first request at the latest), so routing sends it only what it holds."""
    await drain(h.handle.submit(h.request(h.prompt(8), 2)))
    assert h.rec.limits == ([] if h.states is None else [h.states])


async def test_a_live_worker_touches_its_requests(h: Harness) -> None:
    """Liveness: a request in flight is heard from (outputs or keepalives), so the fleet's stall
    check never ends a request of a live worker."""
    q = h.handle.submit(h.request(h.prompt(BS), 400))
    first = await asyncio.wait_for(q.get(), 60)
    t0 = q.last_heard
    # A real server on CI's 2 loaded cores has gone silent (no token, no /metrics answer) for over
    # 10 s: the fleet would rightly cut its requests then, but that is the machine, not the handle.
    # Outputs already queued behind the first were heard after it: while this test's loop was
    # starved, a fast server's whole stream sat in the socket and was read in one go (every output,
    # the final one included, was put before this test woke), so last_heard can no longer move.
    await wait_until(lambda: q.last_heard > t0 or not q.empty(), PATIENCE if h.real else 10,
                     "the request is heard from again")
    if h.real and q.last_heard - t0 > STALL_TIMEOUT_S:
        note(f"{h.handle.worker_id}: the real server was silent {q.last_heard - t0:.1f}s mid-stream")
    h.handle.abort(first.request_id)
    await wait_until(h.idle, PATIENCE, "released")
