"""The scaling planner on a live server with simulated workers (issue 13 item 5): overloaded, it
says +1 with a reason, calls the operator's command and webhook (a tiny local HTTP server here),
and shows it at ``GET /v1/planner`` and as a metric; idle again, after the cooldown, it says -1."""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from support.fake_k8s import FakeKube

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
_RECORD = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + '\\n')"


async def wait_for(cond, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.05)


async def test_planner_overload_then_idle(server_factory, tmp_path):
    posts: list[dict] = []

    async def hook(request: web.Request) -> web.Response:
        posts.append(await request.json())
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/scale", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    calls = tmp_path / "calls.txt"
    kube = await FakeKube(token="t0ken", replicas={("fleet", "vllm"): 2}).start()  # the API server, faked
    (tmp_path / "token").write_text("t0ken")
    planner = {"enabled": True, "interval_s": 0.1, "window_s": 1.0, "cooldown_s": 1.5, "max_workers": 4,
               "up_ttft_s": 0.05, "down_ttft_s": 0.02, "command": [sys.executable, "-c", _RECORD, str(calls)],
               "webhook_url": f"http://127.0.0.1:{port}/scale", "action_timeout_s": 5.0,
               "kubernetes": {"deployments": {"both": "vllm"}, "namespace": "fleet", "api_url": kube.url,
                              "token_file": str(tmp_path / "token")}}
    try:
        async with server_factory(execution_group={"nodes": [{"count": 2}]}, simulation={"speedup": 1.0},
                                  scheduler={"enabled": False}, planner=planner) as srv:
            async with aiohttp.ClientSession() as http:
                async def status() -> dict:
                    async with http.get(f"{srv.base_url}/v1/planner") as r:
                        assert r.status == 200
                        return await r.json()

                async def one(i: int) -> None:
                    prompt = [100_000 + i * 3000 + k for k in range(2000)]  # no shared prefix: all prefilled
                    await srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)

                async def overload() -> None:
                    for wave in range(40):
                        await asyncio.gather(*(one(wave * 16 + i) for i in range(16)))
                        if any(p["delta"] == 1 for p in posts):
                            return

                await asyncio.wait_for(overload(), 60)
                up = next(p for p in posts if p["delta"] == 1)
                assert up["role"] == "both" and any(r.startswith("TTFT: mean") for r in up["reasons"])
                body = await status()
                assert body["enabled"] is True
                assert (body["acting"], body["leadership"]) == (True, None)  # one process: it acts
                rec = body["recommendations"][0]
                assert rec["role"] == "both" and rec["decided_at"] is not None and rec["signals"]["workers"] == 2

                # (an idle fleet may get a -1 before the load starts: the one that counts comes after the +1)
                async def minus_one() -> bool:
                    return any(p["delta"] == -1 and p["at"] > up["at"] for p in posts)

                await wait_for(minus_one, 30)  # idle: after the cooldown, one worker fewer would do
                down = next(p for p in posts if p["delta"] == -1 and p["at"] > up["at"])
                assert down["reasons"][0].startswith("queue on 1 workers")
                assert down["at"] - up["at"] >= 1.5  # not before the cooldown

                async def recorded() -> bool:  # the command saw the +1 and, later, the -1
                    lines = calls.read_text().splitlines() if calls.exists() else []
                    return "both +1" in lines and "both -1" in lines[lines.index("both +1"):]

                await wait_for(recorded, 10)
                # the Deployment went one up on the +1 (2 workers, 2 replicas), then one down on the -1
                async def scaled() -> bool:
                    return [w["spec"]["replicas"] for w in kube.writes][:2] == [3, 2]

                await wait_for(scaled, 10)
                assert all(a.get("exit_status") == 0 or a.get("status") == 200 for a in (await status())["actions"])
                async with http.get(f"{srv.base_url}/metrics") as r:
                    text = await r.text()
                assert 'thunderagent_planner_recommendation{role="both"}' in text
    finally:
        await runner.cleanup()
        await kube.stop()


async def test_planner_off_by_default(server_factory):
    async with server_factory() as srv, aiohttp.ClientSession() as http:
        async with http.get(f"{srv.base_url}/v1/planner") as r:
            assert r.status == 200
            assert await r.json() == {"enabled": False, "acting": False, "leadership": None, "recommendations": [],
                                      "actions": []}


async def test_planner_reads_the_live_ttft_histogram_with_a_quantile(server_factory):
    """With ``ttft_quantile`` the live hook hands the planner each worker's TTFT histogram from the
    fleet's own registry; ``/v1/planner`` says which statistic it read, and its value lies within the
    bounds of the requests' measured TTFTs."""
    planner = {"enabled": True, "interval_s": 0.1, "window_s": 5.0, "cooldown_s": 60.0, "max_workers": 2,
               "ttft_quantile": 0.5, "up_ttft_s": 30.0, "down_ttft_s": 20.0}
    async with server_factory(execution_group={"nodes": [{"count": 2}]}, simulation={"speedup": 1.0},
                              scheduler={"enabled": False}, planner=planner) as srv:
        ttfts = []
        for i in range(6):
            t0 = time.monotonic()
            stream = await srv.client.completions.create(model=MODEL, prompt=[200_000 + i * 500 + k for k in range(400)],
                                                         max_tokens=4, stream=True)
            async for _ in stream:
                ttfts.append(time.monotonic() - t0)
                break
            async for _ in stream:
                pass
        samples = srv.fleet.planner.samples()
        assert sum(s.ttft_count for s in samples) == 6
        for s in samples:  # cumulative over the planner's bounds, ending at the worker's count
            assert [b for b, _ in s.ttft_buckets] == sorted(b for b, _ in s.ttft_buckets) and len(s.ttft_buckets) > 10
            counts = [n for _, n in s.ttft_buckets]
            assert counts == sorted(counts) and counts[-1] == s.ttft_count

        async def read() -> dict:
            async with aiohttp.ClientSession() as http, http.get(f"{srv.base_url}/v1/planner") as r:
                assert r.status == 200
                return (await r.json())["recommendations"][0]["signals"]

        async def seen() -> bool:
            return (await read())["ttft_s"] is not None

        await wait_for(seen, 10)
        sig = await read()
        assert sig["ttft_stat"] == "p50"
        # the engine-side TTFT is at most what the client measured, and a p50 lies within the bucket
        # that holds the middle value: at most the next bound above the slowest request's TTFT
        assert 0 < sig["ttft_s"] <= min(b for b in (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 5, 10) if b >= max(ttfts))
