"""KV-event chaos on a live fleet (issue 11 item 5): events dropped, duplicated, reordered and
delayed between three simulated workers and the router (``kv/chaos.py`` wraps each worker's
``on_events``), one engine reset (its cache cleared) during the fault. Multi-turn conversations run
through it.

- **Convergence**: once the faults stop, within 1 s every worker's confirmed index entries equal its
  engine's cache exactly (gaps found by the next event's seq or by the heartbeat's ``kv_seq`` are
  resynced from the worker's dump; late duplicates are ignored).
- **Routing quality during the fault**: the share of prompt tokens served from cache under chaos with
  kv_aware is at least that of load-only routing (least_loaded) on the same conversations, measured in
  the same run."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import running_server
from thunderagent.assemble import build_fleet
from thunderagent.config import Config, Policy
from thunderagent.control.fleet import Fleet
from thunderagent.execution.handle import WorkerCallbacks
from thunderagent.frontend.tokenizer import ByteTokenizer
from thunderagent.kv.chaos import ChaosSpec, EventChaos
from integration.conftest import test_config as make_config

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

MODEL = "thunderagent-sim"
SPEC = ChaosSpec(drop=0.2, duplicate=0.1, reorder=0.1, delay=0.2, delay_s=0.3)
CONVERSATIONS, TURNS = 6, 4


def chaotic_fleet(cfg: Config, policy: Policy, seed: int) -> tuple[Fleet, dict[str, EventChaos], Counter[str]]:
    """The fleet ``serve`` builds, with every worker's event callback behind a chaos seam; counts the
    index resyncs the fleet asks for."""
    fleet = build_fleet(cfg, ByteTokenizer(), policy=policy)
    chaos: dict[str, EventChaos] = {}
    resyncs: Counter[str] = Counter()
    real = fleet.callbacks

    def callbacks() -> WorkerCallbacks:
        cb = real()

        def on_events(wid: str, events: list) -> None:
            seam = chaos.setdefault(wid, EventChaos(SPEC, random.Random(f"{seed}-{wid}")))
            delivered = seam.push(list(events), time.monotonic())
            if delivered:
                cb.on_events(wid, delivered)

        return WorkerCallbacks(on_events, cb.on_heartbeat, cb.on_load, cb.on_unavailable, cb.clock)

    fleet.callbacks = callbacks  # type: ignore[method-assign]
    resync = fleet.membership.resync

    def counted(wid: str) -> None:
        resyncs[wid] += 1
        resync(wid)

    fleet.membership.resync = counted  # type: ignore[method-assign]
    return fleet, chaos, resyncs


async def deliver_delayed(fleet: Fleet, chaos: dict[str, EventChaos], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for wid, seam in chaos.items():
            late = seam.due(time.monotonic())
            if late:
                fleet.on_events(wid, late)
        await asyncio.sleep(0.02)


def index_matches_engines(fleet: Fleet) -> bool:
    for wid, handle in fleet.workers.items():
        truth = set(handle.engine.cache_snapshot())  # type: ignore[attr-defined]
        if fleet.index.confirmed_blocks(wid) != truth:
            return False
    return True


async def run(policy: Policy, seed: int) -> tuple[float, float, dict[str, EventChaos], int]:
    """Conversations under chaos; returns (cached / prompt tokens during the fault, seconds to converge)."""
    cfg = make_config(execution_group={"nodes": [{"count": 3, "kv_blocks": 512, "block_size": 16}]},
                      scheduler={"enabled": False}, simulation={"speedup": 10.0})
    fleet, chaos, resyncs = chaotic_fleet(cfg, policy, seed)
    stop = asyncio.Event()
    async with running_server(cfg, fleet=fleet) as srv:
        pump = asyncio.create_task(deliver_delayed(fleet, chaos, stop))
        rng = random.Random(seed)
        totals = [0, 0]

        async def conversation(c: int) -> None:
            history = [rng.randrange(1, 50_000) for _ in range(rng.randrange(100, 300))]
            for turn in range(TURNS):
                r = await srv.client.completions.create(model=MODEL, prompt=history, max_tokens=8)
                totals[0] += r.usage.prompt_tokens
                totals[1] += r.usage.prompt_tokens_details.cached_tokens
                history = history + [rng.randrange(1, 50_000) for _ in range(rng.randrange(40, 120))]
                if c == 0 and turn == 1:
                    next(iter(fleet.workers.values())).engine.reset()  # type: ignore[attr-defined]

        await asyncio.gather(*(conversation(c) for c in range(CONVERSATIONS)))
        faults = sum(s.stats.dropped + s.stats.reordered + s.stats.delayed + s.stats.duplicated
                     for s in chaos.values())
        assert faults > 0, "the chaos seam injected nothing"
        for seam in chaos.values():
            seam.active = False  # the faults end here
        healed = time.monotonic()
        while not index_matches_engines(fleet):
            assert time.monotonic() - healed < 1.0, "the index did not converge within 1 s of the faults ending"
            await asyncio.sleep(0.01)
        converged = time.monotonic() - healed
        stop.set()
        await pump
        # every resync the fleet asked for is on /metrics, by cause
        async with aiohttp.ClientSession() as http, http.get(f"{srv.base_url}/metrics") as r:
            text = await r.text()
        counted = Counter()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "thunderagent_kv_resyncs_total":
                    counted[s.labels["worker"]] += int(s.value)
        assert counted == resyncs, (counted, resyncs)
    return totals[1] / totals[0], converged, chaos, sum(resyncs.values())


async def test_index_converges_and_routing_beats_load_only_under_event_chaos():
    reuse_kv, converged, chaos, resyncs = await run(Policy.kv_aware, seed=11)
    reuse_load, _, _, _ = await run(Policy.least_loaded, seed=11)
    dropped = sum(s.stats.dropped for s in chaos.values())
    print(f"\nchaos: {dropped} events dropped, {resyncs} resyncs; converged {converged * 1e3:.0f} ms after the faults ended; "
          f"reuse under chaos kv_aware {reuse_kv:.1%} vs least_loaded {reuse_load:.1%}")
    assert dropped > 0 and resyncs > 0  # the faults happened and were noticed
    assert reuse_kv >= reuse_load
