"""``thunderagent sim``: replay traces through the router, index and simulated engines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from thunderagent.config import Config, ConfigError, Policy, load_config


_DYNAMO_MODE = {Policy.round_robin: "round_robin", Policy.kv_aware: "kv_router"}


def sim(
    trace: Annotated[list[Path], typer.Option(help="trace file or folder (Mooncake JSONL, kv-cache-tester JSON); repeat to merge", exists=True)],
    workers: Annotated[int, typer.Option(help="simulated workers", min=1)] = 8,
    kv_blocks: Annotated[int, typer.Option(help="KV blocks per worker", min=1)] = 16384,
    block_size: Annotated[int, typer.Option(help="tokens per KV block", min=1)] = 64,
    speedup: Annotated[float, typer.Option(help="arrival speedup: trace gaps are divided by this", min=1e-6)] = 1.0,
    policy: Annotated[Optional[list[Policy]], typer.Option(help="routing policy; repeat to compare")] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML config: routing weights and engine settings", exists=True, dir_okay=False)] = None,
    compare_dynamo: Annotated[bool, typer.Option("--compare-dynamo", help="also run Dynamo's mocker replay (pip install '.[compare]')")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write results as JSON here")] = None,
    plots: Annotated[Optional[Path], typer.Option(help="write PNG plots into this folder")] = None,
    seed: Annotated[int, typer.Option(help="RNG seed (tie-breaks); same seed, same result")] = 0,
    limit: Annotated[Optional[int], typer.Option(help="replay only the first N requests", min=1)] = None,
) -> None:
    """Replay traces through the router, index and simulated engines on a virtual clock."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from thunderagent.sim.bounds import reuse_bounds
    from thunderagent.sim.driver import Simulator
    from thunderagent.sim.traces import TraceError, load_traces

    console = Console(stderr=True)
    policies = policy or [Policy.round_robin, Policy.kv_aware]
    try:
        cfg = load_config(config) if config else Config()
        node = cfg.execution_group.nodes[0].model_copy(update={"kv_blocks": kv_blocks, "block_size": block_size})
        requests = load_traces(trace)
    except (ConfigError, TraceError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if limit:
        requests = sorted(requests, key=lambda r: r.arrival_s)[:limit]
    if compare_dynamo:
        _check_dynamo(trace, limit)
    console.print(f"{len(requests):,} requests, {workers} workers x {kv_blocks} blocks x {block_size} tokens, "
                  f"speedup {speedup}")
    bounds = reuse_bounds(requests, block_size, workers * kv_blocks)
    outcomes, results = [], []
    for pol in policies:
        simulator = Simulator(node, cfg.routing, workers, pol, seed=seed)
        with Progress(TextColumn(f"thunderagent {pol.value}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as prog:
            task = prog.add_task("replay", total=len(requests))
            outcome = simulator.run(requests, speedup, progress=lambda k: prog.advance(task, k))
        outcomes.append(outcome)
        results.append(outcome.result)
        if compare_dynamo and pol in _DYNAMO_MODE:
            from thunderagent.sim.dynamo import run_dynamo

            with console.status(f"dynamo {_DYNAMO_MODE[pol]}"):
                results.append(run_dynamo(trace[0], workers=workers, kv_blocks=kv_blocks, block_size=block_size,
                                          speedup=speedup, router_mode=_DYNAMO_MODE[pol]))
    _report(console, trace, results, outcomes, bounds, json_out, plots,
            {"traces": [str(t) for t in trace], "workers": workers, "kv_blocks": kv_blocks,
             "block_size": block_size, "speedup": speedup, "seed": seed, "requests": len(requests)})


def _check_dynamo(trace: list[Path], limit: int | None) -> None:
    from thunderagent.sim.dynamo import dynamo_available
    from thunderagent.sim.traces import detect_format

    if len(trace) != 1 or detect_format(trace[0]) != "mooncake" or limit:
        typer.echo("error: --compare-dynamo needs exactly one Mooncake JSONL --trace and no --limit "
                   "(Dynamo's replay reads that format only)", err=True)
        raise typer.Exit(2)
    if not dynamo_available():
        typer.echo("error: --compare-dynamo needs ai-dynamo-runtime: pip install -e '.[compare]'", err=True)
        raise typer.Exit(2)


def _report(console: Any, trace: list[Path], results: list[Any], outcomes: list[Any], bounds: Any,
            json_out: Path | None, plots: Path | None, meta: dict[str, object]) -> None:
    """The table on stdout, then the JSON and plot files asked for."""
    from rich.console import Console

    from thunderagent.sim.report import render_table, write_json, write_plots

    speedup = meta["speedup"]
    out_console = Console()
    if not out_console.is_terminal:  # piped to a file: don't squeeze 13 columns into 80
        out_console = Console(width=170)
    render_table(results, bounds, out_console, f"{', '.join(str(t) for t in trace)} — x{speedup}")
    if json_out:
        write_json(json_out, results, bounds, meta)
        console.print(f"wrote {json_out}")
    if plots:
        for p in write_plots(plots, outcomes, results, bounds):
            console.print(f"wrote {p}")



def register(app: typer.Typer) -> None:
    app.command()(sim)
