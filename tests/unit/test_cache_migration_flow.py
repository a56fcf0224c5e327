"""The live cache-migration driver (``control/cache_migration.py``) with scripted worker handles: a copy runs
as the two halves of a prefill/decode handoff (the source's one-token ``remote_decode`` job on the prefix's
own tokens, cache salt and adapter; the target's one-token request with ``kv_from`` set to the source's
transfer), lands in the index, and each failure is counted by cause; a worker without a KV connector is left
out of the next looks; the copies that landed teach the plane's links (the target's own pull, or its server's
NIXL readings), their own durations do not."""

from __future__ import annotations

import asyncio
import json

from unit.test_cache_migration import BS, MNBT, A, setup, worker
from unit.test_disagg_flow import PARAMS, PdScripted
from thunderagent.control.cache_migration import (BROKEN_BACKOFF_S, MIN_COPY_TIMEOUT_S, CacheMigrationFlow,
                                                   MigrationCollector)
from thunderagent.control.link_learning import LinkLearner
from thunderagent.control.metrics import Metrics
from thunderagent.transfer.migration import PrefixSource
from thunderagent.types import FinishReason, KvPull, TokenOutput

TOKENS = [7000 + i for i in range(len(A) * BS + 40)]  # the prompt: the prefix's 512 blocks, then 40 more


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def clock(self) -> float:
        return self.t


def flow(**modes: str) -> tuple[CacheMigrationFlow, dict[str, PdScripted], Clock]:
    mig, index = setup()
    clock = Clock()
    workers = {w: PdScripted(w, clock, modes.get(w, "ok")) for w in ("w0", "w1", "w2")}  # type: ignore[arg-type]
    return CacheMigrationFlow(mig, workers, index, clock.clock), workers, clock


def demand(f: CacheMigrationFlow, at: float = 0.0) -> None:
    for _ in range(3):
        f.migrator.observe(A + [99_000], len(A), at, None, PrefixSource(TOKENS, 1234, "tenant-a", "ad1"))


HOT = [worker("w0", queued=2 * MNBT), worker("w1", queued=800), worker("w2")]


async def look(f: CacheMigrationFlow, clock: Clock, at: float, fleet: list = HOT) -> list:
    f.tick(fleet, at - 0.3)  # hot from here
    clock.t = at
    f.tick(fleet, at)
    tasks = list(f._tasks.values())
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    return tasks


async def test_a_copy_is_the_sources_job_then_the_targets_pull_of_its_transfer():
    f, workers, clock = flow()
    demand(f)
    assert len(await look(f, clock, 1.0)) == 1
    (job,) = workers["w0"].submitted
    (pull,) = workers["w2"].submitted  # the least-loaded target
    # the source: a one-token prefill-only job on the prefix's own tokens (its 512 blocks and the next token),
    # under the prefix's cache salt and adapter, which key a real engine's cache
    assert job.remote_decode and job.kv_from is None and job.max_tokens == 1
    assert job.prompt_tokens == TOKENS[: len(A) * BS + 1] and job.block_hashes == A
    assert (job.hash_seed, job.cache_salt, job.lora_name) == (1234, "tenant-a", "ad1")
    # the target: the same prompt, taking the source's transfer (vLLM's kv_transfer_params unchanged)
    assert not pull.remote_decode and pull.max_tokens == 1 and pull.prompt_tokens == job.prompt_tokens
    assert pull.kv_from is not None and pull.kv_from.source_worker == "w0"
    assert json.loads(pull.kv_from.engine_params or "") == PARAMS
    assert (pull.cache_salt, pull.lora_name) == ("tenant-a", "ad1")
    assert f.migrator.completed == 1 and f.failures == {} and f.migrator.plane.inflight == {}
    assert f.index.find_matches(A, clock.t)["w2"] == len(A)  # predicted on the target until its events say so


async def test_without_tokens_a_simulated_copy_sends_placeholders_of_the_prefixs_length():
    f, workers, clock = flow()
    for _ in range(3):
        f.migrator.observe(A + [99_000], len(A), 0.0)  # the simulator's way: no tokens kept
    await look(f, clock, 1.0)
    (job,) = workers["w0"].submitted
    assert job.prompt_tokens == [0] * (len(A) * BS + 1) and job.cache_salt is None
    assert f.migrator.completed == 1


async def test_a_source_without_a_connector_fails_the_copy_and_is_left_out_for_a_while():
    f, workers, clock = flow(w0="none")  # answers without a transfer (a vLLM server without a connector)
    demand(f)
    await look(f, clock, 1.0)
    assert f.failures == {"no_kv_transfer": 1} and f.migrator.failed == 1
    assert workers["w2"].submitted == []  # nothing to pull: the target was never asked
    assert f.health()["cache_migration"]["left_out"] == ["w0"]  # type: ignore[index]
    assert await look(f, clock, 2.0) == [] and len(workers["w0"].submitted) == 1  # not asked again
    series = {(m.name, tuple(sorted(smp.labels.items()))): smp.value
              for m in MigrationCollector(f).collect() for smp in m.samples}
    assert series[("thunderagent_cache_migration_copies", (("outcome", "no_kv_transfer"),))] == 1
    assert series[("thunderagent_cache_migration_copies", (("outcome", "ok"),))] == 0
    assert series[("thunderagent_cache_migration_left_out", ())] == 1
    demand(f, 1.0 + BROKEN_BACKOFF_S)  # (demand decays: asked for again)
    assert await look(f, clock, 2.0 + BROKEN_BACKOFF_S) != []  # the backoff is over: tried again
    assert len(workers["w0"].submitted) == 2


async def test_a_target_failing_the_pull_is_left_out_one_too_busy_is_not():
    f, workers, clock = flow()
    workers["w2"].refuse_transfers = True  # UNAVAILABLE: it did not take the request
    demand(f)
    await look(f, clock, 1.0)
    assert f.failures == {"target_busy": 1} and f.health()["cache_migration"]["left_out"] == []  # type: ignore[index]
    orig = workers["w2"].submit

    def failing(req):  # type: ignore[no-untyped-def]
        q = orig(req)
        workers["w2"]._tasks[req.request_id].cancel()
        q.put_output(TokenOutput(req.request_id, [], 0.0, 0, 0, True, FinishReason.ERROR), 0.0)
        return q
    workers["w2"].submit = failing  # type: ignore[method-assign]
    await look(f, clock, 2.0)
    assert f.failures == {"target_busy": 1, "target_refused": 1}
    assert f.health()["cache_migration"]["left_out"] == ["w2"]  # type: ignore[index]


async def test_a_copy_past_its_time_is_cut_and_the_side_running_aborted():
    f, workers, clock = flow(w0="silent")
    demand(f)
    f.tick(HOT, 0.7)
    clock.t = 1.0
    f.tick(HOT, 1.0)
    (task,) = f._tasks.values()
    await asyncio.sleep(0.05)
    assert f.failures == {}  # the timeout is at least MIN_COPY_TIMEOUT_S: a copy is two requests, not bytes
    assert MIN_COPY_TIMEOUT_S >= 30
    task.cancel()  # as the fleet's stop does
    await asyncio.gather(task, return_exceptions=True)
    assert workers["w0"].aborted == ["migrate-1-source"]
    assert f.failures == {"aborted": 1} and f.migrator.plane.inflight == {}


def test_a_kept_prefix_is_a_compact_copy_of_its_tokens():
    from array import array

    src = PrefixSource([5, 70_000, 9, 2**32 - 1], 1, "s", None)
    kept = src.cut(3)
    assert isinstance(kept.tokens, array) and kept.tokens.itemsize == 4 and list(kept.tokens) == [5, 70_000, 9]
    assert (kept.hash_seed, kept.cache_salt, kept.lora_name) == (1, "s", None)
    assert list(src.cut(10).tokens) == [5, 70_000, 9, 2**32 - 1]  # shorter than asked: all of it
    src.tokens[0] = 6  # type: ignore[index]  (a copy: the request's list may change, or go)
    assert list(kept.tokens) == [5, 70_000, 9]
    assert list(PrefixSource(array("I", [1, 2, 3]), 0).cut(2).tokens) == [1, 2]  # from an array too


def learning(f: CacheMigrationFlow) -> LinkLearner:
    f.learner = LinkLearner(f.migrator.plane, Metrics().pd_links_learned, lambda: ("w0", "w1", "w2"))
    return f.learner


async def test_a_landed_copy_teaches_its_link_by_the_targets_own_pull_not_by_its_duration():
    f, workers, clock = flow()
    learner = learning(f)
    links, alpha = f.migrator.plane.links, f.migrator.plane.cfg.ewma_alpha
    default = f.migrator.plane.default_bps
    workers["w2"].pull = KvPull("ok", 10**8, 64, 0.05 + f.migrator.plane.cfg.latency_s)  # 2 GB/s, on its 1st output
    demand(f)
    await look(f, clock, 1.0)
    assert f.migrator.completed == 1 and links[("w0", "w2")].samples == 1
    assert links[("w0", "w2")].bandwidth_bps == (1 - alpha) * default + alpha * 2e9
    assert learner._learned.labels("pull")._value.get() == 1


async def test_a_copy_to_a_server_learns_from_its_nixl_readings_a_failed_one_teaches_nothing():
    f, workers, clock = flow()
    learner = learning(f)
    links = f.migrator.plane.links
    learner.on_server_pulls("w2", 0.0, 0.0, 0.0, 0.5)  # the target's server, before: a baseline
    learner.on_server_pulls("w1", 0.0, 0.0, 0.0, 0.5)
    demand(f)
    await look(f, clock, 1.0)  # no pull on the output: a server moved the bytes
    assert links == {} and learner._landed == {"w2": {"w0": 1.0}}  # (started and landed at 1.0)
    learner.on_server_pulls("w2", 4e8, 0.2 + f.migrator.plane.cfg.latency_s, 1.0, 2.0)  # 400 MB in 0.2 s
    assert links[("w0", "w2")].samples == 1 and learner._learned.labels("server")._value.get() == 1
    learner.on_server_pulls("w1", 4e8, 0.2, 1.0, 2.0)  # nothing landed on w1: no link
    assert set(links) == {("w0", "w2")}
    # a reading between a move's start and its end (the server pulled, its answer is on the way) holds its bytes
    learner.started("w0", "w1", 3.0)
    learner.on_server_pulls("w1", 6e8, 0.3, 2.0, 3.1)
    assert links[("w0", "w1")].samples == 1
