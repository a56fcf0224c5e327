"""Cache migration under injected skew, in the simulator: kv_aware with ``routing.migration`` off against on.

Fleet: 8 simulated workers of the default node (16,384 blocks of 64 tokens, 8,192-token passes, the
mocker's timing). Copies move on a ``--gbps`` link (default 200 Gb/s, an RDMA NIC) at the default
``bytes_per_token`` (128 KiB, Llama-3-8B fp16); every other ``routing.migration`` field at its default.

Each request = one of ``--prefixes`` long shared prefixes (``--prefix-tokens``, default 32 K) + a unique
suffix of 256-1,024 tokens, 32-256 output tokens. Skew shapes:

* ``pileup``: the prefixes share a 4 K-token root, so kv_aware puts them all on one worker while each is
  first requested (one every 0.5 s); then a Poisson burst of ``--rate`` req/s over them (uniform) for
  ``--burst-s`` seconds: one worker holds everything the fleet is asked for, the others hold nothing.
* ``shift``: groups of ``--group`` prefixes share a root (a group lands on one worker during the warm-up);
  in the burst the whole rate goes to one group, the next group every ``--period-s`` seconds: the skew
  moves from worker to worker.
* ``noskew`` (does it harm?): the same prefixes and rate, no warm-up, uniform demand from the start.

Arms, on the very same requests: ``off`` and ``on`` (``--hot`` adds ``hot``: hot-prefix replicas, which
spread a hot prefix by recomputing it on new replicas, every ``routing.hot_prefix`` field at its default).
TTFT percentiles are over the burst's requests (the warm-up requests, identical in both arms, left out).
Printed per shape and seed: TTFT mean/p50/p99 (ms), prefix reuse (all requests), copies landed, bytes moved,
refusals by cause; then per shape the ratio p99 off / on.
Target (issue 10 item 5): >= 2x on the skewed shapes; ``noskew`` should not get worse.

Run: ``cd bench && python migration_skew.py [--shapes pileup shift noskew] [--seeds 0 1 2] [--prefix-tokens N]
[--rate R] [--gbps G] [--hot] [--mig FIELD=VALUE ...]`` (about a minute per shape and seed).
"""

from __future__ import annotations

import argparse
import random

from _common import print_table

from thunderagent.config import Config, HotPrefixConfig, KvTransferConfig, MigrationConfig, Policy, RoutingConfig
from thunderagent.sim.driver import SimOutcome, Simulator
from thunderagent.sim.results import Dist
from thunderagent.sim.traces import TraceRequest

WORKERS = 8
BS = 64
ROOT_TOKENS = 4096


class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def new(self, tokens: int) -> list[int]:
        k = -(-tokens // BS)
        out = list(range(self.n, self.n + k))
        self.n += k
        return out


def _req(ids: _Ids, rng: random.Random, i: int, t: float, prefix: list[int], tag: str) -> TraceRequest:
    suffix = rng.randint(256, 1024)
    blocks = prefix + ids.new(suffix)
    return TraceRequest(f"{tag}:{i}", t, len(prefix) * BS + suffix, rng.randint(32, 256), blocks, BS)


def workload(shape: str, args: argparse.Namespace, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = _Ids()
    groups = args.prefixes // args.group if shape == "shift" else 1
    prefixes: list[list[int]] = []
    for _ in range(groups):
        root = ids.new(ROOT_TOKENS)
        prefixes += [root + ids.new(args.prefix_tokens - ROOT_TOKENS) for _ in range(args.prefixes // groups)]
    out: list[TraceRequest] = []
    t = 0.0
    if shape != "noskew":  # warm-up: each prefix requested once, one every 0.5 s (a group lands on one worker)
        for k, p in enumerate(prefixes):
            out.append(_req(ids, rng, len(out), t, p, f"warm:p{k}"))
            t += 0.5
    t += 2.0
    end = t + args.burst_s
    start = t
    while t < end:
        if shape == "shift":
            g = int((t - start) // args.period_s) % groups
            k = g * args.group + rng.randrange(args.group)
        else:
            k = rng.randrange(len(prefixes))
        out.append(_req(ids, rng, len(out), t, prefixes[k], f"burst:p{k}"))
        t += rng.expovariate(args.rate)
    return out


def run(reqs: list[TraceRequest], routing: RoutingConfig, seed: int) -> SimOutcome:
    sim = Simulator(Config().execution_group.nodes[0], routing, WORKERS, Policy.kv_aware, seed=seed)
    return sim.run(reqs, 1.0)


def burst(out: SimOutcome) -> Dist:
    """TTFT of the burst's requests (ms)."""
    return Dist.of([v for k, v in out.ttft_by_id.items() if k.startswith("burst:")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["pileup", "shift", "noskew"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="shift: prefixes per group (sharing a root)")
    ap.add_argument("--prefix-tokens", type=int, default=32768)
    ap.add_argument("--rate", type=float, default=10.0, help="burst arrival rate, req/s")
    ap.add_argument("--burst-s", type=float, default=40.0)
    ap.add_argument("--period-s", type=float, default=5.0, help="shift: seconds before demand moves on")
    ap.add_argument("--gbps", type=float, default=200.0, help="copy link bandwidth, Gb/s")
    ap.add_argument("--hot", action="store_true", help="a third arm: hot-prefix replicas (routing.hot_prefix, "
                    "spreading by recompute) instead of copies")
    ap.add_argument("--mig", action="append", default=[], metavar="FIELD=VALUE",
                    help="a routing.migration field for the on arm (repeat)")
    args = ap.parse_args()
    base = Config().routing
    link = KvTransferConfig(enabled=True, bandwidth_gbps=args.gbps)
    knobs = {k: float(v) for k, v in (kv.split("=", 1) for kv in args.mig)}
    on = base.model_copy(update={"migration": MigrationConfig.model_validate(
        {"enabled": True, "link": link, **knobs})})
    rows, summary = [], []
    for shape in args.shapes:
        ratios = []
        for seed in args.seeds:
            reqs = workload(shape, args, seed)
            res = {}
            arms = [("off", base), ("on", on)]
            if args.hot:
                arms.append(("hot", base.model_copy(update={"hot_prefix": HotPrefixConfig(enabled=True)})))
            for name, routing in arms:
                out = run(reqs, routing, seed)
                r = out.result
                m = r.extra.get("migration", {})
                assert isinstance(m, dict)
                b = burst(out)
                rows.append((shape, seed, name, len(reqs), f"{b.mean:,.1f}", f"{b.p50:,.1f}", f"{b.p99:,.1f}",
                             f"{100 * r.prefix_reuse:.1f} %", m.get("landed", "-"),
                             f"{int(m.get('bytes_moved', 0)) / 2**30:.1f}" if m else "-",
                             str(m.get("refusals", "-")) if m else "-", r.requests))
                res[name] = b
            ratios.append(res["off"].p99 / res["on"].p99)
            if args.hot:
                print(f"{shape} seed {seed}: TTFT p99 off/hot {res['off'].p99 / res['hot'].p99:.2f}x")
        summary.append((shape, ratios))
    print(f"{WORKERS} workers; {args.prefixes} prefixes of {args.prefix_tokens} tokens; burst {args.rate:g} req/s for "
          f"{args.burst_s:g} s; copy link {args.gbps:g} Gb/s")
    header = ("shape", "seed", "arm", "reqs", "mean", "p50", "p99", "reuse", "copies", "GiB moved", "refusals", "done")
    print_table("burst TTFT ms, prefix reuse, copies", header, rows)
    for shape, ratios in summary:
        verdict = "" if shape == "noskew" else f"; target >= 2x: {'met' if min(ratios) >= 2 else 'MISSED'} at worst"
        print(f"{shape}: TTFT p99 off/on " + ", ".join(f"{x:.2f}x" for x in ratios)
              + f" (median {sorted(ratios)[len(ratios) // 2]:.2f}x{verdict})")


if __name__ == "__main__":
    main()
