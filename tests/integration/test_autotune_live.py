"""routing.autotune on a live server with simulated workers: finished requests reach the tuner, its
trial shows in /health, the weights in use as thunderagent_autotune_weight{name}."""

from __future__ import annotations

import aiohttp
import pytest

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"


async def test_autotune_live(server_factory):
    routing = {"autotune": {"enabled": True, "window": 4, "min_samples": 2, "switch_every": 2,
                            "params": ["credit_load_scale"]}}
    async with server_factory(execution_group={"nodes": [{"count": 2}]}, routing=routing) as srv:
        for i in range(6):
            await srv.client.completions.create(model=MODEL, prompt=[1000 + i * 100 + k for k in range(64)],
                                                max_tokens=2)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{srv.base_url}/health") as r:
                tune = (await r.json())["autotune"]
            async with http.get(f"{srv.base_url}/metrics") as r:
                metrics = await r.text()
    assert tune["start"] == {"credit_load_scale": 4.0}
    assert tune["samples"] == 5  # the first finished request started the trial
    assert tune["steps"][0]["action"] == "try" and tune["steps"][0]["new"] == 32.0  # x8, the first step
    assert tune["step"] == 8.0 and tune["resting"] == 0
    in_use = tune["weights"]["credit_load_scale"]
    assert f'thunderagent_autotune_weight{{name="credit_load_scale"}} {in_use}' in metrics
