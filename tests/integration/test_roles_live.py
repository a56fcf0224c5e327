"""Roles act in the live server: a role prefill worker never serves a request end to end (until the
live prefill/decode flow runs plans on workers, it gets nothing)."""

from __future__ import annotations

from collections import Counter

import pytest

pytestmark = pytest.mark.integration


async def test_prefill_workers_never_serve_end_to_end(server_factory):
    nodes = [{"role": "prefill", "count": 1, "kv_cache_transfer": {"enabled": True}},
             {"role": "decode", "count": 2}]
    async with server_factory(execution_group={"nodes": nodes}) as srv:
        seen = Counter()
        for k in range(12):
            raw = await srv.client.chat.completions.with_raw_response.create(
                model="thunderagent-sim", messages=[{"role": "user", "content": f"request {k} " + "word " * 200}],
                max_tokens=4)
            raw.parse()
            seen[raw.headers["x-thunderagent-worker"]] += 1
    assert set(seen) == {"worker-1", "worker-2"}, seen  # worker-0 is the prefill group's
