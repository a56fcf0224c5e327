"""Prefix grouping and coalescing through the one dispatch path: exact followers, releases, cancel."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from thunderagent.config import GroupingConfig, RoutingConfig, SchedulerConfig
from thunderagent.kv.hashing import block_hash_pairs, hash_seed
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.types import BlockStored, EngineRequest, LoadReport, WorkerState

BS = 4
PREFIX = [7] * (4 * BS)  # 4 shared blocks
WAIT = 0.5


def dispatcher(*, enabled: bool = True, coalesce: bool = False, window_ms: float = 10.0) -> Dispatcher:
    cfg = GroupingConfig(enabled=enabled, coalesce=coalesce, group_min_blocks=4, follower_max_wait_ms=WAIT * 1e3,
                         **({"window_max_ms": window_ms, "batch_window_max_ms": 5 * window_ms} if enabled else {}))
    index = KvIndex(prediction_ttl=60.0)
    for w in ("a", "b"):
        index.add_worker(w)
    return Dispatcher(KvRouter(RoutingConfig(seed=0), index, random.Random(0)), BS, SchedulerConfig(enabled=False, grouping=cfg))


def worker(wid: str, *, running: int = 0, queued: int = 0) -> WorkerState:
    return WorkerState(wid, BS, 64, 64, LoadReport(wid, 0.0, running, 0, queued, 0, 0, 0, 1000))


def req(d: Dispatcher, rid: str, prompt: list[int], *, priority: int = 0) -> EngineRequest:
    return d.prepare(rid, prompt, 4, priority=priority)


def busy() -> list[WorkerState]:
    return [worker("a", running=1), worker("b", running=1)]


def stored(d: Dispatcher, wid: str, prompt: list[int], seq: int) -> None:
    """The engine's event, with the check hashes engines send while the double-hash guard is on."""
    hashes, checks = block_hash_pairs(prompt, BS, hash_seed(None, None))
    d.index.apply_event(BlockStored(wid, seq, tuple(hashes), None, tuple(checks)), 0.0)


def drain(d: Dispatcher, workers: list[WorkerState], now: float) -> list[tuple[str, str]]:
    out = []
    while (x := d.pump(workers, now)) is not None:
        out.append((x.request.request_id, x.decision.worker_id))
    return out


def test_siblings_follow_the_leader_on_a_busy_fleet_and_go_once_its_prefix_is_stored() -> None:
    d = dispatcher()
    lead = d.submit(req(d, "lead", PREFIX + [1] * 3), "", busy(), 0.0)
    assert lead is not None
    w = lead.decision.worker_id
    assert d.submit(req(d, "s1", PREFIX + [2] * 5), "", busy(), 0.01) is None
    assert d.submit(req(d, "s2", PREFIX + [3] * 5), "", busy(), 0.02) is None
    short = d.submit(req(d, "short", PREFIX[: 3 * BS] + [4] * 5), "", busy(), 0.03)  # 3 shared blocks: too few
    assert short is not None
    other = d.submit(req(d, "other", [9] * (5 * BS)), "", busy(), 0.03)  # no shared prefix
    assert other is not None
    assert d.held() == 2 and drain(d, busy(), 0.04) == []
    assert d.kv_stored("b" if w == "a" else "a") == 0
    stored(d, "b" if w == "a" else "a", PREFIX, 0)  # the prefix elsewhere does not release them
    assert d.kv_stored("b" if w == "a" else "a") == 0
    stored(d, w, PREFIX, 0)
    assert d.kv_stored(w) == 2
    assert drain(d, busy(), 0.05) == [("s1", w), ("s2", w)]  # pinned to the leader's worker
    assert d.held() == 0
    # the prefix is stored: a later sibling is routed at once (the router finds the cache)
    assert d.submit(req(d, "s3", PREFIX + [5] * 5), "", busy(), 0.06) is not None


def test_predicted_blocks_do_not_count_as_stored() -> None:
    d = dispatcher()
    lead = d.submit(req(d, "lead", PREFIX + [1]), "", busy(), 0.0)
    assert lead is not None and d.index.find_matches(lead.request.block_hashes, 0.0)  # predicted only
    assert d.submit(req(d, "s1", PREFIX + [2]), "", busy(), 0.01) is None


def test_an_idle_worker_starts_its_own_copy_of_the_prefix() -> None:
    d = dispatcher()
    idle = [worker("a"), worker("b")]
    lead = d.submit(req(d, "lead", PREFIX + [1]), "", idle, 0.0)
    assert lead is not None
    w = lead.decision.worker_id
    other = "b" if w == "a" else "a"
    workers = [worker(w, running=1), worker(other)]
    second = d.submit(req(d, "s1", PREFIX + [2]), "", workers, 0.01)
    assert second is not None and second.decision.worker_id == other  # leads a group there
    workers = [worker(w, running=1), worker(other, running=1)]
    assert d.submit(req(d, "s2", PREFIX + [3] * 9), "", workers, 0.02) is None
    assert d.submit(req(d, "s3", PREFIX + [4]), "", workers, 0.03) is None
    # the fewest follower tokens first: s2 (9 suffix tokens) went to one group, s3 to the other
    assert d.progressed("lead", ok=True) == 1 and d.progressed("s1", ok=True) == 1
    got = dict(drain(d, workers, 0.04))
    assert got["s2"] != got["s3"]


def test_leader_end_releases_pinned_and_failure_releases_on_their_own() -> None:
    d = dispatcher()
    lead = d.submit(req(d, "lead", PREFIX + [1]), "", busy(), 0.0)
    assert lead is not None
    assert d.submit(req(d, "s1", PREFIX + [2]), "", busy(), 0.01) is None
    assert d.progressed("lead", ok=True) == 1
    assert d._ready[0].pin == lead.decision.worker_id
    d2 = dispatcher()
    lead2 = d2.submit(req(d2, "lead", PREFIX + [1]), "", busy(), 0.0)
    assert lead2 is not None
    assert d2.submit(req(d2, "s1", PREFIX + [2]), "", busy(), 0.01) is None
    assert d2.progressed("lead", ok=False) == 1
    assert d2._ready[0].pin is None
    assert d2.progressed("lead", ok=True) == 0  # already gone


def test_a_slow_leader_releases_its_followers_after_the_bound() -> None:
    d = dispatcher()
    assert d.submit(req(d, "lead", PREFIX + [1]), "", busy(), 0.0) is not None
    assert d.submit(req(d, "s1", PREFIX + [2]), "", busy(), 0.1) is None
    assert d.next_wakeup() == pytest.approx(WAIT)  # the group stops taking followers then
    assert d.tick(busy(), WAIT) == 0
    assert d.submit(req(d, "s2", PREFIX + [3]), "", busy(), WAIT) is not None  # closed: routed as usual
    assert d.next_wakeup() == pytest.approx(0.1 + WAIT)
    assert d.tick(busy(), 0.1 + WAIT - 1e-9) == 0
    assert d.tick(busy(), 0.1 + WAIT) == 1
    assert [r for r, _ in drain(d, busy(), 0.1 + WAIT)] == ["s1"] and d.held() == 0
    assert d.next_wakeup() == pytest.approx(2 * WAIT)  # s2 leads a group of its own: it closes then
    assert d.tick(busy(), 2 * WAIT) == 0 and d.next_wakeup() == float("inf")


def test_cancel_a_held_follower() -> None:
    d = dispatcher()
    assert d.submit(req(d, "lead", PREFIX + [1]), "", busy(), 0.0) is not None
    assert d.submit(req(d, "s1", PREFIX + [2]), "", busy(), 0.01) is None
    assert d.submit(req(d, "s2", PREFIX + [3]), "", busy(), 0.01) is None
    assert d.cancel("s1") and not d.cancel("s1")
    assert d.held() == 1
    assert d.progressed("lead", ok=True) == 1
    assert [r for r, _ in drain(d, busy(), 0.02)] == ["s2"]


def test_window_grows_with_load_and_its_leader_takes_the_group_along() -> None:
    d = dispatcher(window_ms=10.0)
    assert d.grouper is not None
    half = [worker("a", running=1, queued=64), worker("b", running=1)]  # one pass queued on one of two
    assert d.grouper.window(busy(), 0) == 0.0  # nothing queued: no window
    assert d.grouper.window(half, 0) == pytest.approx(0.005)
    assert d.grouper.window(half, -1) == pytest.approx(0.025)  # the batch tier
    assert d.submit(req(d, "lead", PREFIX + [1]), "", half, 0.0) is None  # waits its window
    assert d.submit(req(d, "s1", PREFIX + [2]), "", half, 0.001) is None
    assert d.held() == 2 and d.next_wakeup() == pytest.approx(0.005)
    assert d.tick(half, 0.005) == 1
    (lead_id, w), = drain(d, half, 0.005)
    assert lead_id == "lead" and d.held() == 1
    stored(d, w, PREFIX, 0)
    assert d.kv_stored(w) == 1
    assert drain(d, half, 0.01) == [("s1", w)]


def test_cancel_a_window_leader_lets_its_followers_go() -> None:
    d = dispatcher()
    half = [worker("a", running=1, queued=64), worker("b", running=1)]
    assert d.submit(req(d, "lead", PREFIX + [1]), "", half, 0.0) is None
    assert d.submit(req(d, "s1", PREFIX + [2]), "", half, 0.001) is None
    assert d.cancel("lead")
    assert [r for r, _ in drain(d, half, 0.002)] == ["s1"] and d.held() == 0


def test_coalesce_identical_short_prefills() -> None:
    d = dispatcher(enabled=False, coalesce=True)
    prompt = [5] * (2 * BS) + [1]  # 2 full blocks: below group_min_blocks, identical
    lead = d.submit(req(d, "lead", prompt), "", busy(), 0.0)
    assert lead is not None
    assert d.submit(req(d, "dup", prompt), "", busy(), 0.01) is None
    assert d.submit(req(d, "sib", [5] * (2 * BS) + [6] * BS), "", busy(), 0.01) is not None  # not identical
    assert d.progressed("lead", ok=True) == 1
    assert drain(d, busy(), 0.02) == [("dup", lead.decision.worker_id)]
    assert d.grouper is not None and (d.grouper.stats["followers"], d.grouper.stats["coalesced"]) == (1, 1)
    off = dispatcher(enabled=True, coalesce=False)
    assert off.submit(req(off, "lead", prompt), "", busy(), 0.0) is not None
    assert off.submit(req(off, "dup", prompt), "", busy(), 0.01) is not None  # too short to group


def test_grouping_knobs_act_or_are_rejected() -> None:
    with pytest.raises(ValidationError, match="window_max_ms acts only with scheduler.grouping.enabled"):
        GroupingConfig(window_max_ms=5)
    with pytest.raises(ValidationError, match="follower_max_wait_ms acts only"):
        GroupingConfig(follower_max_wait_ms=100)
    with pytest.raises(ValidationError, match="batch_window_max_ms"):
        GroupingConfig(enabled=True, window_max_ms=20, batch_window_max_ms=10)
    assert GroupingConfig(coalesce=True, follower_max_wait_ms=100).active
    assert not GroupingConfig().active
    assert Dispatcher(KvRouter(RoutingConfig(), KvIndex(1.0), random.Random(0)), BS).grouper is None


def test_a_worker_holding_more_of_the_prompt_wins_over_waiting_for_a_leader() -> None:
    d = dispatcher()
    lead = d.submit(req(d, "lead", PREFIX + [1] * BS), "", busy(), 0.0)
    assert lead is not None
    other = "b" if lead.decision.worker_id == "a" else "a"
    history = PREFIX + [2] * (2 * BS)
    stored(d, other, history, 0)  # the conversation's history, 6 blocks, on the other worker
    nxt = d.submit(req(d, "next-turn", history + [3] * BS), "", busy(), 0.01)
    assert nxt is not None and nxt.decision.worker_id == other  # not a follower: its cache is there
