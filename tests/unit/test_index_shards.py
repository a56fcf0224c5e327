"""The sharded index's pure parts: who owns a worker (rendezvous), a released worker in the feed, and the
index's short-lived entries for what other frontends answered."""

from __future__ import annotations

from thunderagent.control.index_shards import owner
from thunderagent.kv.feed import KvFeed
from thunderagent.kv.index import KvIndex
from thunderagent.types import BlockStored

WORKERS = [f"w{i}" for i in range(200)]


def test_ownership_is_the_same_everywhere_and_a_leaving_frontend_moves_only_its_workers():
    three = ["fa", "fb", "fc"]
    assert [owner(w, three) for w in WORKERS] == [owner(w, list(reversed(three))) for w in WORKERS]
    shares = {f: sum(owner(w, three) == f for w in WORKERS) for f in three}
    assert all(40 <= n <= 95 for n in shares.values()), shares  # about a third each
    two = ["fa", "fc"]  # fb left: only its workers move
    for w in WORKERS:
        if owner(w, three) != "fb":
            assert owner(w, two) == owner(w, three)
    assert {owner(w, ["fa"]) for w in WORKERS} == {"fa"}


def test_a_released_worker_is_purged_and_its_events_and_heartbeats_ignored_until_claimed():
    index = KvIndex(prediction_ttl=10.0, double_hash=False)
    feed = KvFeed(index)
    feed.add_worker("w0", live=True)
    feed.events("w0", [BlockStored("w0", 0, (11, 12), None)], now=0.0)
    assert index.find_matches([11, 12], 0.0) == {"w0": 2}
    feed.release("w0")
    assert feed.is_remote("w0") and index.find_matches([11, 12], 0.0) == {} and index.num_blocks("w0") == 0
    assert feed.events("w0", [BlockStored("w0", 5, (13,), 12)], now=1.0) is False  # ignored, no gap
    assert feed.heartbeat("w0", 99) is False  # its sequence is another frontend's business
    assert feed.apply_dump("w0", [11], 5, now=1.0) is False and index.num_blocks("w0") == 0  # a late dump
    feed.claim("w0")
    assert not feed.is_remote("w0") and feed.is_syncing("w0")
    assert feed.apply_dump("w0", [11, 12], 7, now=2.0) is False
    assert index.find_matches([11, 12], 2.0) == {"w0": 2} and index.last_seq("w0") == 7


def test_short_entries_live_a_second_and_never_shorten_a_longer_prediction():
    index = KvIndex(prediction_ttl=10.0, double_hash=False)
    for w in ("w0", "w1"):
        index.add_worker(w)
    index.predict("w1", [1, 2, 3], now=0.0, short=True)  # another frontend said w1 holds 3 blocks
    index.predict("w0", [1, 2], now=0.0)  # our own routing sent 2 of them to w0 (10 s)
    index.predict("w0", [1, 2], now=0.5, short=True)  # an answer about w0 does not cut that to 1.5 s
    assert index.find_matches([1, 2, 3], 0.99) == {"w1": 3, "w0": 2}
    assert index.find_matches([1, 2, 3], 1.0) == {"w0": 2}  # w1's answer expired at 1 s
    assert index.find_matches([1, 2, 3], 9.99) == {"w0": 2}
    assert index.expire(2.0) == 3 and index.num_blocks("w1") == 0  # the short queue is swept on its own clock
    assert index.num_blocks("w0") == 2


def test_sharded_kv_events_have_a_subject_the_frontends_control_subscription_does_not_match():
    from thunderagent.bus.wire import Subjects

    s = Subjects("ta")
    assert s.worker_kv("w1", sharded=False) == "ta.worker.w1.kv"
    assert s.worker_kv("w1", sharded=True) == "ta.worker.w1.kv.s"
    assert s.parse_worker("ta.worker.w1.kv.s") == ("w1", "kv") == s.parse_worker("ta.worker.w1.kv")
    assert s.parse_worker("ta.worker.w1.kv.x") is None and s.parse_worker("ta.worker.w1.hb.s") is None
    # NATS: ``*`` is one token, ``>`` one or more: a replica frontend (``ta.worker.>``) hears both forms
    assert s.worker_control() == "ta.worker.*.*" and s.all_workers() == "ta.worker.>"


def test_with_events_on_their_own_subscription_a_lost_tail_is_judged_a_heartbeat_later():
    index = KvIndex(prediction_ttl=10.0, double_hash=False)
    feed = KvFeed(index)
    feed.lagged = True
    feed.add_worker("w0", live=True)
    feed.events("w0", [BlockStored("w0", 0, (1,), None)], now=0.0)
    assert feed.heartbeat("w0", 3) is False  # seq 1..3 may still be on their way
    assert feed.heartbeat("w0", 3) is False  # (the same heartbeat seen twice does not shift the window)
    feed.events("w0", [BlockStored("w0", 1, (2,), 1), BlockStored("w0", 2, (3,), 2), BlockStored("w0", 3, (4,), 3)],
                now=0.5)
    assert feed.heartbeat("w0", 5) is False  # the previous beat's 3 arrived
    assert feed.heartbeat("w0", 6) is True  # the previous beat's 5 did not, a beat later: lost


def test_a_held_request_is_routed_on_the_answers_it_got_long_after_they_expired():
    """The dispatcher re-enters a request's answers just before routing it (``IndexShards.reenter``): a request
    held in the queue for 10 s still goes to the worker another frontend said holds its prompt."""
    import random
    from types import SimpleNamespace

    from thunderagent.bus.wire import Subjects
    from thunderagent.config import RoutingConfig, SchedulerConfig
    from thunderagent.control.index_shards import IndexShards
    from thunderagent.router.router import KvRouter
    from thunderagent.scheduler.dispatch import Dispatcher
    from thunderagent.types import EngineRequest, LoadReport, WorkerState

    workers = [WorkerState(w, 16, 8192, 64, LoadReport(w, 0.0, 0, 0, q, 0, 0, 0, 1000), "both", 4)
               for w, q in (("w0", 0), ("w1", 16))]  # w1 a little busier: without its cache, w0 wins
    req = EngineRequest("r1", list(range(64)), [101, 102, 103, 104], 0, 4)

    def fleet(answers: list[tuple[str, int]] | None) -> tuple[KvIndex, Dispatcher, IndexShards]:
        index = KvIndex(prediction_ttl=60.0, double_hash=False)
        feed = KvFeed(index)
        for w in ("w0", "w1"):
            feed.add_worker(w, live=True)
        feed.release("w1")  # another frontend indexes w1
        shards = IndexShards(None, Subjects("ta"), "fa", 0.05)  # type: ignore[arg-type]  # (no bus needed here)
        shards._fleet = SimpleNamespace(index=index, feed=feed)  # type: ignore[assignment]  # noqa: SLF001
        d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16, SchedulerConfig(enabled=True))
        if answers is not None:
            shards._answers["r1"] = answers  # noqa: SLF001 - what the lookup at arrival (t=0) got
            d.before_route = shards.reenter
        return index, d, shards

    _, d, _ = fleet(None)
    assert d.dispatch(req, workers, now=10.0).decision.worker_id == "w0"  # nothing known of w1's cache
    _, d, _ = fleet([("w1", 4), ("w0", 3)])
    assert d.dispatch(req, workers, now=10.0).decision.worker_id == "w1"
    index, _, shards = fleet([("w1", 4), ("w0", 3)])
    shards.reenter(req, 20.0)
    assert index.find_matches(req.block_hashes, 20.5) == {"w1": 4}  # w0 is ours: its answer is not entered
    assert index.find_matches(req.block_hashes, 21.0) == {}  # fresh 1 s entries, gone again
