"""Overload driven by a real load generator from PyPI: NVIDIA's ``aiperf`` against ``thunderagent serve``.

The same server and load shape as ``bench/overload.py`` (2 simulated workers, 4 sequence slots each,
engine at 0.25x speed, 16-token streamed completions, a distinct prompt per request of about the
same length), with aiperf as the client:

1. **capacity**: our own closed loop (``bench/overload.py``'s), the completions per second the fleet sustains;
2. **unloaded**: aiperf at a quarter of that rate (constant arrivals): the TTFT baseline;
3. **overload**: aiperf at ``--factor`` x that rate for ``--duration`` seconds;
4. **after**: the server's ``/health``, liveness counters, RSS, and a request served.

aiperf's own export (``profile_export_aiperf.json``) gives request throughput, TTFT percentiles over
the requests that succeeded, and its error summary (the 429s). aiperf is not in the project's
extras (it brings transformers and a multi-process runtime): install it in its own venv,

    python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0
    .venv/bin/python bench/overload_aiperf.py            # 60 s at 3x; --duration 15 for a quick look

It needs a tokenizer and nothing can be downloaded here (``--tokenizer builtin`` fetches tiktoken's
file): the run builds a small local byte-level BPE tokenizer with ``tests/engines/tiny_model.py`` (in
the aiperf venv's Python, which has ``tokenizers`` and ``transformers``) and passes its folder;
prompt lengths are in that tokenizer's tokens (``--isl 200`` is about 280 server-side tokens, as
``bench/overload.py``'s prompts are). Server-side token counts are used for aiperf's token metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


def _overload():
    spec = importlib.util.spec_from_file_location("_bench_overload", ROOT / "bench" / "overload.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_bench_overload"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


ov = _overload()


def find_aiperf(explicit: str | None) -> Path:
    for cand in ([Path(explicit)] if explicit else []) + [Path(sys.executable).parent / "aiperf",
                                                          ROOT / ".venv-aiperf" / "bin" / "aiperf"]:
        if cand.exists():
            return cand
    raise SystemExit("aiperf not found: python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0 "
                     "(or pass --aiperf PATH)")


def build_tokenizer(aiperf: Path, out: Path) -> Path:
    """A local tokenizer folder for aiperf, built by the aiperf venv's Python (no download)."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import tiny_model; "
            "tiny_model.build_tokenizer(Path(sys.argv[2]))")
    subprocess.run([str(aiperf.parent / "python"), "-c", code, str(ROOT / "tests" / "engines"), str(out)],
                   check=True, capture_output=True, timeout=120)
    return out


@dataclass
class AiperfRun:
    rate: float
    seconds: float
    export: dict

    def metric(self, name: str, stat: str = "avg") -> float:
        m = self.export.get(name) or {}
        v = m.get(stat)
        return float("nan") if v is None else float(v)

    @property
    def sent(self) -> int:
        """Requests that got an answer (aiperf counts errors among its completed requests)."""
        n = self.metric("completed_request_count")
        return int(self.metric("request_count") if math.isnan(n) else n)

    @property
    def ok(self) -> int:
        return self.sent - sum(self.errors().values())

    def errors(self) -> dict[str, int]:
        """Error counts by HTTP code (or error type)."""
        out: dict[str, int] = {}
        for e in self.export.get("error_summary") or []:
            det = e.get("error_details") or {}
            key = str(det.get("code") or det.get("type") or "other")
            out[key] = out.get(key, 0) + int(e.get("count", 0))
        return out


def run_aiperf(aiperf: Path, tokenizer: Path, base: str, rate: float, seconds: float, art: Path, *,
               isl: int, osl: int, seed: int) -> AiperfRun:
    cmd = [str(aiperf), "profile", "-m", ov.MODEL, "--url", base, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", str(tokenizer), "--use-server-token-count",
           "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl),
           "--request-rate", f"{rate:.3f}", "--arrival-pattern", "constant", "--benchmark-duration", f"{seconds:g}",
           "--benchmark-grace-period", "30", "--request-timeout-seconds", "60", "--random-seed", str(seed),
           "--no-server-metrics", "--ui", "none", "--artifact-dir", str(art)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 180)
    export = art / "profile_export_aiperf.json"
    if proc.returncode != 0 or not export.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"aiperf failed ({proc.returncode}):\n{tail}")
    return AiperfRun(rate, seconds, json.loads(export.read_text()))


@dataclass
class Report:
    capacity_rps: float
    unloaded: AiperfRun
    overload: AiperfRun
    rss_base_mb: float
    rss_peak_mb: float
    rss_after_mb: float
    health_after: tuple[int, dict]
    counters: dict[str, float]
    served_after: int
    held: tuple[float, float] = (0.0, 0.0)  # requests held in the scheduler during the overload, their seconds there

    @property
    def ttft_ratio_p99(self) -> float:
        return self.overload.metric("time_to_first_token", "p99") / self.unloaded.metric("time_to_first_token", "p99")

    def lines(self) -> list[str]:
        un, o = self.unloaded, self.overload

        def ttft(r: AiperfRun) -> str:
            return "  ".join(f"{q} {r.metric('time_to_first_token', q):.0f} ms" for q in ("p50", "p90", "p99"))

        errs = o.errors()
        return [
            f"capacity (our closed loop): {self.capacity_rps:.1f} completions/s; aiperf offered {o.rate:.1f} req/s "
            f"for {o.seconds:.0f} s ({o.rate / self.capacity_rps:.1f}x)",
            f"aiperf unloaded ({un.rate:.1f} req/s, {un.seconds:.0f} s): {un.ok} x 200, TTFT {ttft(un)}, "
            f"errors {un.errors() or '-'}",
            f"aiperf overload: {o.sent} answered, {o.ok} x 200 ({o.ok / o.seconds:.1f}/s), errors by code "
            f"{errs or '-'} ({o.metric('request_error_rate'):.0f} % of requests)",
            f"aiperf admitted TTFT: {ttft(o)} = {self.ttft_ratio_p99:.2f}x unloaded p99 "
            f"(p50 {o.metric('time_to_first_token', 'p50') / un.metric('time_to_first_token', 'p50'):.2f}x); "
            f"{self.held[0]:.0f} held in the scheduler first (mean {self.held[1] / max(1.0, self.held[0]) * 1e3:.0f} ms)",
            f"server RSS: {self.rss_base_mb:.0f} MB before, {self.rss_peak_mb:.0f} MB peak, {self.rss_after_mb:.0f} MB "
            f"after; liveness: {self.counters['lease_expired']:.0f} leases expired, "
            f"{self.counters['index_purged']:.0f} index entries purged",
            f"right after: /health {self.health_after[0]} ({self.health_after[1].get('healthy_workers')} healthy), "
            f"a request -> {self.served_after}",
        ]


async def run(duration: float, factor: float, aiperf: Path, tokenizer: Path | None, *, isl: int = 200,
              osl: int = 16, log_path: Path | None = None, extra_config: str = "") -> Report:
    work = Path(tempfile.mkdtemp(prefix="overload-aiperf-"))
    tok = tokenizer or build_tokenizer(aiperf, work / "tokenizer")
    srv = ov.ServeProcess(ov.CONFIG.format(slots=4, engine_speed=0.25) + extra_config,
                          log_path or Path(tempfile.gettempdir()) / "overload-aiperf-serve.log")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            await srv.ready(session)
            for i in range(10):
                await ov.shoot(session, srv.base, 900_000 + i, osl)
            cap, _ = await ov.capacity(session, srv.base, 6.0, clients=32, max_tokens=osl)
            await asyncio.sleep(3.0)
            loop = asyncio.get_running_loop()
            un = await loop.run_in_executor(None, lambda: run_aiperf(
                aiperf, tok, srv.base, cap / 4, max(8.0, duration / 3), work / "unloaded", isl=isl, osl=osl, seed=1))
            rss_base = srv.rss_mb()
            peak = [rss_base]
            before = await srv.counters(session)
            fut = loop.run_in_executor(None, lambda: run_aiperf(
                aiperf, tok, srv.base, factor * cap, duration, work / "overload", isl=isl, osl=osl, seed=2))
            while not fut.done():
                peak[0] = max(peak[0], srv.rss_mb())
                await asyncio.wait([fut], timeout=0.5)
            o = fut.result()
            during = await srv.counters(session)
            health_after = await srv.health(session)
            served_after = (await ov.shoot(session, srv.base, 4_000_000, osl)).status
            await asyncio.sleep(3.0)
            return Report(cap, un, o, rss_base, peak[0], srv.rss_mb(), health_after, await srv.counters(session),
                          served_after, (during["held_n"] - before["held_n"], during["held_s"] - before["held_s"]))
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of overload (default 60)")
    ap.add_argument("--factor", type=float, default=3.0, help="offered load / measured capacity (default 3)")
    ap.add_argument("--aiperf", default=None, help="the aiperf executable (default: next to this Python, or "
                    ".venv-aiperf/bin/aiperf)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a local tokenizer folder (default: built here)")
    ap.add_argument("--config", default="", help="YAML appended to the server's config")
    ap.add_argument("--log", type=Path, default=None, help="server log file")
    args = ap.parse_args()
    rep = asyncio.run(run(args.duration, args.factor, find_aiperf(args.aiperf), args.tokenizer, log_path=args.log,
                          extra_config=args.config))
    print("\n".join(rep.lines()))


if __name__ == "__main__":
    main()
