"""Accounting mode (the simulator's replays) against the live engine: same first tokens, finishes,
inter-token latencies, KV events, loads and counters, on random workloads with shared prefixes,
chunked prefill, evictions, LIFO preemption, EOS stops and aborts. Accounting mode skips the ends
of plain decode passes (engine/stretch.py) and hands out no per-token outputs (engine/pass_end.py);
nothing a driver can observe may differ."""

from __future__ import annotations

import random

import pytest

from thunderagent.config import NodeConfig
from thunderagent.engine.accounting import TokenAccounting
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.kv.hashing import BASE_SEED, block_hashes
from thunderagent.sim.results import Dist
from thunderagent.types import EngineRequest, TokenOutput

BS = 16


def _workload(seed: int) -> tuple[list[tuple[float, EngineRequest]], list[tuple[float, str]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(BS, 6 * BS))] for _ in range(4)]
    arrivals, t = [], 0.0
    for k in range(60):
        t += rng.choice([0.0, rng.expovariate(40.0)])  # some arrive at the same instant
        toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 4 * BS))]
        req = EngineRequest(f"r{k}", toks, block_hashes(toks, BS), BASE_SEED, rng.randrange(0, 120),
                            ignore_eos=rng.random() < 0.8)
        arrivals.append((round(t, 6), req))
    aborts = [(round(rng.uniform(0, t + 1), 6), f"r{rng.randrange(60)}") for _ in range(5)]
    return arrivals, aborts


def _run(node: NodeConfig, arrivals: list[tuple[float, EngineRequest]], aborts: list[tuple[float, str]],
         acct: TokenAccounting | None) -> dict[str, object]:
    eng = SimulatedEngine("w", node, accounting=acct)
    todo = sorted([(t, 0, r) for t, r in arrivals] + [(t, 1, r) for t, r in aborts], key=lambda x: (x[0], x[1]))
    outs: list[TokenOutput] = []
    events, loads = [], []
    i, now = 0, 0.0
    while True:
        while i < len(todo) and todo[i][0] <= now:
            t, kind, x = todo[i]
            loads.append(eng.load(t))
            if kind == 0:
                eng.add_request(x, t)
            else:
                eng.abort(x, t)
            i += 1
        outs += eng.advance(now)
        events += eng.drain_events()
        w = eng.next_wakeup()
        nxt = [x for x in (w, todo[i][0] if i < len(todo) else None) if x is not None]
        if not nxt:
            break
        now = min(nxt)
    firsts, finals, itl, last = {}, {}, [], {}
    for o in outs:
        if o.token_ids and o.request_id not in firsts:
            firsts[o.request_id] = o.time
        elif o.token_ids:
            itl.append((o.time - last[o.request_id]) * 1e3)
        if o.token_ids:
            last[o.request_id] = o.time
        if o.finished:
            finals[o.request_id] = (o.time, o.finish_reason, o.cached_tokens)
    counted = {rid: (sum(len(o.token_ids) for o in outs if o.request_id == rid), last.get(rid, -1.0))
               for rid in finals}
    return {"firsts": firsts, "finals": finals, "itl": itl, "counted": counted, "events": events, "loads": loads,
            "busy": eng.busy_ns, "prefill": eng.prefill_tokens, "preemptions": eng.preemptions}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("chunked", [True, False])
def test_accounting_mode_matches_the_live_engine(seed: int, chunked: bool) -> None:
    node = NodeConfig(kv_blocks=48, block_size=BS, max_num_batched_tokens=96, max_batch_size=8,
                      enable_chunked_prefill=chunked)
    arrivals, aborts = _workload(seed)
    live = _run(node, arrivals, aborts, None)
    acct = TokenAccounting()
    counted = _run(node, arrivals, aborts, acct)
    for key in ("firsts", "finals", "events", "loads", "busy", "prefill", "preemptions"):
        assert counted[key] == live[key], key
    # the tokens between first and last are counted, with the very latencies a driver would compute
    assert Dist.of_counts(acct.itl) == Dist.of(live["itl"])  # type: ignore[arg-type]
    assert sum(acct.itl.values()) == len(live["itl"])  # type: ignore[arg-type]
    expected = {r: c for r, c in live["counted"].items() if c[0]}  # type: ignore[union-attr]
    assert {r: c for r, c in acct.finals.items() if c[0]} == expected


def test_plain_stretches_skip_pass_ends() -> None:
    """Four long decoders and nothing else: the replay engine wakes its driver far less often."""
    node = NodeConfig(kv_blocks=4096, block_size=64)
    wakes = {}
    for mode in (None, TokenAccounting()):
        eng = SimulatedEngine("w", node, accounting=mode)
        for k in range(4):
            toks = list(range(k * 1000, k * 1000 + 100 + k))
            eng.add_request(EngineRequest(f"r{k}", toks, block_hashes(toks, 64), BASE_SEED, 500, True), 0.0)
        n, w = 0, eng.next_wakeup()
        while w is not None:
            eng.advance(w)
            n += 1
            w = eng.next_wakeup()
        wakes[mode is None] = n
    assert wakes[True] == 500  # one pass per token (the first one ends the prefill)
    assert wakes[False] < 60  # about two per block boundary crossed, one per finish
