"""The fleet's side of real-engine failures, with scripted worker handles (no engine, no network):
a worker that says it cannot serve leaves routing at once and returns with its next heartbeat; a
request its worker could not take is routed to another one before anything was streamed."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from support.clock import ManualClock
from thunderagent.config import NodeConfig, parse_config
from thunderagent.control.fleet import Fleet
from thunderagent.control.membership import StaticMembership
from thunderagent.execution.handle import OutputQueue, WorkerCallbacks
from thunderagent.frontend.streaming import stream_text
from thunderagent.frontend.tokenizer import ByteTokenizer
from thunderagent.types import EngineRequest, FinishReason, LoadReport, TokenOutput

UNAVAILABLE = FinishReason.UNAVAILABLE


class Scripted:
    """A worker handle that answers every request with ``outputs`` (token lists; [] = unavailable)."""

    def __init__(self, wid: str, cb: WorkerCallbacks, unavailable: bool = False) -> None:
        self.worker_id = wid
        self.cb = cb
        self.unavailable = unavailable
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, req: EngineRequest) -> OutputQueue:
        self.submitted.append(req.request_id)
        q = OutputQueue(self.cb.clock())
        n = len(req.prompt_tokens)
        if self.unavailable:
            self.cb.on_unavailable(self.worker_id, "unreachable")
            q.put_nowait(TokenOutput(req.request_id, [], 0.0, n, 0, True, UNAVAILABLE, text=""))
        else:
            q.put_nowait(TokenOutput(req.request_id, [104], 0.0, n, 0, text="h"))
            q.put_nowait(TokenOutput(req.request_id, [105], 0.0, n, 64, True, "length", text="i"))
        return q

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def load(self) -> LoadReport:
        return LoadReport(self.worker_id, 0.0, 0, 0, 0, 0, 0, 0, 100)

    def snapshot(self) -> tuple[list[int], int] | None:
        return None


@pytest.fixture
async def fleet() -> Fleet:
    cfg = parse_config({
        "model": "/unused", "routing": {"seed": 1}, "control_plane": {"health_check_enabled": False},
        "execution_group": {"nodes": [{"engine": "vllm", "endpoints": [{"url": "http://a"}, {"url": "http://b"}]}]},
    })
    def factory(node: NodeConfig, wid: str, k: int, cb: WorkerCallbacks) -> Scripted:
        return Scripted(wid, cb, unavailable=(k == 0))

    f = Fleet(cfg, StaticMembership(cfg.execution_group, {"vllm": factory}), clock=ManualClock())
    await f.start()
    return f


async def collect(f: Fleet, gen) -> list:
    return [c async for c in stream_text(f.outputs(gen), ByteTokenizer().decoder(), [])]


async def test_request_its_worker_could_not_take_is_routed_again(fleet: Fleet) -> None:
    bad, good = fleet.workers["worker-0"], fleet.workers["worker-1"]
    # route the first request to the bad worker by hand, as the router might have
    gen = await fleet.start_generation([1, 2, 3], 2)
    if gen.worker is good:  # the router chose the good one: resubmit on the bad one
        gen.queue = bad.submit(gen.request)  # type: ignore[arg-type]
        gen.worker = bad
    chunks = await collect(fleet, gen)
    assert "".join(c.text for c in chunks) == "hi" and chunks[-1].finish_reason == "length"
    assert chunks[-1].cached_tokens == 64, "cached tokens reported with the last output count"
    assert gen.worker is good and gen.decision.worker_id == "worker-1" and gen.tried == ("worker-0",)
    assert fleet.metrics.rerouted._value.get() == 1  # type: ignore[attr-defined]
    assert fleet.unavailable == {"worker-0": "unreachable"}
    # out of routing now: every new request goes to the good worker, no detour
    for _ in range(5):
        assert (await fleet.start_generation([4, 5, 6], 2)).worker is good


async def test_back_in_routing_with_its_next_heartbeat(fleet: Fleet) -> None:
    fleet.on_unavailable("worker-0", "unreachable")
    assert fleet.health_summary()["healthy_workers"] == 1
    fleet.on_heartbeat("worker-0", fleet.workers["worker-0"].load())
    assert "worker-0" not in fleet.unavailable
    assert fleet.health_summary()["healthy_workers"] == 2


async def test_no_other_worker_left_passes_the_failure_on(fleet: Fleet) -> None:
    fleet.on_unavailable("worker-1", "block_size_mismatch")
    gen = await fleet.start_generation([1, 2, 3], 2)
    assert gen.worker.worker_id == "worker-0"
    chunks = await collect(fleet, gen)
    assert chunks[-1].finish_reason == UNAVAILABLE and chunks[-1].text == ""


async def test_the_refusing_workers_predictions_are_retracted(fleet: Fleet) -> None:
    """Routing predicted the prompt's blocks on the worker that could not take it: once the request is
    routed again they are gone from the index (only the worker that ran it is predicted to hold them)."""
    prompt = list(range(200))  # 3 full 64-token blocks
    gen = await fleet.start_generation(prompt, 2)
    if gen.worker.worker_id != "worker-0":  # put it on the refusing worker, as the router might have
        fleet.index.predict("worker-0", gen.request.block_hashes, fleet.now())
        gen.dispatch.decision = dataclasses.replace(gen.decision, worker_id="worker-0")
        gen.queue, gen.worker = fleet.workers["worker-0"].submit(gen.request), fleet.workers["worker-0"]
    await collect(fleet, gen)
    assert gen.worker.worker_id == "worker-1"
    assert len(gen.request.block_hashes) == 3
    assert fleet.index.find_matches(gen.request.block_hashes, fleet.now()) == {"worker-1": 3}


async def test_lazy_verification_counts_a_worker_that_had_less_than_predicted(fleet: Fleet) -> None:
    """The second turn is predicted to hit 3 blocks (192 tokens) on worker-1; its engine reports 64
    cached: the index was wrong about that worker, counted once."""
    fleet.on_unavailable("worker-0", "unreachable")
    prompt = list(range(200))
    await collect(fleet, await fleet.start_generation(prompt, 2))
    corrections = fleet.metrics.prediction_corrections
    assert corrections._value.get() == 0  # type: ignore[attr-defined]
    gen = await fleet.start_generation(prompt, 2)
    assert gen.dispatch.predicted_tokens == 192
    await collect(fleet, gen)
    assert corrections._value.get() == 1  # type: ignore[attr-defined]


async def test_a_request_that_never_ran_leaves_no_prediction_behind(fleet: Fleet) -> None:
    """The client left before any token: the blocks predicted on its worker were never computed there."""
    fleet.on_unavailable("worker-0", "unreachable")
    gen = await fleet.start_generation(list(range(200)), 2)
    hashes = gen.request.block_hashes
    assert fleet.index.find_matches(hashes, fleet.now()) == {"worker-1": 3}
    gen.queue = OutputQueue(fleet.now())  # the engine has it queued: nothing comes yet
    reading = asyncio.ensure_future(anext(fleet.outputs(gen)))
    await asyncio.sleep(0)
    reading.cancel()  # the client leaves before the first token
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert gen.worker.aborted == [gen.request_id]  # type: ignore[attr-defined]
    assert fleet.index.find_matches(hashes, fleet.now()) == {}
    assert fleet.metrics.prediction_corrections._value.get() == 1  # type: ignore[attr-defined]


async def test_routing_keeps_a_fleet_view_while_a_worker_is_out(fleet: Fleet) -> None:
    """A worker out of routing leaves the router a maintained view of the others (its fast path at any
    fleet size), not a filtered list; the view follows their loads and returns whole once it is back."""
    from thunderagent.router.candidates import FleetView

    whole = fleet.routable()
    assert isinstance(whole, FleetView) and len(whole) == 2
    fleet.on_unavailable("worker-0", "unreachable")
    rest = fleet.routable()
    assert isinstance(rest, FleetView) and [w.worker_id for w in rest] == ["worker-1"]
    assert fleet.routable() is rest  # built once while the same workers are out
    fleet.on_heartbeat("worker-1", dataclasses.replace(fleet.workers["worker-1"].load(), waiting=3))
    assert rest[0].load.waiting == 3
    fleet.on_heartbeat("worker-0", fleet.workers["worker-0"].load())  # back in routing
    assert fleet.routable() is whole
