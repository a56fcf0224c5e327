"""What a server's answer to one of vLLM's sleep-mode calls means for routing (``execution/server_admin.sleep_effect``):
asleep or not, and whether its prefix cache is gone."""

from __future__ import annotations

import pytest

from thunderagent.execution.server_admin import sleep_effect


@pytest.mark.parametrize(("path", "query", "answer", "effect"), [
    ("/sleep", "", '{"status": "sleeping", "level": 1}', (True, True)),  # level 1 by default: the KV discarded
    ("/sleep", "level=0&mode=wait", '{"status": "sleeping", "level": 0}', (True, False)),  # scheduling paused only
    ("/sleep", "level=2", '{"status": "sleeping", "level": 2}', (True, True)),
    ("/wake_up", "", '{"status": "awake", "tags": null}', (False, False)),
    ("/wake_up", "tags=weights", '{"status": "sleeping", "tags": ["weights"]}', (True, False)),  # kv_cache sleeps on
    ("/wake_up", "", "", (False, False)),  # an older server's empty answer: woken whole
    ("/wake_up", "", "[1]", (False, False)),
    ("/release_kv_cache_memory", "", '{"status": "kv_cache_released"}', (None, True)),
    ("/is_sleeping", "", '{"is_sleeping": true}', (None, False)),  # a read changes nothing
    ("/collective_rpc", "", '{"results": []}', (None, False)),
])
def test_sleep_effect(path: str, query: str, answer: str, effect: tuple[bool | None, bool]) -> None:
    assert sleep_effect(path, query, answer) == effect
