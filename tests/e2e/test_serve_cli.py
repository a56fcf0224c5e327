"""The README's main command, as a user runs it: `thunderagent serve` in its own process."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]


def thunderagent_cmd() -> list[str]:
    exe = shutil.which("thunderagent", path=str(Path(sys.executable).parent)) or shutil.which("thunderagent")
    return [exe] if exe else [sys.executable, "-m", "thunderagent.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served():
    with serving() as (client, _):
        yield client


@contextmanager
def serving(*extra: str) -> Iterator[tuple[OpenAI, subprocess.Popen[str]]]:
    port = free_port()
    proc = subprocess.Popen(
        [*thunderagent_cmd(), "serve", "--port", str(port), "--workers", "4", "--speedup", "10",
         "--config", str(ROOT / "configs" / "example.yaml"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=10)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.models.list()
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"server did not start: {proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.1)
    try:
        yield client, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_streams_chat_through_official_client(served):
    raw = served.chat.completions.with_raw_response.create(
        model="thunderagent-sim", messages=[{"role": "user", "content": "hi from the e2e test " * 5}],
        max_tokens=30, stream=True,
    )
    assert raw.headers["x-thunderagent-worker"] in {f"worker-{i}" for i in range(4)}
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text and len(text.encode()) <= 30


def test_serve_rejects_bad_config_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing:\n  policy: fastest\n")
    res = subprocess.run([*thunderagent_cmd(), "serve", "--config", str(bad)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2
    assert "routing.policy" in res.stderr


def test_serve_admin_api_flag(tmp_path):
    """``--admin-api`` turns the operator's endpoints on (with keys off it warns); without it they answer 403."""
    def cordon(client: OpenAI) -> int:
        req = urllib.request.Request(f"{client.base_url}admin/workers/worker-0/cordon", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code

    with serving() as (client, _):
        assert cordon(client) == 403
    with serving("--admin-api") as (client, proc):
        assert cordon(client) == 200
        raw = client.completions.with_raw_response.create(model="thunderagent-sim", prompt="x", max_tokens=1)
        assert raw.headers["x-thunderagent-worker"] != "worker-0"
        proc.terminate()
        out = proc.communicate(timeout=10)[0]
    assert "admin API on without API keys" in out


def _stream_across_sigterm(client: OpenAI, proc: subprocess.Popen[str]) -> tuple[int, str | None, float]:
    """A streamed completion; SIGTERM to the server after its first token. (tokens, finish reason, seconds the
    stream went on after the signal)."""
    stream = client.completions.create(model="thunderagent-sim", prompt="a slow story " * 8, max_tokens=24,
                                       stream=True)
    n, finish, sent = 0, None, 0.0
    try:
        for chunk in stream:
            for c in chunk.choices:
                n += bool(c.text)
                finish = c.finish_reason or finish
            if n and not sent:
                proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
    except openai.APIConnectionError:  # cut: the stream ended without its last chunk
        finish = "cut"
    return n, finish, time.monotonic() - sent


def test_sigterm_drains_the_requests_in_flight(tmp_path):
    """A frontend stopped (a rolling update) closes its listener and lets its streams finish."""
    with serving("--speedup", "0.05") as (client, proc):  # 20x slower than real time: the stream lasts seconds
        n, finish, after = _stream_across_sigterm(client, proc)
        assert (n, finish) == (24, "length") and after > 0.5
        with pytest.raises(Exception):  # the listener closed at the signal
            urllib.request.urlopen(f"{client.base_url}models", timeout=2)
        assert proc.wait(30) == 0
        assert "no new connections" in (proc.stdout.read() if proc.stdout else "")
    # a drain shorter than the stream: the stream is cut, the server exits
    with serving("--speedup", "0.05", "--config", str(quick_config(tmp_path))) as (client, proc):
        t0 = time.monotonic()
        n, finish, after = _stream_across_sigterm(client, proc)
        assert n < 24 and finish == "cut" and after < 5
        assert proc.wait(30) == 0 and time.monotonic() - t0 < 15


def quick_config(tmp_path: Path) -> Path:
    """example.yaml with a 0.5 s drain."""
    import yaml

    data = yaml.safe_load((ROOT / "configs" / "example.yaml").read_text())
    data.setdefault("control_plane", {})["shutdown_timeout_s"] = 0.5
    path = tmp_path / "quick.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
