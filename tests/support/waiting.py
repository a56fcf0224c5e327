"""Polling with a deadline (async and blocking) and free loopback ports."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable
from typing import Any


def _ephemeral_low() -> int:
    """The low end of the kernel's ephemeral port range (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


_EPHEMERAL_LOW = _ephemeral_low()
_handed_out: set[int] = set()  # this process's picks: never the same port twice
_pick = random.Random()  # seeded from the OS: parallel test processes draw apart


def free_port() -> int:
    """A free loopback port for a server a test starts, picked *below* the ephemeral range where the
    kernel has one: a port from ``bind(0)`` is an ephemeral one, which the kernel may give to any
    outgoing connection between our pick and the server's bind (CI lost a vLLM server's NIXL
    side-channel port that way). Falls back to ``bind(0)``."""
    if _EPHEMERAL_LOW > 12_000:
        for _ in range(200):
            port = _pick.randrange(10_000, _EPHEMERAL_LOW)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A free port P with P + 1 free too (a data-parallel vLLM server's rank 1 binds its KV-event socket there:
    vLLM offsets the port by the rank)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        _handed_out.add(port + 1)
        return port
    raise RuntimeError("no two adjacent free ports")


async def wait_until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``cond`` on the running loop until it is truthy (returned); fail naming ``what``.

    ``timeout`` counts on-time loop, as the fleet's own liveness rules do: while this process is
    starved (CI's 2 shared cores), what the awaited side sent waits unread, so a poll that wakes
    late moves the deadline by its lateness (up to twice ``timeout`` in all: a test still ends)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    excused, cap = 0.0, 2 * timeout
    while True:
        value = cond()
        if value:
            return value
        asked = loop.time()
        if asked > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for: {what}"
                                 + (f" ({excused:.1f}s more excused: the loop was starved)" if excused else ""))
        await asyncio.sleep(interval)
        late = min(loop.time() - asked - interval, cap - excused)
        if late > 0.05:  # past scheduling jitter
            excused += late
            deadline += late


def wait_until_blocking(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """The same from synchronous code (other processes): exceptions count as "not yet"."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # not up yet
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
