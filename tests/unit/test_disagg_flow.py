"""The live prefill/decode flow (``control.disagg_flow``) with scripted worker handles: a planned
request prefills on one worker, its decode worker gets the transfer, the client sees one normal
stream; every failure of the prefill half falls back to prefilling on the decode worker (counted by
cause), and aborting the request aborts both halves."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import pytest

from thunderagent.config import NodeConfig, parse_config
from thunderagent.control.disagg_flow import PdAttempt
from thunderagent.control.fleet import Fleet, Generation
from thunderagent.control.membership import StaticMembership
from thunderagent.execution.handle import OutputQueue, WorkerCallbacks
from thunderagent.router.router import NoWorkerAvailable
from thunderagent.types import EngineRequest, FinishReason, KvPull, KvTransfer, LoadReport, PdPlan, TokenOutput

PARAMS = {"remote_engine_id": "e1", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 5600}
PLAN = PdPlan("worker-0", 128, 4096, 0.01, 0.05, "test")


class PdScripted:
    """A worker handle. Normal requests: two tokens ("h", "i"), a step apart. ``remote_decode`` jobs
    per ``prefill``: ok (one token, finished with a KvTransfer), none (no transfer), error,
    unavailable, silent (never answers nor touches), slow (touches, never finishes)."""

    def __init__(self, wid: str, cb: WorkerCallbacks, prefill: str = "ok") -> None:
        self.worker_id = wid
        self.cb = cb
        self.prefill = prefill
        self.refuse_transfers = False  # a decode request with kv_from ends UNAVAILABLE (vLLM: HTTP 500)
        self.pull: KvPull | None = None  # a decode worker that pulls the bytes itself reports this
        self.submitted: list[EngineRequest] = []
        self.aborted: list[str] = []
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, req: EngineRequest) -> OutputQueue:
        self.submitted.append(req)
        q = OutputQueue(self.cb.clock())
        self._tasks[req.request_id] = asyncio.create_task(self._run(req, q))
        return q

    async def _run(self, req: EngineRequest, q: OutputQueue) -> None:
        rid, n, now = req.request_id, len(req.prompt_tokens), self.cb.clock
        if req.kv_from is not None and self.refuse_transfers:
            await asyncio.sleep(0.01)
            q.put_output(TokenOutput(rid, [], now(), n, 0, True, FinishReason.UNAVAILABLE, kv_pull=self.pull), now())
            return
        if not req.remote_decode:
            q.accepted = True
            for k, (tok, last) in enumerate(((104, False), (105, True))):
                await asyncio.sleep(0.01)
                q.put_output(TokenOutput(rid, [tok], now(), n, 0, last, FinishReason.LENGTH if last else None,
                                         text=chr(tok), kv_pull=self.pull if req.kv_from and not k else None), now())
            return
        mode = self.prefill
        if mode == "silent":
            await asyncio.Event().wait()
        if mode == "starved":  # answers while our whole process is starved (CI's shared cores)
            await asyncio.sleep(0.05)
            time.sleep(1.0)  # noqa: ASYNC251 (the starved loop is the point)
            for _ in range(3):  # the answer then takes a few loop passes out of its socket
                await asyncio.sleep(0)
            mode = "ok"
        while mode == "slow":
            await asyncio.sleep(0.01)
            q.touch(now())
        await asyncio.sleep(0.01)
        if mode == "unavailable":
            q.put_output(TokenOutput(rid, [], now(), n, 0, True, FinishReason.UNAVAILABLE), now())
        elif mode == "error":
            q.put_output(TokenOutput(rid, [], now(), n, 0, True, FinishReason.ERROR), now())
        else:
            out = TokenOutput(rid, [120], now(), n, 0, True, FinishReason.LENGTH)
            if mode == "ok":
                out.kv_transfer = KvTransfer(self.worker_id, n, tuple(req.block_hashes), json.dumps(PARAMS))
            q.put_output(out, now())

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None and not task.done():
            self.aborted.append(request_id)
            task.cancel()

    def load(self) -> LoadReport:
        return LoadReport(self.worker_id, 0.0, 0, 0, 0, 0, 0, 0, 100)

    def snapshot(self) -> tuple[list[int], int] | None:
        return [], -1


@dataclass
class Observer:
    events: list[tuple] = field(default_factory=list)
    strict: bool = False

    room: bool = True
    pulls: list[object] = field(default_factory=list)
    planned: list[str] = field(default_factory=list)  # (told before the flow's task starts)

    def on_planned(self, plan: PdPlan) -> None:
        self.planned.append(plan.prefill_worker)

    def on_transfer_start(self, request_id: str, plan: PdPlan, decode_worker: str, now: float) -> bool:
        self.events.append(("start", plan.prefill_worker, decode_worker))
        return self.room

    def on_transfer_end(self, request_id: str, plan: PdPlan, ok: bool, cause: str, nbytes: int, seconds: float,
                        now: float, pull: object = None) -> None:
        assert seconds >= 0
        self.events.append(("end", ok, cause, nbytes))
        self.pulls.append(pull)


async def pd_fleet(prefill: str, plan: PdPlan = PLAN, *,
                   prefill_timeout: float = 30.0) -> tuple[Fleet, PdScripted, PdScripted, Observer]:
    """worker-0 prefills (``prefill`` mode), worker-1 decodes; every request is planned with ``plan``
    (the disaggregation decision is not this module's: forced here). A prefill silent for 0.5 s
    falls back (half the fleet's stall timeout)."""
    cfg = parse_config({
        "model": "/unused", "routing": {"seed": 1}, "control_plane": {"health_check_enabled": False},
        "execution_group": {"nodes": [{"engine": "vllm", "endpoints": [{"url": "http://a"}, {"url": "http://b"}]}]},
    })

    def factory(node: NodeConfig, wid: str, k: int, cb: WorkerCallbacks) -> PdScripted:
        return PdScripted(wid, cb, prefill if k == 0 else "ok")

    f = Fleet(cfg, StaticMembership(cfg.execution_group, {"vllm": factory}), stall_timeout=1.0)
    await f.start()
    f.disagg.observer = obs = Observer()
    f.disagg.prefill_timeout = prefill_timeout
    submit = f.dispatcher.submit

    def planned(req, key, workers, now, program=None, tenant=None, pin=None):  # type: ignore[no-untyped-def]
        d = submit(req, key, [w for w in workers if w.worker_id == "worker-1"], now, program, tenant, pin)
        d.pd = plan
        return d

    f.dispatcher.submit = planned  # type: ignore[method-assign]
    return f, f.workers["worker-0"], f.workers["worker-1"], obs  # type: ignore[return-value]


async def stream(f: Fleet, gen: Generation) -> list[TokenOutput]:
    return [o async for o in f.outputs(gen)]


def value(metric, **labels) -> float:  # type: ignore[no-untyped-def]
    return (metric.labels(**labels) if labels else metric)._value.get()


async def test_planned_request_prefills_remotely_and_decodes_with_the_transfer() -> None:
    f, pre, dec, obs = await pd_fleet("ok")
    gen = await f.start_generation(list(range(200)), 2)
    assert isinstance(gen.worker, PdAttempt) and gen.worker.worker_id == "worker-1"
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]] and outs[-1].finish_reason == "length"
    (job,) = pre.submitted
    assert job.remote_decode and job.kv_from is None and job.prompt_tokens == list(range(200))
    (req,) = dec.submitted
    assert not req.remote_decode and req.request_id == gen.request_id
    assert req.kv_from is not None and json.loads(req.kv_from.engine_params or "") == PARAMS
    assert req.kv_from.source_worker == "worker-0" and req.kv_from.block_hashes == tuple(job.block_hashes)
    assert obs.events == [("start", "worker-0", "worker-1"), ("end", True, "ok", 4096)]
    assert obs.planned == ["worker-0"]  # told at submit, before the task ran
    m = f.metrics
    assert value(m.pd_started) == 1 and value(m.pd_ok) == 1
    assert m.pd_seconds._sum.get() > 0  # type: ignore[attr-defined]
    assert b"thunderagent_pd_transfers_ok_total 1.0" in m.render()


async def test_a_full_plane_sends_the_plan_to_local_prefill() -> None:
    """Backpressure: the plane is at its in-flight cap when the plan starts: no prefill job runs, the
    decode worker prefills the request itself, counted as a plane_full fallback."""
    f, pre, dec, obs = await pd_fleet("ok")
    obs.room = False
    gen = await f.start_generation(list(range(200)), 2)
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]]
    assert pre.submitted == [] and [r.kv_from for r in dec.submitted] == [None]
    assert value(f.metrics.pd_fallbacks, cause="plane_full") == 1 and value(f.metrics.pd_started) == 0


@pytest.mark.parametrize(("mode", "cause"), [
    ("none", "no_kv_transfer"), ("error", "prefill_error"), ("unavailable", "prefill_unavailable"),
    ("silent", "prefill_silent"), ("slow", "prefill_timeout"),
])
async def test_a_failed_prefill_falls_back_to_the_decode_worker(mode: str, cause: str) -> None:
    f, pre, dec, obs = await pd_fleet(mode, prefill_timeout=1.0)
    gen = await f.start_generation(list(range(100)), 2)
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]] and outs[-1].finish_reason == "length"
    (req,) = dec.submitted
    assert req.kv_from is None and not req.remote_decode, "prefilled on the decode worker"
    assert pre.aborted == ([gen.request_id] if mode in ("silent", "slow") else [])
    assert obs.events == [("start", "worker-0", "worker-1"), ("end", False, cause, 0)]
    assert value(f.metrics.pd_fallbacks, cause=cause) == 1
    assert value(f.metrics.pd_failed, cause=cause) == 1 and value(f.metrics.pd_ok) == 0


async def test_a_prefill_answering_while_our_loop_was_starved_is_not_judged_silent() -> None:
    """The loop starved 1 s, twice the silence bound: the prefill's answer was sent meanwhile and is
    read a few passes later. Silence counts on-time loop only, so the transfer goes ahead."""
    f, pre, dec, obs = await pd_fleet("starved")
    gen = await f.start_generation(list(range(100)), 2)
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]]
    assert [r.kv_from is not None for r in dec.submitted] == [True], "decoded from the transfer"
    assert obs.events == [("start", "worker-0", "worker-1"), ("end", True, "ok", PLAN.transfer_bytes)]
    assert value(f.metrics.pd_ok) == 1 and value(f.metrics.pd_fallbacks, cause="prefill_silent") == 0


async def test_decode_worker_refusing_the_transfer_prefills_itself() -> None:
    f, pre, dec, obs = await pd_fleet("ok")
    dec.refuse_transfers = True
    gen = await f.start_generation(list(range(100)), 2)
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]] and outs[-1].finish_reason == "length"
    assert [r.kv_from is not None for r in dec.submitted] == [True, False] and gen.worker.worker_id == "worker-1"
    assert obs.events == [("start", "worker-0", "worker-1"), ("end", False, "decode_refused_transfer", 0)]
    assert value(f.metrics.pd_fallbacks, cause="decode_refused_transfer") == 1
    assert f.metrics.rerouted._value.get() == 0, "no detour through another worker"  # type: ignore[attr-defined]


async def test_a_decode_workers_pull_is_reported_and_its_failure_counted_by_its_cause() -> None:
    """Simulated workers pull the bytes themselves: a good pull rides on the first output to the
    observer (the plane learns the link from it); a failed one is a refusal with the pull's cause."""
    f, pre, dec, obs = await pd_fleet("ok")
    dec.pull = good = KvPull("ok", 4096, 2, 0.01)
    outs = await stream(f, await f.start_generation(list(range(100)), 2))
    assert [o.token_ids for o in outs] == [[104], [105]] and obs.pulls == [good]
    assert value(f.metrics.pd_pulled_bytes) == 4096 and value(f.metrics.pd_pull_checksums) == 2
    dec.refuse_transfers, dec.pull = True, KvPull("kv_checksum", 0, 0, 0.01)
    outs = await stream(f, await f.start_generation(list(range(100, 200)), 2))
    assert [o.token_ids for o in outs] == [[104], [105]] and outs[-1].finish_reason == "length"
    assert obs.events[-1] == ("end", False, "kv_checksum", 0)
    assert value(f.metrics.pd_fallbacks, cause="kv_checksum") == 1
    assert value(f.metrics.pd_fallbacks, cause="decode_refused_transfer") == 0
    assert value(f.metrics.pd_pulled_bytes) == 4096


async def test_prefill_worker_leaving_mid_prefill_falls_back() -> None:
    f, pre, dec, obs = await pd_fleet("slow")
    gen = await f.start_generation(list(range(100)), 2)
    await asyncio.sleep(0.05)
    f.leave("worker-0", "test: gone")
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]]
    assert dec.submitted[0].kv_from is None and pre.aborted == [gen.request_id]
    assert value(f.metrics.pd_fallbacks, cause="prefill_worker_gone") == 1


async def test_a_plan_naming_an_unknown_worker_falls_back() -> None:
    f, pre, dec, obs = await pd_fleet("ok", PdPlan("worker-9", 128, 4096, 0.01, 0.05, "test"))
    outs = await stream(f, await f.start_generation(list(range(100)), 2))
    assert [o.token_ids for o in outs] == [[104], [105]] and not pre.submitted
    assert value(f.metrics.pd_fallbacks, cause="prefill_worker_gone") == 1


async def test_client_gone_while_prefilling_aborts_both_halves() -> None:
    f, pre, dec, obs = await pd_fleet("slow")
    gen = await f.start_generation(list(range(100)), 2)
    it = f.outputs(gen)
    task = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0.05)
    task.cancel()  # the client went away while the prefill ran
    with pytest.raises(asyncio.CancelledError):
        await task
    await it.aclose()
    await asyncio.sleep(0.05)
    assert pre.aborted == [gen.request_id] and not dec.submitted, "nothing reached the decode worker"
    assert obs.events == [("start", "worker-0", "worker-1"), ("end", False, "aborted", 0)]
    assert value(f.metrics.pd_failed, cause="aborted") == 1
    assert value(f.metrics.pd_fallbacks, cause="aborted") == 0


async def test_decode_worker_lost_while_prefilling_routes_the_request_again() -> None:
    """The fleet cuts the request when its decode worker leaves: not yet accepted there, so it is
    routed again (plainly here) and the prefill half is stopped."""
    f, pre, dec, obs = await pd_fleet("slow")
    gen = await f.start_generation(list(range(100)), 2)
    await asyncio.sleep(0.05)
    f.dispatcher.submit = None  # type: ignore[assignment]  # (routing again uses dispatch, not submit)
    f.leave("worker-1", "test: gone")
    outs = await stream(f, gen)
    assert pre.aborted == [gen.request_id]
    assert [o.token_ids for o in outs] == [[104], [105]] and gen.worker is pre, "routed again to worker-0"
    assert f.metrics.rerouted._value.get() == 1  # type: ignore[attr-defined]


async def strict_fleet(prefill: str, **kw: object) -> tuple[Fleet, PdScripted, PdScripted, Observer]:
    """``pd_fleet`` in strict mode: a dispatch that leaves worker-0 (the prefill worker) out raises, as
    the strict dispatcher does without a prefill worker; one that leaves worker-1 out goes to worker-0."""
    f, pre, dec, obs = await pd_fleet(prefill, **kw)  # type: ignore[arg-type]
    obs.strict = True
    dispatch = f.dispatcher.dispatch

    def strict(req, workers, now, exclude=(), **more):  # type: ignore[no-untyped-def]
        if "worker-0" in exclude:
            raise NoWorkerAvailable("no prefill worker is routable and routing.fallback_to_local is false")
        return dispatch(req, workers, now, exclude=exclude, **more)

    f.dispatcher.dispatch = strict  # type: ignore[method-assign]
    return f, pre, dec, obs


@pytest.mark.parametrize(("mode", "cause"), [("error", "prefill_error"), ("silent", "prefill_silent")])
async def test_strict_a_failed_prefill_is_routed_again_without_its_prefill_worker(mode: str, cause: str) -> None:
    """``routing.fallback_to_local: false``: the decode worker never prefills it; the request is routed
    again without the prefill worker at fault, and with none left the client gets the refusal."""
    f, pre, dec, obs = await strict_fleet(mode)
    gen = await f.start_generation(list(range(100)), 2)
    outs = await stream(f, gen)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [([], FinishReason.UNAVAILABLE)]
    assert dec.submitted == [], "nothing went to the decode worker: no local prefill"
    assert obs.events == [("start", "worker-0", "worker-1"), ("end", False, cause, 0)]
    m = f.metrics
    assert value(m.pd_rerouted, cause=cause) == 1 and value(m.pd_fallbacks, cause=cause) == 0
    assert value(m.pd_failed, cause=cause) == 1
    assert isinstance(gen.worker, PdAttempt) and gen.worker.blamed == "worker-0"
    # the slow-worker breakers charge the prefill worker that failed it, not the decode worker
    failures = {wid: w.failures for wid, w in f.outliers.breakers._workers.items()}
    assert failures.get("worker-0") == 1 and not failures.get("worker-1"), failures


async def test_strict_a_refused_transfer_is_routed_again_without_its_decode_worker() -> None:
    f, pre, dec, obs = await strict_fleet("ok")
    dec.refuse_transfers = True
    gen = await f.start_generation(list(range(100)), 2)
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]] and outs[-1].finish_reason == "length"
    assert [r.kv_from is not None for r in dec.submitted] == [True], "worker-1 never prefilled it"
    assert gen.tried == ("worker-1",) and gen.worker.worker_id == "worker-0"
    assert value(f.metrics.pd_rerouted, cause="decode_refused_transfer") == 1
    assert value(f.metrics.pd_fallbacks, cause="decode_refused_transfer") == 0
    assert f.metrics.rerouted._value.get() == 1  # type: ignore[attr-defined]


async def test_strict_a_full_plane_waits_for_room_instead_of_prefilling_locally() -> None:
    f, pre, dec, obs = await strict_fleet("ok")
    obs.room = False
    gen = await f.start_generation(list(range(200)), 2)
    await asyncio.sleep(0.1)
    assert pre.submitted == [] and dec.submitted == [], "waiting for the plane"
    obs.room = True
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]]
    assert [r.kv_from is not None for r in dec.submitted] == [True] and len(pre.submitted) == 1
    assert value(f.metrics.pd_fallbacks, cause="plane_full") == 0 and value(f.metrics.pd_ok) == 1
    assert obs.events[-1] == ("end", True, "ok", PLAN.transfer_bytes)


async def test_strict_a_plane_full_past_the_prefill_timeout_is_routed_again() -> None:
    f, pre, dec, obs = await strict_fleet("ok", prefill_timeout=0.2)
    obs.room = False
    gen = await f.start_generation(list(range(200)), 2)
    outs = await stream(f, gen)
    assert [o.token_ids for o in outs] == [[104], [105]], "routed again: worker-1 left out, worker-0 served it"
    assert gen.tried == ("worker-1",) and pre.submitted[0].kv_from is None and dec.submitted == []
    assert value(f.metrics.pd_rerouted, cause="plane_full") == 1 and value(f.metrics.pd_started) == 0
