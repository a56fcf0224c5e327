"""Link warm-up on real vLLM servers: the first client request's TTFT with and without ``warmup_tokens``.

Each arm starts a *fresh* pair of vLLM CPU servers (the test suite's build and tiny model; a ``NixlConnector`` in
``kv_role: kv_both``, UCX over loopback TCP), so their NIXL handshake has not happened yet, and ThunderAgent
(``serve`` in its own process) in front: one ``role: prefill`` server, one decode server, disaggregation mode
``always``. Arm ``on`` sets ``kv_cache_transfer.warmup_tokens`` and waits until ``/health`` shows the link warmed
up; arm ``off`` does not. Then three client requests, one after another (distinct prompts, streamed), each
timed to its first token. The arms alternate per round (``--rounds``), and every arm's servers are new.

    .venv/bin/python bench/pd_warmup.py [--rounds 2] [--warmup-tokens 256]

About 90 s per arm on this machine (two vLLM servers start), four arms by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]

from _common import print_table  # noqa: E402
from agentic_vllm import http_get, start_front, stop  # noqa: E402

from tests.engines.tiny_model import _WORDS, build_tiny_llama  # noqa: E402
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer, cpu_binding, start_ready, vllm_python  # noqa: E402


def first_token_s(url: str, prompt: str) -> float:
    """Seconds to the first streamed text of one completion."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0})
    req = urllib.request.Request(f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data:") and b'"text"' in line and b'"text":""' not in line.replace(b" ", b""):
                return time.monotonic() - t0
    raise RuntimeError("no token streamed")


def metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in http_get(f"{url}/metrics", timeout=60).splitlines()
               if line.startswith(name) and not line.startswith("#"))


def run_arm(arm: str, python: Path, model: Path, work: Path, tokens: int, rnd: int) -> dict[str, float]:
    pre = VllmServer(f"pre-{arm}-{rnd}", python, model, work, cpu=cpu_binding(0), kv_role="kv_both")
    dec = VllmServer(f"dec-{arm}-{rnd}", python, model, work, cpu=cpu_binding(1), kv_role="kv_both")
    start_ready([pre, dec])
    plane: dict[str, object] = {"enabled": True, "bandwidth_gbps": 400.0}
    if arm == "on":
        plane["warmup_tokens"] = tokens
    cfg = {"model": str(model), "model_name": "tiny", "routing": {"seed": 7, "disaggregation": {"mode": "always"}},
           "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": 60},
           "execution_group": {"nodes": [
               {"engine": "vllm", "role": "prefill", "block_size": BLOCK_SIZE, "endpoints": [pre.endpoint()],
                "kv_cache_transfer": plane},
               {"engine": "vllm", "role": "decode", "block_size": BLOCK_SIZE, "endpoints": [dec.endpoint()]}]}}
    front, url = start_front(cfg, work, f"front-{arm}-{rnd}")
    out: dict[str, float] = {}
    try:
        if arm == "on":
            t0 = time.monotonic()
            while time.monotonic() - t0 < 300:
                # (a generous timeout: on 2 cores the pinned servers' threads can starve serve for seconds)
                warm = json.loads(http_get(f"{url}/health", timeout=60)).get("pd_warmup") or []
                if warm and warm[0]["ok"]:
                    out["warmup_s"] = float(warm[0]["seconds"])
                    break
                if warm and warm[0]["tries"] >= 3:
                    raise SystemExit(f"warm-up failed: {warm}")
                time.sleep(0.2)
        for k in range(3):
            words = " ".join(_WORDS[(rnd * 31 + k * 7 + i) % len(_WORDS)] for i in range(120))
            out[f"ttft{k + 1}"] = first_token_s(url, f"{arm} {rnd} {k}: {words}")
        out["pd_ok"] = metric(url, "thunderagent_pd_transfers_ok_total")
    finally:
        stop(front)
        pre.stop()
        dec.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-tokens", type=int, default=8 * BLOCK_SIZE)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pd-warmup-") as d:
        work = Path(d)
        model = build_tiny_llama(work / "model")
        python = vllm_python(work)
        results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        for rnd in range(a.rounds):
            for arm in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                res = run_arm(arm, python, model, work, a.warmup_tokens, rnd)
                print(f"round {rnd + 1} {arm}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
                results[arm].append(res)
    rows = []
    for arm, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append([arm, f"{med['ttft1']:.2f}", f"{med['ttft2']:.2f}", f"{med['ttft3']:.2f}",
                     f"{med['warmup_s']:.2f}" if "warmup_s" in med else "-", f"{med['pd_ok']:.0f}"])
    print_table(f"First requests on a fresh NIXL pair (median of {a.rounds}; seconds to first token; "
                f"warmup_tokens {a.warmup_tokens})", ["warm-up", "1st TTFT s", "2nd", "3rd", "warm-up s",
                                                     "transfers ok"], rows)
    off, on = (statistics.median(r["ttft1"] for r in results[x]) for x in ("off", "on"))
    print(f"first request TTFT with warm-up / without: {on / off:.2f}x")


if __name__ == "__main__":
    main()
