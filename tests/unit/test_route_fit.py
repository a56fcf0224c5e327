"""A mixed fleet (router/router.py ``holding``): a request goes only to workers that can hold it, on the
fleet-view fast path and on a plain list, whatever the cache and the load say."""

from __future__ import annotations

import random

from thunderagent.config import NodeConfig, Policy, RoutingConfig
from thunderagent.kv.index import KvIndex
from thunderagent.router.candidates import FleetView
from thunderagent.router.router import KvRouter, holding
from thunderagent.types import BlockStored, LoadReport, RouteRequest, WorkerState

BS = 16


def worker(wid: str, seq: int = 0, prompt: int = 0, queued: int = 0) -> WorkerState:
    return WorkerState(wid, BS, 1024, 8, LoadReport(wid, 0.0, 0, 0, queued, 0, 0, 0, 1000),
                       max_seq_tokens=seq, max_prompt_tokens=prompt)


def req(n: int, max_tokens: int = 0, hashes: list[int] | None = None) -> RouteRequest:
    return RouteRequest("r", n, hashes or [], max_tokens=max_tokens)


def test_holds_reads_both_limits_and_zero_means_unknown():
    w = worker("a", seq=1024, prompt=256)
    assert w.holds(256, 1024) and not w.holds(257, 300) and not w.holds(100, 1025)
    assert worker("b").holds(10**9, 10**9)  # a real engine's limits are its own to enforce


def test_a_fleet_view_is_passed_through_when_every_worker_holds_the_request():
    view = FleetView(RoutingConfig(), [worker("small", seq=1024), worker("big", seq=8192), worker("real")])
    assert (view.seq_floor, view.prompt_floor) == (1024, 1 << 62)
    assert holding(req(900, 124), view) is view  # 1,024 in all: no copy, the fast path stays
    fit = holding(req(900, 125), view)
    assert [w.worker_id for w in fit] == ["big", "real"]
    assert [w.worker_id for w in holding(req(10_000), view)] == ["real"]  # its limit is its own to enforce
    view.remove("small")
    assert view.seq_floor == 8192  # rebuilt on leave
    view.remove("real")
    assert holding(req(10_000), view) is view  # nobody holds it: unchanged (the frontend refuses such requests)


def test_a_non_chunked_worker_takes_only_prompts_of_one_pass():
    workers = [worker("one-pass", seq=8192, prompt=512), worker("chunked", seq=8192)]
    assert [w.worker_id for w in holding(req(600, 10), workers)] == ["chunked"]
    assert holding(req(500, 10), workers) is workers


def test_router_sends_a_long_request_past_the_small_holder_of_its_prefix():
    """The small worker holds the whole prefix and is idle; the big one is cold and loaded. A request
    that fits both goes to the holder; one that outgrows the small worker goes to the big one."""
    cfg = RoutingConfig(policy=Policy.kv_aware, candidate_limit=1, whole_scan_max_workers=0)  # fast path from two workers
    index = KvIndex(prediction_ttl=30.0)
    hashes = list(range(1, 41))  # 40 blocks = 640 tokens
    index.apply_event(BlockStored("small", 1, tuple(hashes)), 0.0)
    router = KvRouter(cfg, index, random.Random(0))
    view = FleetView(cfg, [worker("small", seq=1024), worker("big", seq=8192, queued=2000)])
    assert router.route(req(640, 64, hashes), view, 1.0, predict=False).worker_id == "small"
    d = router.route(req(640, 512, hashes), view, 1.0, predict=False)
    assert d.worker_id == "big" and [c.worker_id for c in d.candidates] == ["big"]
    assert d.reason.startswith("1 cannot hold it; "), d.reason  # the explanation says why "small" was passed over
    plain = list(view)  # a retry's filtered list takes the same filter
    assert router.route(req(640, 512, hashes), plain, 1.0, predict=False).worker_id == "big"


def test_node_limits_come_from_the_simulated_engine_and_are_unknown_for_real_ones():
    assert NodeConfig(kv_blocks=64, block_size=16).sequence_limits() == (1024, 0)
    assert NodeConfig(kv_blocks=64, block_size=16, max_num_batched_tokens=256,
                      enable_chunked_prefill=False).sequence_limits() == (1024, 256)
    real = NodeConfig(engine="vllm", endpoints=[{"url": "http://127.0.0.1:1"}])
    assert real.sequence_limits() == (0, 0)


def test_a_pinned_request_leaves_its_worker_when_that_one_cannot_hold_it():
    """A program's pin (or a follower's leader) is kept while the pinned worker holds the request; a
    context grown past the pinned worker's limit goes where it fits instead of being refused there."""
    from thunderagent.scheduler.dispatch import Dispatcher

    cfg = RoutingConfig(policy=Policy.kv_aware)
    d = Dispatcher(KvRouter(cfg, KvIndex(prediction_ttl=30.0), random.Random(0)), BS)
    workers = [worker("small", seq=1024), worker("big", seq=8192, queued=5000)]
    short = d.prepare("r1", list(range(600)), 100)
    assert d.dispatch(short, workers, 0.0, pin="small").decision.worker_id == "small"
    assert d.dispatch(d.prepare("r2", list(range(600)), 100), workers, 0.0, pin="big").decision.worker_id == "big"
    grown = d.prepare("r3", list(range(1000)), 100)
    assert d.dispatch(grown, workers, 0.0, pin="small").decision.worker_id == "big"


def test_a_fallback_past_too_small_workers_still_counts_as_a_fallback():
    """Every worker that holds it is busy: the fallback chooses, and the decision metrics and the
    decision log's summary still call it a fallback behind the "cannot hold it" note."""
    from thunderagent.control.seed_metrics import decision_kind
    from thunderagent.observe.decision_summary import why_elsewhere
    from thunderagent.scheduler.dispatch import Dispatcher

    d = Dispatcher(KvRouter(RoutingConfig(policy=Policy.kv_aware), KvIndex(prediction_ttl=30.0),
                            random.Random(0)), BS)
    busy = WorkerState("big", BS, 1024, 1, LoadReport("big", 0.0, 1, 1, 0, 0, 0, 0, 1000), max_seq_tokens=8192)
    out = d.dispatch(d.prepare("r", list(range(2000)), 10), [worker("small", seq=1024), busy], 0.0)
    assert out.decision.worker_id == "big"
    assert out.decision.reason.startswith("1 cannot hold it; all workers busy"), out.decision.reason
    assert decision_kind(out) == "fallback"
    line = {"policy": "kv_aware", "reason": out.decision.reason,
            "candidates": [{"overlap_blocks": 1, "busy": True}]}
    assert why_elsewhere(line) == "all workers busy"
