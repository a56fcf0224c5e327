"""The double-hash guard (kv.check): forced primary collisions never produce a false hit with the
guard on, and do with it off. Exact expectations only."""

from __future__ import annotations

import random

import pytest
import xxhash

from thunderagent.config import RoutingConfig
from thunderagent.kv.check import CONFLICT, CheckMap
from thunderagent.kv.hashing import BASE_SEED, block_hash_pairs, block_hashes, check_block, check_seed
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.types import BlockRemoved, BlockStored, LoadReport, RouteRequest, WorkerState

BS = 4
TTL = 10.0
P = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # three blocks
Q = [1, 2, 3, 4, 5, 99, 99, 99, 9, 10, 11, 12]  # same first block, then other content


def first_token_only(data: memoryview, seed: int) -> int:
    """A broken primary hash: it reads only the first token of a block, so P and Q collide on every
    block (their blocks start with the same token)."""
    return xxhash.xxh3_64_intdigest(data[:4], seed=seed)


def pairs(tokens: list[int]) -> tuple[list[int], list[int]]:
    return block_hash_pairs(tokens, BS, primary=first_token_only)


def make(double_hash: bool, *workers: str) -> KvIndex:
    idx = KvIndex(prediction_ttl=TTL, double_hash=double_hash)
    for w in workers:
        idx.add_worker(w)
    return idx


def test_injected_hash_collides_and_checks_do_not() -> None:
    (hp, cp), (hq, cq) = pairs(P), pairs(Q)
    assert hp == hq  # every primary collides
    assert cp[0] == cq[0] and cp[1] != cq[1] and cp[2] != cq[2]  # checks tell blocks 1, 2 apart


def test_pairs_match_block_hashes_and_chain_like_check_block() -> None:
    h, c = block_hash_pairs(P, BS, 7)
    assert h == block_hashes(P, BS, 7)
    assert c[0] == check_block(P[:4], check_seed(7)) and c[1] == check_block(P[4:8], c[0])
    assert block_hash_pairs(P[:3], BS) == ([], [])
    with pytest.raises(ValueError, match="block_size"):
        block_hash_pairs(P, 0)


@pytest.mark.parametrize(("double_hash", "expected"), [(True, {"a": 1}), (False, {"a": 3})])
def test_predicted_collision(double_hash: bool, expected: dict[str, int]) -> None:
    idx = make(double_hash, "a")
    (hp, cp), (hq, cq) = pairs(P), pairs(Q)
    idx.predict("a", hp, 0.0, cp)
    assert idx.find_matches(hq, 1.0, cq) == expected  # off: Q's blocks 1, 2 are a false hit
    assert idx.find_matches(hp, 1.0, cp) == {"a": 3}


@pytest.mark.parametrize(("double_hash", "expected"), [(True, {"b": 1}), (False, {"b": 3})])
def test_event_fed_collision(double_hash: bool, expected: dict[str, int]) -> None:
    idx = make(double_hash, "b")
    (hp, cp), (hq, cq) = pairs(P), pairs(Q)
    idx.apply_event(BlockStored("b", 0, tuple(hp), None, tuple(cp)), 0.0)
    assert idx.find_matches(hq, 1.0, cq) == expected
    assert idx.find_matches(hp, 1.0, cp) == {"b": 3}


def test_two_contents_under_one_primary_poison_it_until_its_last_entry_goes() -> None:
    idx = make(True, "a", "b")
    (hp, cp), (hq, cq) = pairs(P), pairs(Q)
    idx.predict("a", hp, 0.0, cp)
    idx.apply_event(BlockStored("b", 0, tuple(hq), None, tuple(cq)), 0.0)
    checks = idx.checks
    assert checks is not None
    assert [checks.get(h) for h in hp] == [cp[0], CONFLICT, CONFLICT]
    # Neither content matches past block 0 while both are indexed: a collision costs a miss.
    assert idx.find_matches(hp, 1.0, cp) == {"a": 1, "b": 1}
    assert idx.find_matches(hq, 1.0, cq) == {"a": 1, "b": 1}
    idx.apply_event(BlockRemoved("b", 1, (hq[2],)), 1.0)
    assert checks.get(hp[2]) == CONFLICT  # "a" still has an entry of that primary
    idx.expire(TTL)  # "a"'s predictions go: hp[2] has no entry left, its binding goes with it
    assert checks.get(hp[2]) is None and checks.get(hp[1]) == CONFLICT  # "b" still holds hq[1]
    assert idx.remove_worker("b") == 2
    assert len(checks) == 0
    idx.predict("a", hp, 20.0, cp)  # a fresh binding: P matches again
    assert idx.find_matches(hp, 21.0, cp) == {"a": 3}


@pytest.mark.parametrize(("double_hash", "expected"), [(True, {}), (False, {"c": 3})])
def test_unverified_dump_never_gives_a_checked_hit(double_hash: bool, expected: dict[str, int]) -> None:
    """A dump without check hashes holds Q's content under P's primaries: with the guard on its
    entries are unverified and a checked query does not match through them."""
    idx = make(double_hash, "c")
    (hp, cp), (hq, _) = pairs(P), pairs(Q)
    idx.resync("c", hq, 0)
    assert idx.find_matches(hp, 1.0, cp) == expected
    assert idx.match_levels(hp, 1.0, cp) == ([] if double_hash else [(3, idx.bit_of("c"))])
    assert idx.find_matches(hp, 1.0) == {"c": 3}  # a query without checks is not verified


def test_unverified_entries_cut_only_their_worker_and_leave_with_it() -> None:
    idx = make(True, "a", "c")
    (hp, cp), (hq, _) = pairs(P), pairs(Q)
    idx.apply_event(BlockStored("a", 0, tuple(hp), None, tuple(cp)), 0.0)  # "a": P, verified
    idx.apply_event(BlockStored("c", 0, tuple(hq)), 0.0)  # "c": Q under the same primaries, unverified
    checks, c = idx.checks, idx.bit_of("c")
    assert checks is not None and checks.unverified == {c: set(hq)}
    assert idx.find_matches(hp, 1.0, cp) == {"a": 3}  # "c" ends before its unverified block 0
    assert idx.match_levels(hp, 1.0, cp) == [(3, idx.bit_of("a"))]
    idx.apply_event(BlockStored("c", 1, tuple(hp[:1]), None, tuple(cp[:1])), 0.0)  # block 0 (shared) verified
    assert checks.unverified == {c: set(hq[1:])}
    assert idx.find_matches(hp, 1.0, cp) == {"a": 3, "c": 1}
    assert idx.match_levels(hp, 1.0, cp) == [(1, c), (3, idx.bit_of("a"))]
    assert idx.report_missing("c", [hq[1]]) == 1 and checks.unverified == {c: {hq[2]}}
    assert idx.report_missing("c", [hq[2]]) == 1 and checks.unverified == {}
    idx.apply_event(BlockStored("c", 2, tuple(hq[1:])), 0.0)
    assert idx.remove_worker("c") == 3 and checks.unverified == {}


def test_guard_off_ignores_check_hashes() -> None:
    idx = make(False, "a")
    hp, cp = pairs(P)
    idx.predict("a", hp, 0.0, cp)
    assert idx.checks is None
    assert idx.find_matches(hp, 1.0, [0, 0, 0]) == {"a": 3}


def test_check_map_rejects_length_mismatch() -> None:
    m = CheckMap()
    with pytest.raises(ValueError, match="2 block hashes but 1 check hashes"):
        m.bind([1, 2], [3])
    with pytest.raises(ValueError, match="1 block hashes but 0 check hashes"):
        m.verified_prefix([1], [], 1)


def _router(double_hash: bool) -> tuple[KvRouter, KvIndex, list[WorkerState]]:
    idx = make(double_hash, "a", "b")
    cfg = RoutingConfig(double_hash=double_hash)
    workers = [WorkerState(w, BS, 1024, 8, LoadReport(w, 0.0, 0, 0, 0, 0, 0, 0, 1000)) for w in ("a", "b")]
    return KvRouter(cfg, idx, random.Random(0)), idx, workers


@pytest.mark.parametrize(("double_hash", "overlap"), [(True, 1), (False, 3)])
def test_router_scores_a_colliding_prompt_by_its_verified_overlap(double_hash: bool, overlap: int) -> None:
    router, idx, workers = _router(double_hash)
    (hp, cp), (hq, cq) = pairs(P), pairs(Q)
    idx.apply_event(BlockStored("b", 0, tuple(hp), None, tuple(cp)), 0.0)
    d = router.route(RouteRequest("q", len(Q), hq, 0, cq if double_hash else None), workers, 1.0)
    assert d.worker_id == "b" and d.overlap_blocks == overlap


def test_dispatcher_hashes_checks_only_with_the_guard_on() -> None:
    for double_hash in (True, False):
        router, idx, _ = _router(double_hash)
        req = Dispatcher(router, BS).prepare("r", P, 4)
        assert req.block_hashes == block_hashes(P, BS, BASE_SEED)
        assert req.check_hashes == (block_hash_pairs(P, BS)[1] if double_hash else None)


def test_double_hash_is_on_by_default() -> None:
    assert RoutingConfig().double_hash is True
