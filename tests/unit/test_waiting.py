"""The tests' own polling helper: its deadline counts on-time loop, and it still ends."""

from __future__ import annotations

import asyncio
import time

import pytest

from support.waiting import wait_until


async def test_a_starved_loop_does_not_use_up_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    seen: list[int] = []
    loop.call_later(0.05, time.sleep, 1.0)  # the process starved 1 s, twice the timeout
    loop.call_later(1.2, seen.append, 1)  # what was awaited comes right after
    t0 = loop.time()
    assert await wait_until(lambda: seen, 0.5, "the flag") == [1]
    assert loop.time() - t0 < 1.6


async def test_a_condition_never_met_fails_on_time_naming_what() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(AssertionError, match="timed out after 0.2s waiting for: never"):
        await wait_until(lambda: False, 0.2, "never")
    assert 0.2 <= loop.time() - t0 < 0.5
