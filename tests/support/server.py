"""One way to run the real aiohttp server in a test's event loop, on a free 127.0.0.1 port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from openai import AsyncOpenAI

from thunderagent.config import Config
from thunderagent.control.fleet import Fleet
from thunderagent.frontend.app import FLEET_KEY, create_app
from thunderagent.frontend.server import ConnectionGuard, FrontendRunner
from thunderagent.frontend.tokenizer import Tokenizer


@dataclass
class Server:
    base_url: str
    fleet: Fleet
    client: AsyncOpenAI
    tokenizer: Tokenizer
    guard: ConnectionGuard | None = None  # open connections, as the server counts them
    app: web.Application | None = None


@asynccontextmanager
async def running_server(cfg: Config, *, fleet: Fleet | None = None, timeout: float = 30) -> AsyncIterator[Server]:
    app = create_app(cfg, fleet=fleet)
    runner = FrontendRunner(app)  # as `serve` runs it: with the control plane's connection limits
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout)
    from thunderagent.frontend.app import FRONTEND_KEY

    try:
        yield Server(base, app[FLEET_KEY], client, app[FRONTEND_KEY].tokenizer, runner.guard, app)
    finally:
        await client.close()
        await runner.cleanup()


def relayed_counts(fleet: Fleet) -> dict[str, float]:
    """``thunderagent_relayed_requests_total`` by its ``field`` label, as the fleet's registry holds it now."""
    return {dict(s.labels)["field"]: s.value for m in fleet.metrics.registry.collect()
            if m.name == "thunderagent_relayed_requests" for s in m.samples if s.name.endswith("_total")}
