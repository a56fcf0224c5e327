"""Long prompts tokenized on the pool's threads, short ones on the event loop (``frontend/tokenize_pool.py``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from thunderagent.frontend.tokenize_pool import TokenizePool


def _where(text: str, *, upper: bool = False) -> tuple[str, str]:
    if text == "bad":
        raise ValueError("bad prompt")
    return threading.current_thread().name, text.upper() if upper else text


async def test_long_bodies_go_to_the_pool_short_ones_stay_on_the_loop() -> None:
    pool = TokenizePool(2, offload_bytes=100)
    try:
        loop_thread = threading.current_thread().name
        assert await pool.run(99, _where, "short") == (loop_thread, "short")
        name, out = await pool.run(100, _where, "long", upper=True)
        assert name.startswith("tokenize") and out == "LONG" and pool.offloaded == 1
        with pytest.raises(ValueError, match="bad prompt"):  # raised to the caller, as on the loop
            await pool.run(1000, _where, "bad")
        # the loop runs while the pool works
        gate = threading.Event()
        blocked = asyncio.ensure_future(pool.run(1000, gate.wait, 5))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        gate.set()
        assert await blocked is True
    finally:
        pool.close()


async def test_no_threads_keeps_everything_on_the_loop() -> None:
    pool = TokenizePool(0, offload_bytes=0)
    assert await pool.run(10**9, _where, "x") == (threading.current_thread().name, "x") and pool.offloaded == 0
    pool.close()
