"""Start the real aiohttp server on a free 127.0.0.1 port inside the test's event loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from support.server import Server, running_server
from thunderagent.config import Config, parse_config

__all__ = ["Server", "running_server", "server_factory", "test_config"]


@pytest.fixture
def server_factory() -> Callable[..., object]:
    def make(**overrides: object):
        return running_server(test_config(**overrides))

    return make


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
