"""Simulated engine against reference/dynamo-mocker.md (single-request table, packing, admission,
prefix cache, preemption) plus the engine protocol's lifecycle (abort, load, events, text)."""

from __future__ import annotations

import pytest

from support.engine_run import Run
from thunderagent.config import NodeConfig
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.engine.textgen import CorpusText
from thunderagent.engine.timing import PolynomialTiming
from thunderagent.kv.hashing import BASE_SEED, block_hashes, hash_block
from thunderagent.types import BlockStored, EngineRequest, TokenOutput

TIMING = PolynomialTiming()
TOTAL = 16384 * 64


def pf(t: int) -> float:
    return TIMING.prefill_ms(t)


def dec(a: int, total: int = TOTAL) -> float:
    return TIMING.decode_ms(a / total)


def trace_tokens(ids: list[int], length: int) -> list[int]:
    """Mocker token synthesis: ids interned in order of first appearance, 512 copies each."""
    dense: dict[int, int] = {}
    toks: list[int] = []
    for i in ids:
        toks += [dense.setdefault(i, len(dense))] * 512
    return toks[:length]


def mk(rid: str, tokens: list[int], max_tokens: int, *, ignore_eos: bool = True, priority: int = 0, bs: int = 64):
    return EngineRequest(rid, tokens, block_hashes(tokens, bs), BASE_SEED, max_tokens, ignore_eos, priority)


def engine(**node) -> SimulatedEngine:
    return SimulatedEngine("w0", NodeConfig(**node))


# ------------------------------------------------------------------------------ §6 single request
@pytest.mark.parametrize(
    ("inp", "out", "ttft", "e2e", "itl"),
    [
        (512, 1, 24.385704, 24.385704, None),
        (512, 100, 24.385704, 595.510770, 5.768940),
        (2048, 1, 49.362902, 49.362902, None),
        (2048, 100, 49.362902, 628.311004, 5.847961),
        (8192, 1, 169.136918, 169.136918, None),
        (8192, 100, 169.136918, 779.267802, 6.162938),
        (32768, 1, 676.547672, 676.547672, None),
        (32768, 100, 676.547672, 1409.659935, 7.405174),
    ],
)
def test_single_request_matches_mocker(inp: int, out: int, ttft: float, e2e: float, itl: float | None) -> None:
    r = Run(engine()).run([(0.0, mk("a", trace_tokens([1], inp) if inp <= 512 else [0] * inp, out))])
    outs = r.of("a")
    assert sum(len(o.token_ids) for o in outs) == out
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert r.ttft_ms("a") == pytest.approx(ttft, rel=1e-8)
    assert r.e2e_ms("a") == pytest.approx(e2e, rel=1e-8)
    if itl is not None:
        assert (r.e2e_ms("a") - r.ttft_ms("a")) / (out - 1) == pytest.approx(itl, abs=1e-6)


def test_first_decode_uses_sequence_length_513() -> None:
    r = Run(engine()).run([(0.0, mk("a", [7] * 512, 2))])
    assert r.passes[1].decode_kv_tokens == 513 and r.passes[1].prefill_tokens == 0
    assert (r.of("a")[1].time - r.of("a")[0].time) * 1e3 == pytest.approx(dec(513), abs=1e-6)


def test_prefill_joining_a_decoder_pays_sum() -> None:
    # a 512-token request decodes; a 2048-token prompt joins when a has length 527
    r = Run(engine())
    r.run([(0.0, mk("a", [1] * 512, 30))], until=0.0)
    t_join = None
    while True:  # step until a's sequence is 527 long (15 tokens out)
        w = r.eng.next_wakeup()
        r.outs += r.eng.advance(w)
        if len(r.of("a")) == 15:
            t_join = w
            break
    r.eng.add_request(mk("b", [2] * 2048, 1), t_join)
    end = r.eng.next_wakeup()
    p = r.eng.last_pass
    assert (p.prefill_tokens, p.decode_kv_tokens) == (2048, 527)
    assert (end - t_join) * 1e3 == pytest.approx(pf(2048) + dec(527), abs=1e-6)


# ------------------------------------------------------------------------------ §2.2 packing
def test_decode_tokens_take_budget_before_a_prompt_is_chunked() -> None:
    decoders = [(0.0, mk(f"d{i}", [100 + i] * 64, 50)) for i in range(10)]
    r = Run(engine()).run(decoders + [(0.001, mk("big", [3] * 8192, 1))])
    # pass 1: the ten 64-token prefills (big arrives during it); then 10 decodes + 8182, 10 + 10
    assert [(p.prefill_tokens, p.num_decodes) for p in r.passes[:3]] == [(640, 0), (8182, 10), (10, 10)]
    assert r.of("big")[0].time == pytest.approx(r.passes[2].end)


def test_three_4096_prompts_two_fit_the_first_pass() -> None:
    r = Run(engine()).run([(0.0, mk(f"p{i}", [i] * 4096, 2)) for i in range(3)])
    assert r.passes[0].prefill_tokens == 8192 and r.passes[0].num_prefills == 2
    assert r.passes[1].prefill_tokens == 4096 and r.passes[1].decode_kv_tokens == 2 * 4097
    assert r.ttft_ms("p0") == r.ttft_ms("p1") == pytest.approx(pf(8192), abs=1e-6)
    assert r.ttft_ms("p2") == pytest.approx(pf(8192) + pf(4096) + dec(2 * 4097), abs=1e-6)


def test_long_prompt_blocks_a_later_arrival_until_its_last_chunk() -> None:
    r = Run(engine()).run([(0.0, mk("long", [5] * 32768, 2)), (0.001, mk("short", [6] * 512, 1))])
    assert [p.prefill_tokens for p in r.passes[:5]] == [8192, 8192, 8192, 8192, 512]
    # (pass ends are whole nanoseconds: a few ns of rounding over several passes)
    assert r.ttft_ms("long") == pytest.approx(4 * pf(8192), abs=1e-5)
    assert r.ttft_ms("short", 0.001) == pytest.approx(4 * pf(8192) + pf(512) + dec(32769) - 1.0, abs=1e-5)


def test_without_chunked_prefill_a_prompt_waits_for_a_pass_it_fits() -> None:
    r = Run(engine(enable_chunked_prefill=False)).run([(0.0, mk("a", [1] * 4096, 2)), (0.0, mk("b", [2] * 5000, 1))])
    assert [(p.prefill_tokens, p.num_decodes) for p in r.passes[:2]] == [(4096, 0), (5000, 1)]


def test_max_num_seqs_limits_admission_and_priority_orders_the_queue() -> None:
    r = Run(engine(max_batch_size=1)).run(
        [
            (0.0, mk("first", [1] * 64, 3)),
            (0.001, mk("low", [2] * 64, 1, priority=0)),
            (0.002, mk("high", [3] * 64, 1, priority=5)),
        ]
    )
    assert r.of("first")[-1].time < r.of("high")[0].time < r.of("low")[0].time
    assert all(p.num_prefills + p.num_decodes == 1 for p in r.passes)


# ------------------------------------------------------------------------------ arrivals
def test_arrival_during_a_pass_joins_at_its_end() -> None:
    r = Run(engine()).run([(0.0, mk("a", [1] * 512, 2)), (0.010, mk("b", [2] * 512, 1))])
    assert r.ttft_ms("a") == pytest.approx(pf(512), abs=1e-6)
    assert r.ttft_ms("b") == pytest.approx(pf(512) + pf(512) + dec(513), abs=1e-6)


def test_arrival_at_the_same_instant_shares_the_pass() -> None:
    r = Run(engine()).run([(0.0, mk("a", [1] * 512, 1)), (0.0, mk("b", [2] * 512, 1))])
    assert r.passes[0].prefill_tokens == 1024
    assert r.ttft_ms("a") == r.ttft_ms("b") == pytest.approx(pf(1024), abs=1e-6)


def test_arrival_exactly_at_a_boundary_joins_the_pass_starting_then() -> None:
    eng = engine()
    eng.add_request(mk("a", [1] * 512, 2), 0.0)
    end1 = eng.next_wakeup()
    out = eng.advance(end1)
    assert [o.request_id for o in out] == ["a"]
    eng.add_request(mk("b", [2] * 512, 1), end1)  # after advance(end1), before next_wakeup()
    end2 = eng.next_wakeup()
    assert eng.last_pass.prefill_tokens == 512 and eng.last_pass.num_decodes == 1
    assert (end2 - end1) * 1e3 == pytest.approx(pf(512) + dec(513), abs=1e-6)
    # and an idle engine starts at the arrival, not at its last pass end
    eng.advance(end2)
    eng.add_request(mk("c", [3] * 64, 1), 5.0)
    assert eng.next_wakeup() == pytest.approx(5.0 + pf(64) / 1e3, abs=1e-9)


def test_advance_returns_only_passes_that_ended() -> None:
    eng = engine()
    eng.add_request(mk("a", [1] * 512, 3), 0.0)
    end = eng.next_wakeup()
    assert eng.advance(end - 1e-6) == []
    assert [o.time for o in eng.advance(end)] == [end]
    assert eng.advance(10.0)[-1].finish_reason == "length"  # two more passes run on their own
    assert eng.next_wakeup() is None


# ------------------------------------------------------------------------------ §2.3 admission
@pytest.mark.parametrize("blocks", [24, 25])
def test_admission_check(blocks: int) -> None:
    total = blocks * 64
    # 'hold' keeps 9 active blocks (520..559 tokens); 'big' needs 16
    r = Run(engine(kv_blocks=blocks)).run([(0.0, mk("hold", [1] * 520, 40)), (0.001, mk("big", [2] * 1024, 1))])
    if blocks == 24:  # 16 > 24 - 9: waits until 'hold' finishes
        assert r.of("big")[0].time == pytest.approx(r.of("hold")[-1].time + pf(1024) / 1e3, abs=1e-9)
    else:  # 16 <= 25 - 9: admitted in pass 2
        assert r.ttft_ms("big", 0.001) == pytest.approx(pf(520) + pf(1024) + dec(521, total) - 1.0, abs=1e-6)


def test_prompt_larger_than_the_pool_is_rejected() -> None:
    r = Run(engine(kv_blocks=4)).run([(0.0, mk("huge", [1] * 257, 5)), (0.0, mk("ok", [2] * 64, 1))])
    # rejected when the pass is packed, reported at that pass's end
    assert r.of("huge") == [TokenOutput("huge", [], r.passes[0].end, 257, 0, True, "abort")]
    assert r.passes[0].end == pytest.approx(pf(64) / 1e3, abs=1e-9)
    assert r.tokens("ok") and r.of("ok")[-1].finish_reason == "length"


def test_without_chunked_prefill_a_prompt_longer_than_a_pass_is_rejected() -> None:
    # 600 uncached prompt tokens never fit a 512-token pass without chunking: rejected at once (vLLM
    # refuses such a prompt when chunked prefill is off), not left at the head blocking 'short' for good
    eng = engine(enable_chunked_prefill=False, max_num_batched_tokens=512)
    r = Run(eng).run([(0.0, mk("long", [1] * 600, 3)), (0.0, mk("short", [2] * 64, 2))])
    assert r.of("long") == [TokenOutput("long", [], r.passes[0].end, 600, 0, True, "abort")]
    assert len(r.tokens("short")) == 2 and r.of("short")[-1].finish_reason == "length"
    # a prompt that fits a whole pass still waits for one, behind a prefill that took this one
    r = Run(engine(enable_chunked_prefill=False, max_num_batched_tokens=512)).run(
        [(0.0, mk("a", [3] * 500, 2)), (0.0, mk("b", [4] * 500, 2))])
    assert len(r.tokens("a")) == len(r.tokens("b")) == 2


def test_a_request_that_outgrows_the_pool_is_rejected_and_the_queue_behind_it_runs() -> None:
    # 'grow' fills the 4-block pool as it decodes; past 256 tokens it needs a 5th block: it preempts
    # itself, and the next pass rejects it. 'next' waits behind it and must then run (the pass that
    # only preempted used to idle the engine for good, stranding both)
    r = Run(engine(kv_blocks=4)).run([(0.0, mk("grow", [1] * 250, 20)), (0.0, mk("next", [2] * 64, 3))])
    grow = r.of("grow")
    assert grow[-1].finished and grow[-1].finish_reason == "abort"
    assert len(r.tokens("grow")) == 7  # tokens 251..257: the 257th needs a 5th block
    assert len(r.tokens("next")) == 3 and r.of("next")[-1].finish_reason == "length"
    assert r.of("next")[0].time > grow[-1].time - 1e-12
    assert r.eng.next_wakeup() is None and not r.eng.load(10.0).waiting


# ------------------------------------------------------------------------------ §2.4 prefix cache
def test_repeated_1024_prompt_reuses_960() -> None:
    toks = trace_tokens([1, 2], 1024)
    r = Run(engine()).run([(0.0, mk("a", toks, 1)), (1.0, mk("b", toks, 1))])
    assert r.of("a")[0].cached_tokens == 0
    assert r.of("b")[0].cached_tokens == 960
    assert r.ttft_ms("b", 1.0) == pytest.approx(pf(64), abs=1e-6)


@pytest.mark.parametrize(
    ("first", "second", "reused"),
    [
        (([1, 2], 700), ([1, 2], 800), 640),
        (([1, 2], 700), ([1, 2], 700), 640),
        (([1, 2], 1024), ([1, 3], 1024), 512),
    ],
)
def test_prefix_reuse_examples(first, second, reused: int) -> None:
    dense = {1: 1, 2: 2, 3: 3}  # same dense ids for both requests (one trace)
    t1 = [dense[i] for i in first[0] for _ in range(512)][: first[1]]
    t2 = [dense[i] for i in second[0] for _ in range(512)][: second[1]]
    r = Run(engine()).run([(0.0, mk("a", t1, 1)), (1.0, mk("b", t2, 1))])
    assert r.of("b")[0].cached_tokens == reused
    assert r.ttft_ms("b", 1.0) == pytest.approx(pf(second[1] - reused), abs=1e-6)


def test_same_pass_visibility() -> None:
    toks = trace_tokens([1, 2], 1024)
    r = Run(engine()).run([(0.0, mk("a", toks, 1)), (0.0, mk("b", toks, 1))])
    assert [r.of("a")[0].cached_tokens, r.of("b")[0].cached_tokens] == [0, 960]
    assert r.passes[0].prefill_tokens == 1088
    assert r.ttft_ms("a") == pytest.approx(pf(1088), abs=1e-6)


def test_generated_blocks_are_cached_and_announced() -> None:
    prompt = [9] * 64
    hashes = block_hashes(prompt, 64)
    for cache_generated in (True, False):
        eng = SimulatedEngine("w0", NodeConfig(), cache_generated=cache_generated)
        r = Run(eng).run([(0.0, mk("a", prompt, 70))])
        gen = r.tokens("a")
        ev = eng.drain_events()
        g_hash = hash_block(gen[:64], hashes[0])
        if cache_generated:
            assert ev == [BlockStored("w0", 0, (hashes[0],), None), BlockStored("w0", 1, (g_hash,), hashes[0])]
            assert sorted(eng.cache_snapshot()) == sorted([hashes[0], g_hash])
        else:
            assert ev == [BlockStored("w0", 0, (hashes[0],), None)]
            assert eng.cache_snapshot() == [hashes[0]]


def test_events_become_visible_at_pass_end() -> None:
    eng = engine()
    eng.add_request(mk("a", [4] * 200, 1), 0.0)
    end = eng.next_wakeup()
    assert eng.drain_events() == []
    eng.advance(end)
    assert eng.drain_events() == [BlockStored("w0", 0, tuple(block_hashes([4] * 200, 64)), None)]


def test_reset_drops_the_cache() -> None:
    eng = engine()
    r = Run(eng).run([(0.0, mk("a", [4] * 200, 1))])
    assert len(eng.cache_snapshot()) == 3
    eng.drain_events()
    eng.reset()
    ev = eng.drain_events()
    assert len(ev) == 1 and type(ev[0]).__name__ == "AllBlocksCleared" and ev[0].seq == 1
    assert eng.cache_snapshot() == []
    r.run([(1.0, mk("b", [4] * 200, 1))])
    assert r.of("b")[0].cached_tokens == 0


# ------------------------------------------------------------------------------ §2.5 preemption
def test_lifo_preemption_recomputes_and_keeps_the_text() -> None:
    bs = 16
    a = EngineRequest("a", [1] * 32, block_hashes([1] * 32, bs), BASE_SEED, 20, True)
    b = EngineRequest("b", [2] * 32, block_hashes([2] * 32, bs), BASE_SEED, 30, True)
    eng = SimulatedEngine("w0", NodeConfig(kv_blocks=6, block_size=bs))
    r = Run(eng).run([(0.0, a), (0.0, b)])
    assert eng.preemptions == 1
    assert len(r.tokens("a")) == 20 and len(r.tokens("b")) == 30
    # 'b' was preempted at length 49 (its third block cached, then evicted for 'a'): re-admitted
    # once 'a' finished, with its two prompt blocks still cached.
    assert r.of("b")[-1].cached_tokens == 32
    assert r.of("b")[17].time > r.of("a")[-1].time
    # the recompute pass emits nothing and charges no prefill; the next pass decodes length 49
    ref = Run(SimulatedEngine("w1", NodeConfig(kv_blocks=64, block_size=bs))).run(
        [(0.0, EngineRequest("b", [2] * 32, block_hashes([2] * 32, bs), BASE_SEED, 30, True))]
    )
    assert r.tokens("b") == ref.tokens("b")
    i = next(k for k, p in enumerate(r.passes) if p.start >= r.of("a")[-1].time - 1e-12)
    assert (r.passes[i].prefill_tokens, r.passes[i].num_decodes, r.passes[i].end) == (0, 0, r.passes[i].start)
    assert r.passes[i + 1].decode_kv_tokens == 49
    assert eng.blocks.active_blocks == 0


# ------------------------------------------------------------------------------ lifecycle
def test_abort_frees_blocks_and_reports_once() -> None:
    eng = engine()
    eng.add_request(mk("a", [1] * 512, 100), 0.0)
    eng.add_request(mk("w", [2] * 64, 5), 0.0)
    t = eng.next_wakeup()
    eng.advance(t)
    t = eng.next_wakeup()  # a decode pass is in flight
    assert eng.blocks.active_blocks == 9 + 2
    eng.abort("a", t - 1e-4)
    assert eng.blocks.active_blocks == 2
    assert eng.blocks.cached_blocks == 9  # its full blocks stay cached
    out = eng.advance(t)
    assert out[0] == TokenOutput("a", [], t - 1e-4, 512, 0, True, "abort")
    assert [o.request_id for o in out[1:]] == ["w"]  # a's token of that pass is dropped
    eng.abort("a", t)  # already finished: no-op
    eng.abort("nope", t)
    assert eng.advance(t) == []


def test_abort_waiting_and_buffered_requests() -> None:
    eng = engine(max_batch_size=1)
    eng.add_request(mk("a", [1] * 64, 3), 0.0)
    eng.add_request(mk("b", [2] * 64, 3), 0.0)
    end = eng.next_wakeup()
    eng.add_request(mk("c", [3] * 64, 3), end / 2)
    assert eng.load(end / 2).waiting == 2
    eng.abort("b", end / 2)
    eng.abort("c", end / 2)
    rep = eng.load(end / 2)
    assert (rep.running, rep.waiting, rep.queued_prefill_tokens) == (1, 0, 0)
    out = eng.advance(100.0)
    assert [(o.request_id, o.finish_reason) for o in out if o.finished] == [("b", "abort"), ("c", "abort"), ("a", "length")]


def test_load_report_values() -> None:
    eng = engine()
    eng.add_request(mk("a", [1] * 512, 10), 0.0)
    eng.add_request(mk("b", [2] * 10000, 5), 0.0)
    end = eng.next_wakeup()  # pass 1: a (512) + b's first chunk (7680)
    mid = eng.load(end / 2)
    assert (mid.running, mid.waiting, mid.queued_prefill_tokens, mid.decode_tokens) == (2, 0, 10000 - 7680, 0)
    assert (mid.kv_active_blocks, mid.kv_cached_blocks, mid.kv_total_blocks) == (8 + 120, 8 + 120, 16384)
    eng.add_request(mk("c", [3] * 300, 5), end / 2)
    rep = eng.load(end)
    assert (rep.running, rep.waiting, rep.queued_prefill_tokens, rep.decode_tokens) == (2, 1, 2320 + 300, 513)
    assert rep.time == end and rep.worker_id == "w0"
    assert rep.kv_usage == pytest.approx(128 / 16384)


def test_eos_natural_length_and_max_tokens() -> None:
    text = CorpusText()
    prompt = list(b"Tell me a story about a river.")
    r = Run(engine()).run([(0.0, mk("s", prompt, 1000, ignore_eos=False)), (0.0, mk("l", prompt, 10, ignore_eos=False))])
    s = r.of("s")
    n = len(r.tokens("s"))
    assert 16 <= n < 256
    assert s[-1].token_ids == [] and s[-1].finish_reason == "stop" and len(s) == n + 1  # EOS takes a pass
    assert r.tokens("l") == r.tokens("s")[:10] and r.of("l")[-1].finish_reason == "length"
    # natural length is 16 + seed % 240 with the seed derived from the prompt
    seed = hash_block(prompt, BASE_SEED)
    assert n == text.natural_length(seed) and bytes(r.tokens("s")).decode() == text.text(seed, n)
    assert len(Run(engine()).run([(0.0, mk("x", prompt, 300))]).tokens("x")) == 300  # ignore_eos


def test_text_is_deterministic_ascii_and_prompt_dependent() -> None:
    def text(prompt: list[int]) -> bytes:
        return bytes(Run(engine()).run([(0.0, mk("a", prompt, 200))]).tokens("a"))

    p1, p2 = list(b"Hello there, engine."), list(b"Something else entirely.")
    t1 = text(p1)
    assert t1 == text(p1)
    assert t1 != text(p2)
    s = t1.decode("ascii")
    assert all(c.isprintable() or c == "\n" for c in s)
    assert all(t < 256 for t in t1)


def test_zero_max_tokens_finishes_after_prefill() -> None:
    r = Run(engine()).run([(0.0, mk("z", [1] * 128, 0))])
    assert r.of("z") == [TokenOutput("z", [], pytest.approx(pf(128) / 1e3), 128, 0, True, "length")]


def test_bad_requests_are_refused() -> None:
    eng = engine()
    with pytest.raises(ValueError):
        eng.add_request(mk("e", [], 1), 0.0)
    with pytest.raises(ValueError):
        eng.add_request(EngineRequest("h", [1] * 128, [], BASE_SEED, 1), 0.0)
    eng.add_request(mk("d", [1] * 10, 1), 0.0)
    with pytest.raises(ValueError):
        eng.add_request(mk("d", [1] * 10, 1), 0.0)


@pytest.mark.parametrize("trial", range(6))
def test_random_pressure_keeps_invariants(trial: int) -> None:
    """Small pools, preemption storms, aborts, resets: every request finishes exactly once with the
    right token count, blocks all come back, and replaying the event stream gives the cache."""
    import random

    from thunderagent.types import BlockRemoved

    rng = random.Random(trial)
    bs = rng.choice([4, 16])
    node = NodeConfig(
        kv_blocks=rng.randint(14, 24), block_size=bs, max_batch_size=rng.randint(4, 12),
        max_num_batched_tokens=rng.randint(16, 512), enable_chunked_prefill=trial % 3 != 0,
    )  # fmt: skip
    eng = SimulatedEngine("w", node, cache_generated=trial % 2 == 0)
    reqs, t = [], 0.0
    for i in range(80):
        t += rng.expovariate(50)
        toks = [rng.randrange(3)] * rng.randint(1, 3 * bs) + [rng.randrange(3) for _ in range(rng.randint(0, 4 * bs))]
        reqs.append((t, mk(f"r{i}", toks, rng.randint(0, 40), ignore_eos=rng.random() < 0.5, bs=bs)))
    aborts = sorted((reqs[i][0] + rng.random() * 0.3, f"r{i}") for i in rng.sample(range(80), 8))
    outs: dict[str, list[TokenOutput]] = {}
    events = []
    i = j = 0
    now = 0.0
    while True:
        while i < len(reqs) and reqs[i][0] <= now:
            eng.add_request(reqs[i][1], reqs[i][0])
            i += 1
        while j < len(aborts) and aborts[j][0] <= now:
            eng.abort(aborts[j][1], aborts[j][0])
            j += 1
        for o in eng.advance(now):
            outs.setdefault(o.request_id, []).append(o)
        if rng.random() < 0.01:
            eng.reset()
        events += eng.drain_events()
        w = eng.next_wakeup()
        nxt = [x for x in (w, reqs[i][0] if i < len(reqs) else None, aborts[j][0] if j < len(aborts) else None) if x is not None]
        if not nxt:
            break
        now = min(nxt)
    assert eng.preemptions > 0 or trial % 3 == 0
    assert set(outs) == {r.request_id for _, r in reqs}
    for _, r in reqs:
        o = outs[r.request_id]
        assert o[-1].finished and not any(x.finished for x in o[:-1])
        n = sum(len(x.token_ids) for x in o)
        assert n == r.max_tokens if o[-1].finish_reason == "length" else n <= r.max_tokens
        assert [x.time for x in o] == sorted(x.time for x in o)
    rep = eng.load(now)
    assert (rep.running, rep.waiting, rep.queued_prefill_tokens, rep.decode_tokens, rep.kv_active_blocks) == (0, 0, 0, 0, 0)
    assert [e.seq for e in events] == list(range(len(events)))
    held: set[int] = set()
    for e in events:
        if isinstance(e, BlockStored):
            assert not held & set(e.block_hashes)
            held |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= held
            held -= set(e.block_hashes)
        else:
            held.clear()
    assert held == set(eng.cache_snapshot())


def test_running_requests_get_the_budget_in_priority_order() -> None:
    """vLLM's priority policy: a higher-priority request admitted later is served first in the next
    passes; with equal priorities admission order is kept (FCFS, as traces without priorities)."""

    def third_pass(p_b: int):
        eng = engine(max_num_batched_tokens=300, kv_blocks=1024)
        r = Run(eng).run([(0.0, mk("a", [1] * 256, 5)), (0.001, mk("b", [2] * 1024, 3, priority=p_b))], until=0.06)
        # pass 1: "a" alone prefills; pass 2: "a" decodes, "b" is admitted with the other 299 tokens
        assert (r.passes[0].scheduled_tokens, r.passes[0].num_prefills) == (256, 1)
        assert (r.passes[1].scheduled_tokens, r.passes[1].num_decodes, r.passes[1].num_prefills) == (300, 1, 1)
        return r.passes[2]

    fcfs = third_pass(0)
    assert (fcfs.scheduled_tokens, fcfs.num_decodes, fcfs.num_prefills) == (300, 1, 1)  # "a" first, as admitted
    prio = third_pass(1)
    # "b" (priority 1) takes the whole budget first: "a" waits a pass for its next token
    assert (prio.scheduled_tokens, prio.num_decodes, prio.num_prefills) == (300, 0, 1)
