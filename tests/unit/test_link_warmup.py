"""The links' warm-ups (``control/link_warmup.py``, ``kv_cache_transfer.warmup_tokens``) on a fleet of scripted
handles: one handoff per prefill -> decode link, one at a time, through the live flow (its plane accounting);
a failed one tried again after ``RETRY_S`` at most ``MAX_TRIES`` times; a link of a departed worker forgotten;
the results in ``/health``; the field refused where it cannot act."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from unit.test_disagg_flow import PdScripted
from thunderagent.config import KvTransferConfig, MigrationConfig, NodeConfig, parse_config
from thunderagent.control.fleet import Fleet
from thunderagent.control.link_warmup import MAX_TRIES, RETRY_S, SALT
from thunderagent.control.membership import StaticMembership
from thunderagent.execution.handle import WorkerCallbacks
from thunderagent.kv.hashing import block_hashes, hash_seed

BS = 16


async def warm_fleet(prefill: str = "ok", tokens: int = 100) -> tuple[Fleet, dict[str, PdScripted]]:
    """worker-0 prefills (scripted ``prefill`` mode); worker-1 and worker-2 decode."""
    cfg = parse_config({
        "model": "/unused", "routing": {"seed": 1}, "control_plane": {"health_check_enabled": False},
        "execution_group": {"nodes": [
            {"engine": "vllm", "role": "prefill", "block_size": BS, "endpoints": [{"url": "http://p"}],
             "kv_cache_transfer": {"enabled": True, "warmup_tokens": tokens}},
            {"engine": "vllm", "role": "decode", "block_size": BS,
             "endpoints": [{"url": "http://a"}, {"url": "http://b"}]}]},
    })

    def factory(node: NodeConfig, wid: str, k: int, cb: WorkerCallbacks) -> PdScripted:
        return PdScripted(wid, cb, prefill if wid == "worker-0" else "ok")

    f = Fleet(cfg, StaticMembership(cfg.execution_group, {"vllm": factory}), stall_timeout=1.0)
    await f.start()
    return f, dict(f.workers)  # type: ignore[arg-type]


async def settle(f: Fleet) -> None:
    w = f.transfers.warmup
    assert w is not None
    if w._task is not None:
        await asyncio.wait_for(w._task, 5.0)


async def test_each_link_is_warmed_up_once_one_at_a_time_through_the_flow() -> None:
    f, ws = await warm_fleet(tokens=100)
    warm = f.transfers.warmup
    assert warm is not None
    f.transfers.tick(f.routable(), f.now())
    await asyncio.sleep(0.001)  # (the warm-up's task submits its prefill half)
    f.transfers.tick(f.routable(), f.now())  # one at a time: nothing more starts while it runs
    await asyncio.sleep(0.001)
    assert len(ws["worker-0"].submitted) == 1
    await settle(f)
    (job,) = ws["worker-0"].submitted
    # whole blocks (100 tokens -> 6 blocks of 16), under the warm-ups' own salt, one token asked
    assert len(job.prompt_tokens) == 96 and job.remote_decode and job.cache_salt == SALT
    assert job.block_hashes == block_hashes(job.prompt_tokens, BS, hash_seed(SALT))
    assert len(set(job.prompt_tokens)) > 1 and all(10 <= t < 266 for t in job.prompt_tokens)
    (pull,) = ws["worker-1"].submitted
    assert pull.kv_from is not None and pull.kv_from.source_worker == "worker-0" and pull.max_tokens == 1
    f.transfers.tick(f.routable(), f.now())
    await settle(f)
    assert len(ws["worker-2"].submitted) == 1 and len(ws["worker-0"].submitted) == 2
    f.transfers.tick(f.routable(), f.now())  # every link warmed: nothing more
    assert warm._task is not None and warm._task.done() and len(ws["worker-0"].submitted) == 2
    links = f.health_summary()["pd_warmup"]
    assert [(x["src"], x["dst"], x["ok"], x["cause"], x["tries"]) for x in links] == [  # type: ignore[union-attr]
        ("worker-0", "worker-1", True, "ok", 1), ("worker-0", "worker-2", True, "ok", 1)]
    # the plane accounted both transfers, as a client's (the prefill group's observer)
    assert f.transfers.observer is not None and f.transfers.observer.plane.stats.completed == 2
    assert f.metrics.pd_ok._value.get() == 2  # type: ignore[attr-defined]
    await f.stop()


async def test_a_failed_warm_up_is_tried_again_later_at_most_max_tries_times() -> None:
    f, ws = await warm_fleet(prefill="none")  # the prefill server answers without a transfer
    now = f.now()
    for k in range(MAX_TRIES + 1):
        t = now + k * (RETRY_S + 1)
        f.transfers.tick(f.routable(), t)
        await settle(f)
        f.transfers.tick(f.routable(), t + 1)  # the other link, within the same round
        await settle(f)
    warm = f.transfers.warmup
    assert warm is not None
    got = {(s, d): (r.ok, r.cause, r.tries) for (s, d), r in warm.links.items()}
    assert got == {("worker-0", "worker-1"): (False, "no_kv_transfer", MAX_TRIES),
                   ("worker-0", "worker-2"): (False, "no_kv_transfer", MAX_TRIES)}
    assert len(ws["worker-0"].submitted) == 2 * MAX_TRIES  # not past MAX_TRIES
    # each fell back as a client's plan would: its decode worker computed the prompt
    assert all(r.kv_from is None for w in ("worker-1", "worker-2") for r in ws[w].submitted)
    await f.stop()


async def test_a_departed_workers_links_are_forgotten_and_warmed_again_when_it_is_back() -> None:
    f, ws = await warm_fleet()
    for _ in range(2):
        f.transfers.tick(f.routable(), f.now())
        await settle(f)
    warm = f.transfers.warmup
    assert warm is not None and len(warm.links) == 2
    handle = f.workers.pop("worker-2")
    f.transfers.tick(f.routable(), f.now())
    assert list(warm.links) == [("worker-0", "worker-1")]
    f.workers["worker-2"] = handle
    f.transfers.tick(f.routable(), f.now())
    await settle(f)
    assert len(warm.links) == 2 and len(ws["worker-2"].submitted) == 2
    await f.stop()


def test_warmup_tokens_is_refused_where_it_cannot_act() -> None:
    with pytest.raises(ValidationError, match="warmup_tokens"):
        KvTransferConfig(warmup_tokens=64)  # the plane off
    with pytest.raises(ValidationError, match="prefill group"):
        MigrationConfig(enabled=True, link=KvTransferConfig(enabled=True, warmup_tokens=64))
    with pytest.raises(ValidationError, match="warmup_tokens"):
        KvTransferConfig(enabled=True, warmup_tokens=-1)


async def test_a_warm_up_that_finds_the_plane_full_says_so() -> None:
    from unit.test_disagg_flow import Observer

    f, ws = await warm_fleet()
    f.disagg.observer = Observer(room=False)  # the plane at its cap: the plan prefills on its decode worker
    f.transfers.tick(f.routable(), f.now())
    await settle(f)
    warm = f.transfers.warmup
    assert warm is not None
    assert [(r.ok, r.cause) for r in warm.links.values()] == [(False, "plane_full")]
    assert ws["worker-0"].submitted == [] and [r.kv_from for r in ws["worker-1"].submitted] == [None]
    await f.stop()
