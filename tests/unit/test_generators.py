"""Synthetic workload generators (sim.generators): determinism and documented shapes."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest

from thunderagent.sim.bounds import reuse_bounds
from thunderagent.sim.generators import agent_programs, multi_turn_chat, rollout_groups, shared_prefix, zipf_prefix
from thunderagent.sim.traces import PAD_BASE, TraceRequest


def _common(reqs: list[TraceRequest]) -> None:
    assert reqs[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert len({r.request_id for r in reqs}) == len(reqs)
    assert len({r.pad_token for r in reqs}) == len(reqs) and min(r.pad_token for r in reqs) >= PAD_BASE
    for r in reqs[:50]:
        assert len(r.tokens()) == r.input_length
        assert math.ceil(r.input_length / r.trace_block_size) == len(r.block_ids)


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: shared_prefix(3, 500, (1, 200), 50, rate=2.0, seed=seed),
        lambda seed: multi_turn_chat(4, 3, seed=seed),
        lambda seed: agent_programs(3, 5, seed=seed),
        lambda seed: rollout_groups(3, 4, 3, seed=seed),
        lambda seed: zipf_prefix(8, 256, (1, 100), 50, rate=2.0, seed=seed),
    ],
)
def test_deterministic_for_a_seed(make) -> None:  # type: ignore[no-untyped-def]
    assert make(7) == make(7)
    assert make(7) != make(8)


def test_shared_prefix_shape() -> None:
    bs = 64
    reqs = shared_prefix(4, 1000, (10, 300), 2000, rate=5.0, output_tokens=(1, 50), seed=1, block_size=bs)
    _common(reqs)
    assert len(reqs) == 2000
    plen = 1024  # 1000 rounded up to whole 64-token blocks
    pblocks = plen // bs
    prefixes = {tuple(r.block_ids[:pblocks]) for r in reqs}
    assert len(prefixes) == 4  # one per group
    suffix_ids = [b for r in reqs for b in r.block_ids[pblocks:]]
    assert len(suffix_ids) == len(set(suffix_ids))  # suffixes unique
    assert not set(suffix_ids) & {b for p in prefixes for b in p}
    assert all(plen + 10 <= r.input_length <= plen + 300 for r in reqs)
    assert all(1 <= r.output_length <= 50 for r in reqs)
    assert all(r.session is None for r in reqs)
    # Poisson at 5 req/s: mean gap 0.2 s
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.1)
    # infinite-cache reuse: every request but the first of each group reuses exactly its prefix
    # (engine blocks = content blocks; the unique suffix is >= 1 token so the cap never bites)
    firsts: set[tuple[int, ...]] = set()
    expected = 0
    for r in reqs:
        key = tuple(r.block_ids[:pblocks])
        if key in firsts:
            expected += plen
        firsts.add(key)
    b = reuse_bounds(reqs, bs, 10**9)
    assert b.infinite_cache_reuse == expected / sum(r.input_length for r in reqs)


def test_zipf_prefix_shape() -> None:
    bs = 64
    reqs = zipf_prefix(64, 2000, (64, 512), 20000, rate=50.0, output_tokens=(1, 32), seed=3, block_size=bs)
    _common(reqs)
    plen = 2048  # 2000 rounded up to whole blocks
    pblocks = plen // bs
    by_prefix: dict[tuple[int, ...], set[str]] = defaultdict(set)
    for r in reqs:
        by_prefix[tuple(r.block_ids[:pblocks])].add(r.request_id.rsplit(":", 1)[1])
    # one prefix per popularity rank, named in the request id
    assert len(by_prefix) == 64 and all(len(ranks) == 1 for ranks in by_prefix.values())
    suffix_ids = [b for r in reqs for b in r.block_ids[pblocks:]]
    assert len(suffix_ids) == len(set(suffix_ids))  # suffixes unique
    assert all(plen + 64 <= r.input_length <= plen + 512 and 1 <= r.output_length <= 32 for r in reqs)
    counts = defaultdict(int)
    for r in reqs:
        counts[int(r.request_id.rsplit(":p", 1)[1])] += 1
    # Zipf(1.1) over 64: P(k) = (k+1)^-1.1 / H, H = 3.992: prefix 0 draws 25.0 %, prefix 1 11.7 %
    h = sum((k + 1) ** -1.1 for k in range(64))
    for k in (0, 1, 2, 10):
        assert counts[k] / len(reqs) == pytest.approx((k + 1) ** -1.1 / h, rel=0.1)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.02, rel=0.05)


def test_multi_turn_chat_shape() -> None:
    bs = 64
    reqs = multi_turn_chat(5, 4, system_tokens=100, user_tokens=(1, 300), output_tokens=(1, 300),
                           think_time_s=10.0, seed=3, block_size=bs)
    _common(reqs)
    assert len(reqs) == 20
    conv: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in reqs:
        conv[r.session].append(r)
    assert sorted(conv) == [f"chat-{c}" for c in range(5)]
    system = None
    for name, turns in conv.items():
        assert [t.request_id for t in turns] == [f"{name}:{k}" for k in range(4)]
        assert turns[0].think_s is None
        if system is None:
            system = turns[0].block_ids[:2]  # 100 tokens -> 2 blocks shared by all conversations
        assert turns[0].block_ids[:2] == system
        for prev, cur in zip(turns, turns[1:]):
            # next prompt = previous prompt + previous output + new user text, all whole blocks
            out_blocks = prev.output_length // bs
            assert prev.output_length % bs == 0 and cur.input_length % bs == 0
            assert cur.block_ids[: len(prev.block_ids)] == prev.block_ids
            new = cur.block_ids[len(prev.block_ids) :]
            assert len(new) > out_blocks
            assert cur.arrival_s == pytest.approx(prev.arrival_s + cur.think_s)
            assert cur.think_s >= 0


def test_agent_programs_shape() -> None:
    bs = 64
    reqs = agent_programs(6, 40, shared_tokens=4000, tool_pause_median_s=3.0, tool_pause_sigma=0.5, seed=5,
                          block_size=bs)
    _common(reqs)
    assert len(reqs) == 240
    progs: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in reqs:
        progs[r.session].append(r)
    assert sorted(progs) == sorted(f"program-{p}" for p in range(6))
    shared = reqs[0].block_ids[: 4032 // bs]  # 4000 rounded up to whole blocks
    for name, steps in progs.items():
        assert len(steps) == 40
        assert all(s.block_ids[: len(shared)] == shared for s in steps)  # common tool/system prompt
        for prev, cur in zip(steps, steps[1:]):
            assert cur.block_ids[: len(prev.block_ids)] == prev.block_ids  # growing context
            assert cur.input_length > prev.input_length + prev.output_length
            assert cur.arrival_s == pytest.approx(prev.arrival_s + cur.think_s)
        assert steps[-1].input_length > 40_000  # long contexts
    pauses = [r.think_s for r in reqs if r.think_s is not None]
    assert statistics.median(pauses) == pytest.approx(3.0, rel=0.2)
    b = reuse_bounds(reqs, bs, 10**9)
    assert b.infinite_cache_reuse > 0.9


def test_rollout_groups_shape() -> None:
    """Each group's programs start together on one prompt (the shared system prompt + the group's task),
    then grow apart; groups differ only in the system prompt."""
    bs = 64
    reqs = rollout_groups(5, 4, 3, group_rate=0.1, shared_tokens=1000, task_tokens=2048, seed=3, block_size=bs)
    _common(reqs)
    assert len(reqs) == 5 * 4 * 3
    progs: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in reqs:
        progs[r.session].append(r)
    assert sorted(progs) == sorted(f"rollout-{g}-{m}" for g in range(5) for m in range(4))
    shared = reqs[0].block_ids[:16]  # 1000 rounded up to 16 whole blocks
    firsts = {name: steps[0] for name, steps in progs.items()}
    for g in range(5):
        group = [firsts[f"rollout-{g}-{m}"] for m in range(4)]
        assert len({r.arrival_s for r in group}) == 1 and all(r.think_s is None for r in group)  # together
        assert all(r.block_ids == group[0].block_ids and r.input_length == 16 * bs + 2048 for r in group)
        assert group[0].block_ids[:16] == shared
        if g:  # another group's task: only the system prompt in common
            other = firsts[f"rollout-{g - 1}-0"].block_ids
            assert other[:16] == shared and not set(other[16:]) & set(group[0].block_ids[16:])
    arrivals = sorted({r.arrival_s for r in firsts.values()})
    assert len(arrivals) == 5 and arrivals[0] == 0.0
    for steps in progs.values():
        for prev, cur in zip(steps, steps[1:]):
            assert cur.block_ids[: len(prev.block_ids)] == prev.block_ids  # growing context
            assert cur.arrival_s == pytest.approx(prev.arrival_s + cur.think_s) and cur.think_s > 0
    seconds = [progs[f"rollout-0-{m}"][1].block_ids for m in range(4)]
    assert len({tuple(b) for b in seconds}) == 4  # after the first step, each program its own history
    with pytest.raises(ValueError):
        rollout_groups(2, 2, 2, group_rate=0.0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        shared_prefix(2, 100, 10, 5, rate=0.0)
    with pytest.raises(ValueError):
        shared_prefix(2, 100, (5, 1), 5, rate=1.0)
    with pytest.raises(ValueError):
        multi_turn_chat(2, 2, block_size=0)
    with pytest.raises(ValueError):
        agent_programs(2, 2, tool_pause_median_s=0.0)
    with pytest.raises(ValueError):
        zipf_prefix(0, 100, 10, 5, rate=1.0)
    with pytest.raises(ValueError):
        zipf_prefix(4, 100, 10, 5, rate=1.0, alpha=-1.0)
