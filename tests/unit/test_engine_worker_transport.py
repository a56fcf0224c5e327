"""The vLLM adapter driven through a fake HTTP transport (no sockets): a streamed completion, and the
finish reasons of requests the engine turns down."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from support.callbacks import Recorder
from support.waiting import wait_until
from thunderagent.config import EndpointConfig, NodeConfig
from thunderagent.execution.http_transport import TransportConnectionError
from thunderagent.execution.vllm import EngineWorker
from thunderagent.types import EngineRequest, FinishReason, TokenOutput

MODEL = "/models/tiny"
METRICS = 'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'


def sse(*chunks: object) -> list[bytes]:
    return [f"data: {json.dumps(c)}\n".encode() for c in chunks] + [b"\n", b"data: [DONE]\n"]


class FakeStream:
    def __init__(self, status: int, lines: list[bytes], body: str) -> None:
        self.status = status
        self._lines = lines
        self._body = body

    async def _iter(self) -> AsyncIterator[bytes]:
        for line in self._lines:
            await asyncio.sleep(0)  # the engine streams: other tasks run between chunks
            yield line

    def lines(self) -> AsyncIterator[bytes]:
        return self._iter()

    async def text(self) -> str:
        return self._body


class FakeTransport:
    """Answers every completion with ``status`` and ``lines``; records the requests' bodies."""

    def __init__(self, status: int = 200, lines: list[bytes] | None = None, body: str = "") -> None:
        self.status, self.lines, self.body = status, lines or [], body
        self.posted: list[tuple[str, Any]] = []

    @contextlib.asynccontextmanager
    async def stream_post(self, url: str, json: Any, headers: Any = ()) -> AsyncIterator[FakeStream]:
        self.posted.append((url, json))
        yield FakeStream(self.status, self.lines, self.body)

    async def get_text(self, url: str, timeout: float) -> str:
        assert url.endswith("/metrics")
        return METRICS

    async def get_json(self, url: str, timeout: float) -> Any:
        if url.endswith("/is_paused"):  # (read with every poll: vLLM's dev-mode path)
            self.pause_reads += 1
            return {"is_paused": False}
        assert url.endswith("/v1/models")
        card: dict[str, Any] = {"id": MODEL}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return {"data": [card]}

    max_model_len: Any = None
    pause_reads = 0


@pytest.fixture
async def run_worker():
    workers: list[EngineWorker] = []

    async def start(transport: FakeTransport) -> tuple[EngineWorker, Recorder]:
        rec = Recorder()
        node = NodeConfig(engine="vllm", block_size=4, endpoints=[EndpointConfig(url="http://engine:8000/")])
        w = EngineWorker("w0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.01,
                         transport=transport)
        w.start()
        workers.append(w)
        await wait_until(lambda: rec.heartbeats, 2.0, "first heartbeat")
        return w, rec

    yield start
    for w in workers:
        await w.stop()


async def drain(q: asyncio.Queue[TokenOutput]) -> list[TokenOutput]:
    outs: list[TokenOutput] = []
    while not outs or not outs[-1].finished:
        outs.append(await asyncio.wait_for(q.get(), 2.0))
    return outs


def request(rid: str = "r1") -> EngineRequest:
    return EngineRequest(rid, list(range(10)), [], 0, 3)


async def test_streamed_completion_ends_with_text_reason_and_cached_tokens(run_worker):
    transport = FakeTransport(lines=sse(
        {"choices": [{"text": "Hel", "token_ids": [7], "finish_reason": None}]},
        {"choices": [{"text": "lo", "token_ids": [8], "finish_reason": None}]},
        {"choices": [{"text": "!", "token_ids": [9], "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}}},
    ))
    w, rec = await run_worker(transport)
    q = w.submit(request())
    outs = await drain(q)
    assert "".join(o.text or "" for o in outs) == "Hello!"
    assert [t for o in outs for t in o.token_ids] == [7, 8, 9]
    assert outs[-1].finish_reason == FinishReason.LENGTH and outs[-1].cached_tokens == 8
    assert all(o.prompt_tokens == 10 for o in outs)
    assert q.accepted
    [(url, body)] = transport.posted
    assert url == "http://engine:8000/v1/completions"
    assert body["model"] == MODEL and body["prompt"] == list(range(10)) and body["max_tokens"] == 3
    await wait_until(lambda: rec.load.waiting == 0 and rec.load.running == 0, 2.0, "request released")


async def test_http_503_ends_unavailable(run_worker):
    w, rec = await run_worker(FakeTransport(status=503, body="overloaded"))
    q = w.submit(request())
    outs = await drain(q)
    assert [o.finish_reason for o in outs] == [FinishReason.UNAVAILABLE]
    assert not q.accepted


async def test_http_400_ends_error(run_worker):
    w, rec = await run_worker(FakeTransport(status=400, body="prompt too long"))
    outs = await drain(w.submit(request()))
    assert [o.finish_reason for o in outs] == [FinishReason.ERROR]


async def test_connection_refused_ends_unavailable_and_leaves_routing(run_worker):
    class Refusing(FakeTransport):
        @contextlib.asynccontextmanager
        async def stream_post(self, url: str, json: Any, headers: Any = ()) -> AsyncIterator[FakeStream]:
            raise TransportConnectionError("connection refused")
            yield  # pragma: no cover

    w, rec = await run_worker(Refusing())
    outs = await drain(w.submit(request()))
    assert [o.finish_reason for o in outs] == [FinishReason.UNAVAILABLE]
    assert rec.unavailable == ["unreachable"]  # back in routing with the next answered poll


# -- prefill/decode disaggregation (vLLM's NixlConnector protocol) -------------------------------
KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
             "remote_engine_id": "e-1", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}


async def test_prefill_job_is_one_non_streamed_token_and_returns_the_engines_transfer(run_worker):
    answer = {"choices": [{"text": "x", "token_ids": [42], "finish_reason": "length"}],
              "usage": {"prompt_tokens": 10}, "kv_transfer_params": KV_PARAMS}
    transport = FakeTransport(body=json.dumps(answer))
    w, rec = await run_worker(transport)
    req = EngineRequest("r1", list(range(10)), [11, 22], 0, 50, remote_decode=True)
    (out,) = await drain(w.submit(req))
    [(_, body)] = transport.posted
    assert body["stream"] is False and body["max_tokens"] == 1 and "stream_options" not in body
    assert body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}
    assert out.finished and out.finish_reason == FinishReason.LENGTH and out.token_ids == [42]
    t = out.kv_transfer
    assert t is not None and t.source_worker == "w0" and t.num_tokens == 10 and t.block_hashes == (11, 22)
    assert json.loads(t.engine_params or "") == KV_PARAMS, "passed on unchanged"
    await wait_until(lambda: rec.load.waiting == 0 and rec.load.running == 0, 2.0, "prefill released")


async def test_prefill_answer_without_kv_transfer_params_finishes_without_transfer(run_worker):
    answer = {"choices": [{"text": "x", "token_ids": [42], "finish_reason": "length"}]}
    w, _ = await run_worker(FakeTransport(body=json.dumps(answer)))
    (out,) = await drain(w.submit(EngineRequest("r1", list(range(10)), [], 0, 5, remote_decode=True)))
    assert out.finish_reason == FinishReason.LENGTH and out.kv_transfer is None


async def test_decode_request_carries_the_transfer_params_unchanged_and_streams(run_worker):
    from thunderagent.types import KvTransfer

    transport = FakeTransport(lines=sse({"choices": [{"text": "!", "token_ids": [9], "finish_reason": "stop"}]}))
    w, _ = await run_worker(transport)
    good = KvTransfer("w1", 10, (), json.dumps(KV_PARAMS))
    await drain(w.submit(EngineRequest("r1", list(range(10)), [], 0, 3, kv_from=good)))
    for i, garbled in enumerate((None, "{not json", "[1, 2]")):  # missing or garbled: sent without
        await drain(w.submit(EngineRequest(f"r{i + 2}", list(range(10)), [], 0, 3,
                                           kv_from=KvTransfer("w1", 10, (), garbled))))
    bodies = [b for _, b in transport.posted]
    assert bodies[0]["kv_transfer_params"] == KV_PARAMS and bodies[0]["stream"] is True
    assert all("kv_transfer_params" not in b and b["stream"] is True for b in bodies[1:])


async def test_load_changes_are_marked_stale_not_pushed_when_the_receiver_reads_lazily():
    """With ``on_load_stale`` (the fleet's callbacks) a request's three load changes (submitted,
    started, ended) build no report: the receiver reads the load when it needs it."""
    rec = Recorder()
    marks: list[str] = []
    readers = []

    def stale(wid: str, read) -> None:
        marks.append(wid)
        readers.append(read)

    cb = dataclasses.replace(rec.callbacks(), on_load_stale=stale)
    node = NodeConfig(engine="vllm", block_size=4, endpoints=[EndpointConfig(url="http://engine:8000/")])
    transport = FakeTransport(lines=sse({"choices": [{"text": "a", "token_ids": [7], "finish_reason": "length"}]}))
    w = EngineWorker("w0", node, node.endpoints[0], cb, heartbeat_interval=0.01, transport=transport)
    w.start()
    try:
        await wait_until(lambda: rec.heartbeats, 2.0, "first heartbeat")
        pushed = len(rec.loads) - len(rec.heartbeats)
        q = w.submit(request())
        assert marks == ["w0"] and readers[-1]().waiting + readers[-1]().running == 1  # counted at once
        await drain(q)
        await wait_until(lambda: len(marks) >= 3, 2.0, "started and ended")
        assert marks == ["w0"] * 3
        assert len(rec.loads) - len(rec.heartbeats) == pushed  # no pushed report
        last = readers[-1]()
        assert (last.running, last.waiting, last.queued_prefill_tokens, last.decode_tokens) == (0, 0, 0, 0)
    finally:
        await w.stop()


async def test_chunks_without_text_keep_a_request_alive_while_metrics_hang():
    """A server without token ids in its stream sends ``text: ""`` while its detokenizer holds back an
    incomplete character (a random-weight model can do so for many tokens running). Such a chunk is
    heard from the request: the stall check must not rest on ``/metrics`` polls alone."""
    from thunderagent.execution.openai import OpenAIWorker

    now = [100.0]
    release, finish, hang = asyncio.Event(), asyncio.Event(), asyncio.Event()

    class Gated(FakeTransport):
        async def get_text(self, url: str, timeout: float) -> str:
            if hang.is_set():
                await asyncio.sleep(3600)  # a loaded server whose /metrics does not answer
            return METRICS

        @contextlib.asynccontextmanager
        async def stream_post(self, url: str, json: Any, headers: Any = ()) -> AsyncIterator[Any]:
            class Stream(FakeStream):
                async def _iter(self) -> AsyncIterator[bytes]:
                    yield b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n'
                    await release.wait()
                    yield b'data: {"choices": [{"text": "", "finish_reason": null}]}\n'
                    await finish.wait()
                    yield b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\n'
                    yield b"data: [DONE]\n"

            yield Stream(200, [], "")

    rec = Recorder(clock=lambda: now[0])
    node = NodeConfig(engine="openai", block_size=4, endpoints=[EndpointConfig(url="http://engine:8000/")])
    w = OpenAIWorker("w0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.01, transport=Gated())
    w.start()
    try:
        await wait_until(lambda: rec.heartbeats, 2.0, "first heartbeat")
        q = w.submit(request())
        first = await asyncio.wait_for(q.get(), 2.0)
        assert first.token_ids == [-1] and first.text == "a"
        hang.set()
        await asyncio.sleep(0.1)  # the poll in flight hangs now
        now[0] += 30.0  # far past the keepalive's freshness: polls no longer vouch for the request
        await asyncio.sleep(1.2)  # a keepalive round (KEEPALIVE_S / 2) runs and must not touch
        assert q.last_heard < now[0]
        release.set()
        await wait_until(lambda: q.last_heard == now[0], 2.0, "the empty chunk is heard")
        assert q.empty(), "an empty chunk is no output"
        finish.set()
        outs = await drain(q)
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
        assert [t for o in outs for t in o.token_ids] == [-1], "the held-back chunk counts no token"
    finally:
        await w.stop()


async def test_a_slow_metrics_answer_still_keeps_a_quiet_request_alive():
    """A loaded server answers ``/metrics`` late (one took 13 s on CI) while a queued request streams
    nothing: an answer that comes within the poll's timeout (at least half the stall bound, whatever
    the heartbeat interval) still vouches for the request, so the fleet does not cut it as stalled."""
    from thunderagent.execution.engine_metrics import VLLM
    from thunderagent.execution.engine_poll import POLL_TIMEOUT_S, EnginePoller
    from thunderagent.execution.handle import KEEPALIVE_S, STALL_TIMEOUT_S

    assert POLL_TIMEOUT_S == STALL_TIMEOUT_S / 2
    for interval, lease, timeout in [(0.01, None, POLL_TIMEOUT_S), (0.2, 30.0, POLL_TIMEOUT_S),
                                     (1.0, 3.0, 2.0),  # the default config: the lease leaves 2 s
                                     (0.5, 3.0, 2.5), (3.0, 9.0, 6.0), (0.1, 0.3, 1.0)]:
        poller = EnginePoller("w", "http://x", 4, VLLM, FakeTransport(), Recorder().callbacks(), interval=interval,
                              connect_timeout=1.0, load=lambda: None, on_restart=lambda: None, in_flight=list,
                              lease=lease)  # type: ignore[arg-type]
        assert poller.poll_timeout == timeout, (interval, lease)
    delay = 1.5  # past the old timeout of max(1 s, two heartbeat intervals)
    release = asyncio.Event()
    timeouts: list[float] = []

    class Slow(FakeTransport):
        async def get_text(self, url: str, timeout: float) -> str:
            timeouts.append(timeout)
            await asyncio.wait_for(asyncio.sleep(delay), timeout)  # a timeout raises, as aiohttp's does
            return METRICS

        @contextlib.asynccontextmanager
        async def stream_post(self, url: str, json: Any, headers: Any = ()) -> AsyncIterator[Any]:
            class Quiet(FakeStream):
                async def _iter(self) -> AsyncIterator[bytes]:
                    await release.wait()  # queued: nothing streams yet
                    yield b'data: {"choices": [{"text": "a", "token_ids": [7], "finish_reason": "length"}]}\n'
                    yield b"data: [DONE]\n"

            yield Quiet(200, [], "")

    loop = asyncio.get_running_loop()
    rec = Recorder(clock=loop.time)
    node = NodeConfig(engine="vllm", block_size=4, endpoints=[EndpointConfig(url="http://engine:8000/")])
    w = EngineWorker("w0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.01, transport=Slow())
    w.start()
    try:
        await wait_until(lambda: rec.heartbeats, 5.0, "first heartbeat")
        q = w.submit(request())
        gaps: list[float] = []
        t_end = loop.time() + 2 * delay + KEEPALIVE_S
        while loop.time() < t_end:
            await asyncio.sleep(0.1)
            gaps.append(loop.time() - q.last_heard)
        assert timeouts and min(timeouts) == POLL_TIMEOUT_S
        assert len(rec.heartbeats) >= 3, "late answers are heartbeats"
        assert max(gaps) < delay + KEEPALIVE_S, f"silent for {max(gaps):.1f}s while the server answered"
        release.set()
        outs = await drain(q)
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
    finally:
        await w.stop()


async def test_the_servers_max_model_len_is_stated_once_and_again_after_a_change(run_worker):
    """vLLM's model card carries ``max_model_len``: the worker states it (routing and the frontend's
    check use it); the same value again states nothing; a server restarted with another one restates."""
    t = FakeTransport(200, sse({"choices": [{"text": "a", "finish_reason": "length"}]}))
    t.max_model_len = 2048
    w, rec = await run_worker(t)
    await wait_until(lambda: rec.limits, 2.0, "limits stated")
    assert rec.limits == [(2048, 0)]
    await w._health.fetch_model()
    assert rec.limits == [(2048, 0)]
    t.max_model_len = 4096
    await w._health.fetch_model()
    assert rec.limits == [(2048, 0), (4096, 0)]
    for odd in (None, 0, "4096", True):  # absent (an OpenAI server's card) or not a length: ignored
        t.max_model_len = odd
        await w._health.fetch_model()
    assert rec.limits == [(2048, 0), (4096, 0)] and w._health.max_model_len == 4096


async def test_a_bug_in_the_request_path_ends_the_request_at_once():
    """An unexpected exception while sending (a bug of ours, not the server's answer) ends the request ``ERROR``
    now, logged with its traceback, instead of leaving it to the fleet's stall bound (seconds)."""
    from thunderagent.execution.openai import OpenAIWorker

    class Broken(FakeTransport):
        def stream_post(self, url: str, json: Any, headers: Any = ()) -> Any:
            raise TypeError("a bug")

    rec = Recorder()
    node = NodeConfig(engine="openai", block_size=4, endpoints=[EndpointConfig(url="http://engine:8000/")])
    w = OpenAIWorker("w0", node, node.endpoints[0], rec.callbacks(), heartbeat_interval=0.01, transport=Broken())
    w.start()
    try:
        await wait_until(lambda: rec.heartbeats, 2.0, "first heartbeat")
        q = w.submit(request())
        out = await asyncio.wait_for(q.get(), 1.0)
        assert out.finished and out.finish_reason == FinishReason.ERROR
    finally:
        await w.stop()
