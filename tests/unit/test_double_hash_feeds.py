"""The double-hash guard (kv.check) on every path that stores blocks into the index: the simulated
engine's events and cache snapshot, vLLM / SGLang events through the translator (and its snapshot),
events and dumps over the NATS wire. Each forces primary collisions with an injected hash and
expects no false hit with the guard on, and the false hit with it off (so each test can fail)."""

from __future__ import annotations

from array import array

import pytest
import xxhash

from support.engine_run import Run
from thunderagent.bus import wire
from thunderagent.config import NodeConfig
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.execution import kv_translate
from thunderagent.execution.kv_frames import EngineBlockStored, EventBatch
from thunderagent.execution.kv_stream import KvEventStream
from thunderagent.kv.feed import KvFeed
from thunderagent.kv.hashing import BASE_SEED, block_hash_pairs
from thunderagent.kv.index import KvIndex
from thunderagent.types import BlockStored, EngineRequest, KvEvent, KvTransfer

BS = 4
P = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # three blocks
Q = [1, 2, 3, 4, 5, 99, 99, 99, 9, 10, 11, 12]  # same first block, then other content
#: a query for Q over an index holding P: block 0 is truly shared; blocks 1, 2 only collide
GUARD = [(True, {"w": 1}), (False, {"w": 3})]


def first_token_only(data: memoryview, seed: int) -> int:
    """A broken primary hash: it reads only a block's first token, so P's and Q's blocks collide."""
    return xxhash.xxh3_64_intdigest(data[:4], seed=seed)


def colliding_hash_block(tokens: list[int], parent: int) -> int:  # kv.hashing.hash_block, broken alike
    return first_token_only(memoryview(array("I", tokens).tobytes()), parent)


def pairs(tokens: list[int]) -> tuple[list[int], list[int]]:
    return block_hash_pairs(tokens, BS, primary=first_token_only)


def feed(guard: bool) -> KvFeed:
    f = KvFeed(KvIndex(prediction_ttl=10.0, double_hash=guard))
    f.add_worker("w", live=True)
    return f


def query_q(f: KvFeed) -> dict[str, int]:
    hq, cq = pairs(Q)
    return f.index.find_matches(hq, 1.0, cq)


def sim_engine_serving_p(guard: bool) -> tuple[SimulatedEngine, list[KvEvent]]:
    """A simulated engine that computed P, requested with the colliding primaries (and, guard on,
    the check hashes the frontend computed)."""
    hp, cp = pairs(P)
    eng = SimulatedEngine("w", NodeConfig(block_size=BS, kv_blocks=64))
    req = EngineRequest("p", list(P), hp, BASE_SEED, 1, ignore_eos=True, check_hashes=cp if guard else None)
    Run(eng).run([(0.0, req)])
    return eng, eng.drain_events()


@pytest.mark.parametrize(("guard", "expected"), GUARD)
def test_simulated_engine_events(guard: bool, expected: dict[str, int]) -> None:
    hp, cp = pairs(P)
    _, events = sim_engine_serving_p(guard)
    assert events == [BlockStored("w", 0, tuple(hp), None, tuple(cp) if guard else None)]
    f = feed(guard)
    f.events("w", events, 0.0)
    assert query_q(f) == expected
    assert f.index.find_matches(hp, 1.0, cp) == {"w": 3}  # P itself still hits in full


@pytest.mark.parametrize(("guard", "expected"), GUARD)
def test_simulated_engine_snapshot(guard: bool, expected: dict[str, int]) -> None:
    eng, _ = sim_engine_serving_p(guard)
    hp, cp = pairs(P)
    assert eng.cache_snapshot() == hp and eng.cache_checks() == (cp if guard else None)
    f = feed(guard)
    f.begin_sync("w")
    f.apply_dump("w", eng.cache_snapshot(), 0, 1.0, eng.cache_checks())
    assert query_q(f) == expected


def test_simulated_engine_checks_generated_blocks_as_the_next_turn_hashes_them() -> None:
    """Generated blocks extend the check chain over the same tokens the next turn's prompt holds."""
    prompt = [7] * 6
    h, c = block_hash_pairs(prompt, BS)
    eng = SimulatedEngine("w", NodeConfig(block_size=BS, kv_blocks=64))
    r = Run(eng).run([(0.0, EngineRequest("a", prompt, h, BASE_SEED, 9, ignore_eos=True, check_hashes=c))])
    h2, c2 = block_hash_pairs(prompt + r.tokens("a"), BS)
    stored = [e for e in eng.drain_events() if isinstance(e, BlockStored)]
    assert [x for e in stored for x in e.block_hashes] == h2[:3]  # the 16th token's KV is never computed
    assert [x for e in stored for x in e.check_hashes or ()] == c2[:3]


def translated_p(guard: bool, monkeypatch: pytest.MonkeyPatch) -> KvEventStream:
    """vLLM's BlockStored for P (engine hashes opaque, token ids carried), through a translator
    whose primary hash is broken like ``first_token_only``."""
    monkeypatch.setattr(kv_translate, "hash_block", colliding_hash_block)
    stream = KvEventStream("w", BS, can_replay=False, checks=guard)
    return stream


@pytest.mark.parametrize(("guard", "expected"), GUARD)
def test_vllm_events_through_the_translator(guard: bool, expected: dict[str, int],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    stream = translated_p(guard, monkeypatch)
    step = stream.on_live_batch(EventBatch(0, 0.0, [EngineBlockStored([b"a", b"b"], None, P[:8], BS),
                                                    EngineBlockStored([b"c"], b"b", P[8:], BS)]))
    hp, cp = pairs(P)
    assert [x for e in step.events for x in e.block_hashes] == hp  # the injection took: P collides with Q
    assert [x for e in step.events for x in e.check_hashes or ()] == (cp if guard else [])
    f = feed(guard)
    f.events("w", step.events, 0.0)
    assert query_q(f) == expected
    hashes, seq, checks = stream.snapshot()
    assert (sorted(hashes), seq, sorted(checks or [])) == (sorted(hp), 1, sorted(cp) if guard else [])
    f2 = feed(guard)
    f2.begin_sync("w")
    f2.apply_dump("w", hashes, seq, 1.0, checks)
    assert query_q(f2) == expected


def test_translator_without_checks_under_a_guarded_index_gives_no_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose translator sends no check hashes (its guard off) under a frontend with the
    guard on: its entries are unverified, so a checked query does not match through them at all."""
    stream = translated_p(False, monkeypatch)
    step = stream.on_live_batch(EventBatch(0, 0.0, [EngineBlockStored([b"a", b"b", b"c"], None, P, BS)]))
    f = feed(True)
    f.events("w", step.events, 0.0)
    assert query_q(f) == {}
    hp, cp = pairs(P)
    assert f.index.find_matches(hp, 1.0, cp) == {}  # even P: nothing vouches for the content
    assert f.index.find_matches(hp, 1.0) == {"w": 3}  # unchecked queries (scheduler estimates) still see it


@pytest.mark.parametrize(("guard", "expected"), GUARD)
def test_events_over_the_nats_wire(guard: bool, expected: dict[str, int]) -> None:
    _, events = sim_engine_serving_p(guard)
    batch = wire.decode_kv(wire.encode(wire.KvBatch("i", wire.events_to_wire(events))))
    got = wire.events_from_wire("w", batch.events)
    assert got == events
    f = feed(guard)
    f.events("w", got, 0.0)
    assert query_q(f) == expected


@pytest.mark.parametrize(("guard", "expected"), GUARD)
def test_dump_over_the_nats_wire(guard: bool, expected: dict[str, int]) -> None:
    eng, _ = sim_engine_serving_p(guard)
    chunks = wire.dump_chunks("i", eng.cache_snapshot(), 0, eng.cache_checks(), chunk=2)
    dump = wire.join_dump([wire.decode_dump_chunk(wire.encode(c)) for c in reversed(chunks)])
    assert dump.checks == eng.cache_checks()
    f = feed(guard)
    f.begin_sync("w")
    f.apply_dump("w", dump.hashes or [], dump.last_seq, 1.0, dump.checks)
    assert query_q(f) == expected


def test_wire_rejects_check_hashes_that_do_not_match_the_hashes() -> None:
    bad = wire.WireStored(0, wire.pack_u64([1, 2]), None, wire.pack_u64([3]))
    with pytest.raises(ValueError, match="2 hashes but 1 check hashes"):
        wire.events_from_wire("w", [bad])
    with pytest.raises(ValueError, match="2 hashes but 1 check hashes"):
        wire.dump_chunks("i", [1, 2], 0, [3])
    mixed = wire.dump_chunks("i", [1, 2], 0, [3, 4], chunk=1)
    assert wire.join_dump([mixed[0], wire.dump_chunks("i", [1, 2], 0, chunk=1)[1]]).checks is None


@pytest.mark.parametrize(("guard", "expected"), GUARD)
def test_simulated_kv_import_from_a_prefill_worker(guard: bool, expected: dict[str, int]) -> None:
    """A decode engine that takes P's KV from a transfer announces the imported blocks with the
    request's check hashes."""
    hp, cp = pairs(P)
    eng = SimulatedEngine("w", NodeConfig(block_size=BS, kv_blocks=64))
    req = EngineRequest("p", list(P), hp, BASE_SEED, 1, ignore_eos=True, check_hashes=cp if guard else None,
                        kv_from=KvTransfer("p0", 12, tuple(hp)))
    Run(eng).run([(0.0, req)])
    events = eng.drain_events()
    assert events[0] == BlockStored("w", 0, tuple(hp), None, tuple(cp) if guard else None)
    f = feed(guard)
    f.events("w", events, 0.0)
    assert query_q(f) == expected
