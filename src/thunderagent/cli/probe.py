"""``thunderagent probe-links``: measure the links between simulated workers' KV byte servers.

For each ordered pair (source, destination) the destination's server pulls a fixed-size block from
the source's, through the same transport a KV transfer uses (``execution/kv_bytes.py``): the round
trip of an empty block (the link's latency) and the time of the full one give the bandwidth. The
table is printed; ``--yaml`` writes the estimates as ``links:`` for the prefill group's
``kv_cache_transfer`` (the plane starts from them; measured pulls refine them live).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer

from thunderagent.config.transfer import LinkEstimate


def parse_endpoint(spec: str) -> tuple[str, tuple[str, int]]:
    """``NAME=HOST:PORT`` -> (name, (host, port))."""
    name, sep, addr = spec.partition("=")
    host, colon, port = addr.rpartition(":")
    if not sep or not name or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"{spec!r}: expected NAME=HOST:PORT (a worker's log says 'KV bytes served on "
                                 "HOST:PORT')", param_hint="--endpoint")
    return name, (host, int(port))


async def measure(endpoints: dict[str, tuple[str, int]], nbytes: int, rounds: int,
                  timeout: float) -> list[tuple[LinkEstimate, dict[str, float]]]:
    """Every ordered pair, one after another (a probe must not share its link with another)."""
    from thunderagent.execution.kv_bytes import probe_pair

    out: list[tuple[LinkEstimate, dict[str, float]]] = []
    for src, a in endpoints.items():
        for dst, b in endpoints.items():
            if src == dst:
                continue
            res = await probe_pair(b, a, nbytes, rounds, timeout)
            est = LinkEstimate(src=src, dst=dst, bandwidth_gbps=res["bandwidth_bps"] * 8 / 1e9,
                               latency_s=res["rtt_s"])
            out.append((est, res))
    return out


def links_yaml(links: list[LinkEstimate]) -> str:
    rows = "".join(f"  - {{src: {e.src}, dst: {e.dst}, bandwidth_gbps: {e.bandwidth_gbps:.4g}, "
                   f"latency_s: {e.latency_s:.6f}}}\n" for e in links)
    return ("# thunderagent probe-links: paste under the role: prefill group's kv_cache_transfer\n"
            f"links:\n{rows}")


def probe_links(
    endpoint: Annotated[list[str], typer.Option("--endpoint", help="NAME=HOST:PORT of a worker's KV byte server "
                                                "(its log: 'KV bytes served on HOST:PORT'); repeat, two or more")],
    block_bytes: Annotated[int, typer.Option(help="size of the probe block, bytes", min=1)] = 8 << 20,
    rounds: Annotated[int, typer.Option(help="probes per pair (the fastest is kept)", min=1)] = 3,
    timeout: Annotated[float, typer.Option(help="seconds allowed per pair", min=0.1)] = 60.0,
    yaml: Annotated[Optional[Path], typer.Option("--yaml", help="write the estimates here, in the config's "
                                                 "kv_cache_transfer.links shape", dir_okay=False)] = None,
) -> None:
    """Measure bandwidth and round trip between simulated workers through their KV byte transport."""
    endpoints = dict(parse_endpoint(e) for e in endpoint)
    if len(endpoints) < 2:
        raise typer.BadParameter("two or more distinct workers are needed", param_hint="--endpoint")
    try:
        results = asyncio.run(measure(endpoints, block_bytes, rounds, timeout))
    except (OSError, RuntimeError, TimeoutError) as exc:
        typer.echo(f"error: {exc!r}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"{'src':<16} {'dst':<16} {'RTT ms':>9} {'block ms':>9} {'Gbit/s':>9}")
    for est, res in results:
        typer.echo(f"{est.src:<16} {est.dst:<16} {res['rtt_s'] * 1e3:>9.3f} {res['seconds'] * 1e3:>9.3f} "
                   f"{est.bandwidth_gbps:>9.3f}")
    if yaml is not None:
        yaml.write_text(links_yaml([e for e, _ in results]))
        typer.echo(f"wrote {len(results)} links to {yaml}")


def register(app: typer.Typer) -> None:
    app.command("probe-links")(probe_links)
