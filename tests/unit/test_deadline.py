"""``control/deadline.py``: a held request's wait ends at its deadline with the caller's cleanup run, a launched
one's timer cuts it once (and not after it ended), and no timeout arms nothing."""

from __future__ import annotations

import asyncio
import types

import pytest
from prometheus_client import CollectorRegistry

from thunderagent.control.deadline import TIMED_OUT, DeadlineExceeded, Deadlines


def test_a_held_wait_ends_at_the_deadline_after_its_cleanup() -> None:
    cut: list[object] = []
    deadlines = Deadlines(0.05, lambda gen, why: cut.append((gen, why)), CollectorRegistry())
    cleaned: list[str] = []

    async def held(received: float, now: float, wait: float) -> str:
        async with deadlines.held(received, now):
            try:
                await asyncio.sleep(wait)
                return "dispatched"
            except asyncio.CancelledError:
                cleaned.append("left the queue")
                raise

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(DeadlineExceeded, match=r"request_timeout_s \(0.05 s\)"):
            await held(loop.time(), loop.time(), 5.0)
        assert cleaned == ["left the queue"]
        assert await held(loop.time(), loop.time(), 0.0) == "dispatched"
        with pytest.raises(DeadlineExceeded):  # arrived long ago: its time was up before it was held
            await held(loop.time() - 1.0, loop.time(), 5.0)
        # a caller cancelled for its own reasons (client gone) is not a timeout
        task = asyncio.create_task(held(loop.time(), loop.time(), 5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert deadlines.expired._value.get() == 2 and cut == []


def test_a_launched_request_is_cut_once_at_its_deadline_unless_it_ended() -> None:
    cut: list[tuple[object, str]] = []
    deadlines = Deadlines(0.05, lambda gen, why: cut.append((gen, why)), CollectorRegistry())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        slow = types.SimpleNamespace(received=loop.time(), timer=None, timed_out=False)
        quick = types.SimpleNamespace(received=loop.time(), timer=None, timed_out=False)
        deadlines.arm(slow, loop.time())  # type: ignore[arg-type]
        deadlines.arm(quick, loop.time())  # type: ignore[arg-type]
        deadlines.disarm(quick)  # type: ignore[arg-type]  # it ended in time
        await asyncio.sleep(0.1)
        assert cut == [(slow, TIMED_OUT)] and slow.timed_out and not quick.timed_out
        assert slow.timer is None and quick.timer is None

    asyncio.run(main())


def test_no_timeout_arms_nothing() -> None:
    deadlines = Deadlines(None, lambda gen, why: None, CollectorRegistry())

    async def main() -> None:
        gen = types.SimpleNamespace(received=0.0, timer=None, timed_out=False)
        deadlines.arm(gen, 0.0)  # type: ignore[arg-type]
        assert gen.timer is None
        async with deadlines.held(0.0, 1e9):
            await asyncio.sleep(0)

    asyncio.run(main())
