"""A real multi-process deployment for tests: nats-server, ``thunderagent worker`` and
``thunderagent frontend`` processes on 127.0.0.1, each logging to a file, all killed on close."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from support.waiting import free_port
from support.waiting import wait_until_blocking as wait_until

__all__ = ["Cluster", "free_port", "wait_until"]

BIN = Path(sys.executable).parent

CONFIG = """\
control_plane: {{heartbeat_interval: {hb}, heartbeat_misses: {misses}}}
simulation: {{speedup: 10.0}}
routing: {{seed: 7}}
execution_group:
  nodes: [{{count: 1, kv_blocks: 8192, block_size: 64}}]
"""


def executable(name: str) -> str:
    exe = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} not installed: pip install -e '.[nats]'")
    return exe


class Cluster:
    def __init__(self, tmp: Path, heartbeat_interval: float = 0.2, misses: int = 3) -> None:
        self.tmp = tmp
        self.config = tmp / "deploy.yaml"
        self.config.write_text(CONFIG.format(hb=heartbeat_interval, misses=misses))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        self.nats_url = ""

    # -- processes ---------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        old = self.procs.get(name)
        assert old is None or old.poll() is not None, f"{name} is still running"
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        log.close()
        self.procs[name] = proc
        return proc

    def start_nats(self, conf: Path | None = None, port: int | None = None, url: str | None = None) -> str:
        """An open server on a free port, or the one ``conf`` describes (on ``port``, reached at ``url``)."""
        port = port or free_port()
        args = ["-c", str(conf)] if conf is not None else ["-a", "127.0.0.1", "-p", str(port)]
        self._spawn("nats", [executable("nats-server"), *args])
        self.nats_url = url or f"nats://127.0.0.1:{port}"

        def accepting() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                return s.recv(4096).startswith(b"INFO")

        wait_until(accepting, 10, "nats-server")
        return self.nats_url

    def start_worker(self, wid: str, *extra: str, env: dict[str, str] | None = None,
                     config: Path | None = None) -> None:
        self._spawn(wid, [executable("thunderagent"), "worker", "--nats", self.nats_url, "--id", wid,
                          "--config", str(config or self.config), *extra], env)

    def start_frontend(self, name: str, env: dict[str, str] | None = None, config: Path | None = None) -> int:
        port = self.ports.setdefault(name, free_port())
        self._spawn(name, [executable("thunderagent"), "frontend", "--nats", self.nats_url, "--port", str(port),
                           "--config", str(config or self.config)], env)
        return port

    def write_config(self, name: str, extra: str) -> Path:
        """The cluster's config with ``extra`` YAML (a ``nats:`` section) appended."""
        path = self.tmp / name
        path.write_text(self.config.read_text() + extra)
        return path

    def kill(self, name: str, sig: int = signal.SIGKILL, wait: bool = True) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        if wait:
            proc.wait(15)

    def exited(self, name: str) -> bool:
        return self.procs[name].poll() is not None

    def close(self) -> None:
        for proc in reversed(self.procs.values()):  # nats-server last: the others leave cleanly
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.tmp.glob("*.log")))

    # -- HTTP --------------------------------------------------------------------------------
    def health(self, name: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.ports[name]}/health"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as err:  # 503 when no worker: still a summary
            return json.load(err)

    def workers(self, name: str) -> set[str]:
        return {w["id"] for w in self.health(name)["workers"] if w["health"] == "healthy"}

    def indexed(self, name: str) -> dict[str, int]:
        return {w["id"]: w["indexed_blocks"] for w in self.health(name)["workers"]}

    def client(self, name: str) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.ports[name]}/v1", api_key="unused", max_retries=0,
                      timeout=30)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A :class:`Cluster` in the test's tmp dir, closed afterwards; its logs printed (pytest shows them
    only when the test failed)."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
        print(c.logs())
