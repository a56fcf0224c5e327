"""``thunderagent top`` against a live server, read from a pseudo-terminal (issue 13 item 3).

Three simulated workers, routed round robin with the holding queue off: two fast ones and one that runs one
sequence at a time, 20x slower. Under a steady stream of requests the slow one's engine queue grows while the
others drain theirs: it is the hot worker. ``top`` runs as its own process on a pty (what an operator's
terminal is), once with ``--once`` and once live until interrupted; the test reads the screen."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import re
import secrets
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from support.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
SKEWED = {"nodes": [{"count": 2}, {"count": 1, "max_batch_size": 1, "timing": {"speedup": 0.05}}]}
CLI = Path(sys.executable).parent / "thunderagent"  # the console script, as an operator runs it
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>78]")


def _spawn(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))  # rows, cols
    proc = subprocess.Popen([str(CLI), "top", *args], stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True, env={**os.environ, "TERM": "xterm-256color", **(env or {})})
    os.close(slave)
    return proc, master


def _read_until(master: int, done, timeout: float) -> str:
    """The pty's output, ANSI codes stripped, read until ``done(screen)`` or EOF; fails on timeout."""
    raw, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the pty
                chunk = b""
            if not chunk:
                return ANSI.sub("", raw.decode(errors="replace"))
            raw += chunk
            if done(ANSI.sub("", raw.decode(errors="replace"))):
                return ANSI.sub("", raw.decode(errors="replace"))
    raise AssertionError(f"timed out; screen so far:\n{ANSI.sub('', raw.decode(errors='replace'))}")


async def _traffic(srv, stop: asyncio.Event) -> None:
    async def one(i: int) -> None:
        with contextlib.suppress(Exception):  # the stream is cut when the test ends
            await srv.client.completions.create(model=MODEL, prompt=f"shared system prompt {i % 3} " * 20,
                                                max_tokens=16)
    tasks: set[asyncio.Task[None]] = set()
    i = 0
    while not stop.is_set():
        task = asyncio.create_task(one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        await asyncio.sleep(0.02)
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _worker_line(screen: str, wid: str) -> str:
    lines = [ln for ln in screen.splitlines() if re.search(rf"│ {wid} ", ln)]  # its row in the table
    assert lines, f"{wid} not on screen:\n{screen}"
    return lines[-1]


def _ttft_ms(screen: str) -> list[float]:
    line = [ln for ln in screen.splitlines() if "TTFT" in ln][-1]
    return [float(v) for v in re.findall(r"([\d.]+) ms", line)]


@pytest.fixture
def skewed(server_factory):
    # slow-worker ejection off: the slow worker must stay in routing to become the hot one
    return server_factory(execution_group=SKEWED, scheduler={"enabled": False},
                          routing={"policy": "round_robin"}, simulation={"speedup": 20.0},
                          control_plane={"outlier": {"enabled": False}})


async def _run_with_traffic(srv, body):
    stop = asyncio.Event()
    traffic = asyncio.create_task(_traffic(srv, stop))
    try:
        await wait_until(lambda: srv.fleet.registry.loads()["worker-2"].waiting >= 8, 20, "worker-2 backlog")
        return await asyncio.to_thread(body)
    finally:
        stop.set()
        await traffic


async def test_once_shows_every_worker_the_hot_one_and_ttft(skewed):
    async with skewed as srv:
        def once() -> str:
            proc, master = _spawn("--url", srv.base_url, "--once", "--interval", "1")
            try:
                screen = _read_until(master, lambda s: False, 30)  # until it exits
                assert proc.wait(10) == 0, screen
                return screen
            finally:
                os.close(master)

        screen = await _run_with_traffic(srv, once)
    for wid in ("worker-0", "worker-1"):
        line = _worker_line(screen, wid)
        assert "healthy" in line and "both" in line and "HOT" not in line, screen
    assert "HOT" in _worker_line(screen, "worker-2"), screen
    assert "hot worker worker-2" in screen, screen
    p50, p90, p99 = _ttft_ms(screen)
    # wall-clock TTFT: the slow worker's backlog takes seconds, nothing near the top bucket (60 s); this
    # also pins that TTFT is measured from the fleet's arrival time, not the simulated engine's clock
    assert 0 < p50 <= p90 <= p99 < 20_000, screen
    assert "last 1.0 s" in screen or re.search(r"last 1\.\d s", screen), screen
    rate = float(re.search(r"decisions/s ([\d.]+)", screen).group(1))
    assert rate > 5, screen  # ~50 requests/s are sent


async def test_live_view_refreshes_until_interrupted(skewed):
    async with skewed as srv:
        def live() -> tuple[str, int]:
            proc, master = _spawn("--url", srv.base_url, "--interval", "0.3")
            try:
                screen = _read_until(master, lambda s: s.count("TTFT") >= 3 and "hot worker worker-2" in s, 30)
                proc.send_signal(signal.SIGINT)
                # keep draining the pty until it closes: leaving the live view writes the last frame and
                # the screen's restore, and a full pty would block that write (the process never exits)
                _read_until(master, lambda s: False, 10)
                return screen, proc.wait(10)
            finally:
                if proc.poll() is None:
                    proc.kill()
                os.close(master)

        screen, rc = await _run_with_traffic(srv, live)
    assert rc == 0, screen
    assert all(f"worker-{i}" in screen for i in range(3)), screen
    assert "HOT" in _worker_line(screen, "worker-2"), screen


async def test_api_keys_need_an_admin_key(server_factory):
    tenant, admin = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    cp = {"api_keys": {tenant: "acme"}, "admin_keys": [admin]}
    async with server_factory(control_plane=cp) as srv:
        def run(env: dict[str, str]) -> tuple[str, int]:
            proc, master = _spawn("--url", srv.base_url, "--once", "--interval", "0.1", env=env)
            try:
                screen = _read_until(master, lambda s: False, 30)
                return screen, proc.wait(10)
            finally:
                os.close(master)

        refused, rc_refused = await asyncio.to_thread(run, {"THUNDERAGENT_API_KEY": tenant})
        shown, rc_shown = await asyncio.to_thread(run, {"THUNDERAGENT_API_KEY": admin})
    assert rc_refused == 1 and "admin key" in refused, refused
    assert rc_shown == 0 and "worker-0" in shown and "TTFT" in shown, shown
