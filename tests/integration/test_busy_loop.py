"""A frontend whose event loop is blocked longer than a lease keeps its workers and its index."""

from __future__ import annotations

import asyncio
import time

from support.waiting import wait_until

MODEL = "thunderagent-sim"


async def test_a_blocked_loop_marks_no_worker_unhealthy_and_purges_nothing(server_factory):
    # lease 0.5 s (0.1 x 5), stall check 8 s; the loop is blocked 1.5 s: three leases
    async with server_factory(execution_group={"nodes": [{"count": 2}]}) as srv:
        fleet = srv.fleet
        prompt = [{"role": "user", "content": "sticky prefix " * 40}]
        raw = await srv.client.chat.completions.with_raw_response.create(model=MODEL, messages=prompt, max_tokens=4)
        home = raw.headers["x-thunderagent-worker"]
        blocks = fleet.index.num_blocks(home)
        assert blocks > 0
        await asyncio.sleep(0.3)
        time.sleep(1.5)  # the whole frontend is busy: no heartbeat, no health tick runs meanwhile
        await asyncio.sleep(0.5)  # health ticks and heartbeats run late, then on time again
        assert fleet.loop_lag.max_lag > 1.0
        assert len(fleet.registry.routable()) == 2
        assert fleet.index.num_blocks(home) == blocks  # nothing purged
        assert fleet.metrics.lease_expired.labels(home)._value.get() == 0  # type: ignore[attr-defined]
        out = await srv.client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=4)
        assert out.choices[0].message.content
        # a worker that really stops heartbeating still leaves, within its lease of on-time seconds
        fleet.workers[home].heartbeats_paused = True  # type: ignore[attr-defined]
        await wait_until(lambda: home not in {w.worker_id for w in fleet.registry.routable()}, 5, f"{home} out")
        assert fleet.index.num_blocks(home) == 0
        assert fleet.metrics.lease_expired.labels(home)._value.get() == 1  # type: ignore[attr-defined]
