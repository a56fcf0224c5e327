"""Start the real aiohttp server on a free 127.0.0.1 port inside the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from aiohttp import web
from openai import AsyncOpenAI

from thunderagent.config import Config, parse_config
from thunderagent.server.app import FLEET_KEY, create_app
from thunderagent.server.fleet import Fleet


@dataclass
class Server:
    base_url: str
    fleet: Fleet
    client: AsyncOpenAI


def test_config(**overrides: object) -> Config:
    data: dict[str, object] = {
        "control_plane": {"heartbeat_interval": 0.1, "heartbeat_misses": 5},
        "simulation": {"speedup": 20.0},
        "routing": {"seed": 7},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}  # type: ignore[dict-item]
        else:
            data[key] = value
    return parse_config(data, "test")


@asynccontextmanager
async def running_server(cfg: Config) -> AsyncIterator[Server]:
    app = create_app(cfg)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        yield Server(base, app[FLEET_KEY], client)
    finally:
        await client.close()
        await runner.cleanup()


@pytest.fixture
def server_factory() -> Callable[..., object]:
    def make(**overrides: object):
        return running_server(test_config(**overrides))

    return make
