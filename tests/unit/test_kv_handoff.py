"""The simulated engine's prefill/decode handoff: remote_decode jobs and kv_from admissions."""

from __future__ import annotations

import pytest

from support.engine_run import Run
from thunderagent.config import NodeConfig
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.engine.timing import PolynomialTiming
from thunderagent.kv.hashing import BASE_SEED, block_hashes
from thunderagent.types import BlockStored, EngineRequest, FinishReason, KvTransfer

TIMING = PolynomialTiming()
PROMPT = list(range(1000, 1200))  # 200 tokens: 3 full blocks of 64


def mk(rid: str, tokens: list[int], max_tokens: int, **kw: object) -> EngineRequest:
    return EngineRequest(rid, tokens, block_hashes(tokens, 64), BASE_SEED, max_tokens, True, **kw)


def test_remote_decode_finishes_after_one_token_with_the_prompts_full_blocks():
    eng = SimulatedEngine("p0", NodeConfig())
    eng.pin_transfers = True  # as the simulator drives it: the transfer moves on its clock
    job = mk("j", PROMPT, 50, remote_decode=True)
    run = Run(eng).run([(0.0, job)])
    outs = run.of("j")
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason is FinishReason.LENGTH
    assert len(outs[0].token_ids) == 1
    assert outs[0].time == pytest.approx(TIMING.prefill_ms(200) / 1e3)
    kv = outs[0].kv_transfer
    assert kv == KvTransfer("p0", 192, tuple(block_hashes(PROMPT, 64)))
    # held for the decode side until the transfer ends, then cached (evictable) like any prefix
    assert eng.blocks.active_blocks == 3 and eng.pinned_transfers == 1
    assert eng.release_transfer("j") and not eng.release_transfer("j")
    assert eng.blocks.active_blocks == 0 and eng.blocks.cached_blocks == 3


def test_served_live_the_prefill_side_pins_nothing():
    """Live (serve, NATS workers), nobody would unpin: the blocks stay cached, evictable."""
    eng = SimulatedEngine("p0", NodeConfig())
    outs = Run(eng).run([(0.0, mk("j", PROMPT, 50, remote_decode=True))]).of("j")
    assert outs[0].kv_transfer == KvTransfer("p0", 192, tuple(block_hashes(PROMPT, 64)))
    assert eng.blocks.active_blocks == 0 and eng.blocks.cached_blocks == 3 and eng.pinned_transfers == 0


def test_kv_from_counts_the_moved_blocks_as_cached_and_pays_one_pass_for_the_rest():
    eng = SimulatedEngine("d0", NodeConfig())
    kv = KvTransfer("p0", 192, tuple(block_hashes(PROMPT, 64)))
    run = Run(eng).run([(1.0, mk("r", PROMPT, 3, kv_from=kv))])
    outs = run.of("r")
    assert [len(o.token_ids) for o in outs] == [1, 1, 1]
    assert outs[0].cached_tokens == 192
    assert outs[0].time - 1.0 == pytest.approx(TIMING.prefill_ms(8) / 1e3)  # 8 tokens past the last full block
    assert eng.prefill_tokens == 8 and eng.kv_imported_blocks == 3
    stored = [e for e in eng.drain_events() if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == kv.block_hashes  # the index learns the moved blocks are here


def test_kv_from_imports_only_the_blocks_the_cache_lacks():
    eng = SimulatedEngine("d0", NodeConfig())
    kv = KvTransfer("p0", 192, tuple(block_hashes(PROMPT, 64)))
    Run(eng).run([(0.0, mk("a", PROMPT[:130], 1)), (5.0, mk("r", PROMPT, 1, kv_from=kv))])
    assert eng.kv_imported_blocks == 1  # blocks 0-1 were cached by "a"


def test_kv_from_without_room_computes_the_prompt():
    eng = SimulatedEngine("d0", NodeConfig(kv_blocks=5))
    kv = KvTransfer("p0", 192, tuple(block_hashes(PROMPT, 64)))
    hog = mk("hog", list(range(5000, 5150)), 3)  # 3 blocks while it runs
    run = Run(eng).run([(0.0, hog), (0.001, mk("r", PROMPT, 1, kv_from=kv))])
    assert eng.kv_import_failed == 1
    assert run.of("r")[-1].finished and run.of("r")[-1].cached_tokens == 0
