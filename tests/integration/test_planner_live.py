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
    planner = {"enabled": True, "interval_s": 0.1, "window_s": 1.0, "cooldown_s": 1.5, "max_workers": 4,
               "up_ttft_s": 0.05, "down_ttft_s": 0.02, "command": [sys.executable, "-c", _RECORD, str(calls)],
               "webhook_url": f"http://127.0.0.1:{port}/scale", "action_timeout_s": 5.0}
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
                assert all(a.get("exit_status") == 0 or a.get("status") == 200 for a in (await status())["actions"])
                async with http.get(f"{srv.base_url}/metrics") as r:
                    text = await r.text()
                assert 'thunderagent_planner_recommendation{role="both"}' in text
    finally:
        await runner.cleanup()


async def test_planner_off_by_default(server_factory):
    async with server_factory() as srv, aiohttp.ClientSession() as http:
        async with http.get(f"{srv.base_url}/v1/planner") as r:
            assert r.status == 200
            assert await r.json() == {"enabled": False, "recommendations": [], "actions": []}
