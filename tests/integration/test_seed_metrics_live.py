"""The seed metrics on a live server after scripted traffic, values computed by hand (issue 13 item 1).

Two conversations of two turns each on two simulated workers (block size 64), prompts given as token
ids so their lengths are exact: each first turn is 200 tokens (3 full blocks, 192 tokens, stored), each
second turn is that prompt plus 100 new tokens. The second turns go back to their conversation's worker
and hit its 192 cached tokens:

- cache hit rate = 2 of 4 requests routed to a holder = 0.5;
- cache reuse rate = (0 + 0 + 192 + 192) / (200 + 200 + 300 + 300) = 0.384;
- recompute rate = 0 (no request prefilled what another worker held);
- decisions: 2 miss, 2 hit; per-worker and per-route-key TTFT counts add up to 4."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"


async def scrape(srv) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(f"{srv.base_url}/metrics") as r:
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_seed_metrics_after_two_conversations(server_factory):
    async with server_factory(execution_group={"nodes": [{"count": 2}]}, routing={"policy": "kv_aware", "seed": 7},
                              scheduler={"enabled": False}) as srv:
        first = {c: [1000 * (c + 1) + i for i in range(200)] for c in (0, 1)}
        workers = {}
        for c in (0, 1):
            r = await srv.client.completions.create(model=MODEL, prompt=first[c], max_tokens=4,
                                                    extra_body={"explain": True},
                                                    extra_headers={"x-thunderagent-route-key": f"team-{c}"})
            workers[c] = r.model_extra["thunderagent"]["worker"]
            assert r.usage.prompt_tokens == 200
        for c in (0, 1):
            prompt = first[c] + [50_000 + c * 1000 + i for i in range(100)]
            r = await srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                                    extra_body={"explain": True},
                                                    extra_headers={"x-thunderagent-route-key": f"team-{c}"})
            assert r.model_extra["thunderagent"]["worker"] == workers[c]
            assert r.usage.prompt_tokens_details.cached_tokens == 192
        m = await scrape(srv)
        assert m[("thunderagent_cache_hit_rate", ())] == 0.5
        assert m[("thunderagent_cache_reuse_rate", ())] == pytest.approx(0.384)
        assert m[("thunderagent_prefill_recompute_window_rate", ())] == 0.0
        assert m[("thunderagent_decisions_total", (("kind", "hit"),))] == 2
        assert m[("thunderagent_decisions_total", (("kind", "miss"),))] == 2
        assert m[("thunderagent_decisions_total", (("kind", "miss_balance"),))] == 0
        per_worker = sum(v for (name, labels), v in m.items() if name == "thunderagent_worker_ttft_seconds_count")
        assert per_worker == 4
        for c in (0, 1):
            assert m[("thunderagent_route_key_ttft_seconds_count", (("route_key", f"team-{c}"),))] == 2
            assert m[("thunderagent_route_key_itl_seconds_count", (("route_key", f"team-{c}"),))] == 6  # 2 x 3 gaps
        assert m[("thunderagent_hot_worker_queue_depth", ())] == 0.0  # all done: nothing waits
