"""Command line: ``thunderagent serve`` (more subcommands come with later planes)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from thunderagent.config import Config, ConfigError, Policy, load_config, parse_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ThunderAgent: KV-cache-aware LLM router.")


def build_config(
    config: Path | None,
    host: str | None = None,
    port: int | None = None,
    workers: int | None = None,
    speedup: float | None = None,
    policy: Policy | None = None,
    *,
    model: str | None = None,
    engine: str | None = None,
    worker_endpoints: list[str] | None = None,
    block_size: int | None = None,
) -> Config:
    """The config file (or the embedded default) with command-line overrides applied on top.

    ``worker_endpoints`` (``--worker URL[=EVENTS[,REPLAY]]``) replace the node groups by one group of
    real ``engine`` servers; ``model`` is the local model directory they serve."""
    cfg = load_config(config) if config else Config()
    data = cfg.model_dump(mode="json")
    if model is not None:
        data["model"] = model
        if data["model_name"] == Config.model_fields["model_name"].default:
            data["model_name"] = model  # what vLLM calls it by default: clients keep their model name
    if worker_endpoints:
        if workers is not None:
            raise ConfigError("--workers counts simulated workers; with --worker the servers are the workers")
        data["execution_group"]["nodes"] = [{
            "engine": engine or "vllm",
            "endpoints": [parse_worker_endpoint(w) for w in worker_endpoints],
            "block_size": block_size or data["execution_group"]["nodes"][0]["block_size"],
        }]
    elif engine is not None and engine != "simulated":
        raise ConfigError(f"--engine {engine} needs at least one --worker URL=EVENTS (or endpoints in --config)")
    elif block_size is not None:
        for node in data["execution_group"]["nodes"]:
            node["block_size"] = block_size
    if host is not None:
        data["control_plane"]["host"] = host
    if port is not None:
        data["control_plane"]["port"] = port
    if workers is not None:
        if len(data["execution_group"]["nodes"]) != 1:
            raise ConfigError("--workers only applies to a config with one node group; set counts in the file")
        data["execution_group"]["nodes"][0]["count"] = workers
    if speedup is not None:
        data["simulation"]["speedup"] = speedup
    if policy is not None:
        data["routing"]["policy"] = policy.value
    return parse_config(data, str(config) if config else "<command line>")


def parse_worker_endpoint(spec: str) -> dict[str, str]:
    """``URL[=EVENTS[,REPLAY]]``: the engine's OpenAI base URL, its KV-event PUB endpoint and its
    replay endpoint, e.g. ``http://127.0.0.1:8101=tcp://127.0.0.1:5571,tcp://127.0.0.1:5572``."""
    url, _, zmq = spec.partition("=")
    events, _, replay = zmq.partition(",")
    out = {"url": url}
    if events:
        out["kv_events"] = events
    if replay:
        out["kv_replay"] = replay
    return out


@app.command()
def serve(
    host: Annotated[Optional[str], typer.Option(help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option(help="HTTP port (default 8000)", min=0, max=65535)] = None,
    workers: Annotated[Optional[int], typer.Option(help="number of simulated workers (default 4)", min=1)] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML config file", exists=True, dir_okay=False)] = None,
    policy: Annotated[Optional[Policy], typer.Option(help="routing policy")] = None,
    speedup: Annotated[
        Optional[float], typer.Option(help="simulated engine time per wall second (default 1.0)", min=0.001)
    ] = None,
    model: Annotated[Optional[str], typer.Option(
        help="local model directory the engines serve (tokenizer + chat template; needs the engines extra)")] = None,
    engine: Annotated[Optional[str], typer.Option(help="engine of the --worker servers: vllm (default) or sglang")] = None,
    worker: Annotated[Optional[list[str]], typer.Option(
        help="an engine server: URL=EVENTS[,REPLAY], e.g. http://127.0.0.1:8101=tcp://127.0.0.1:5571,"
             "tcp://127.0.0.1:5572 (repeat per server)")] = None,
    block_size: Annotated[Optional[int], typer.Option(
        help="KV block size in tokens: must equal the engines' --block-size", min=1)] = None,
    log_level: Annotated[str, typer.Option(help="debug shows every routing decision")] = "info",
) -> None:
    """Run the OpenAI-compatible frontend and the KV-aware router in one process, in front of simulated
    workers or of real engine servers (--model DIR --worker URL=EVENTS ...)."""
    from aiohttp import web

    from thunderagent.server.app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if engine is not None and engine not in ("vllm", "sglang", "simulated"):
            raise ConfigError(f"--engine must be vllm or sglang, got {engine!r}")
        cfg = build_config(config, host, port, workers, speedup, policy, model=model, engine=engine,
                           worker_endpoints=worker, block_size=block_size)
        application = create_app(cfg)  # loads the model's tokenizer (before serving)
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    cp = cfg.control_plane
    kinds = sorted({node.engine for node in cfg.execution_group.nodes})
    n = sum(node.count for node in cfg.execution_group.nodes)
    typer.echo(f"ThunderAgent on http://{cp.host}:{cp.port}/v1 — {n} {'/'.join(kinds)} workers, "
               f"model {cfg.model_name}, policy {cfg.routing.policy.value}")
    web.run_app(application, host=cp.host, port=cp.port, print=None, access_log=None)


_DYNAMO_MODE = {Policy.round_robin: "round_robin", Policy.kv_aware: "kv_router"}


@app.command()
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
    from thunderagent.sim.report import render_table, write_json, write_plots
    from thunderagent.sim.traces import TraceError, detect_format, load_traces

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
        if len(trace) != 1 or detect_format(trace[0]) != "mooncake" or limit:
            typer.echo("error: --compare-dynamo needs exactly one Mooncake JSONL --trace and no --limit "
                       "(Dynamo's replay reads that format only)", err=True)
            raise typer.Exit(2)
        from thunderagent.sim.dynamo import dynamo_available

        if not dynamo_available():
            typer.echo("error: --compare-dynamo needs ai-dynamo-runtime: pip install -e '.[compare]'", err=True)
            raise typer.Exit(2)
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
    out_console = Console()
    if not out_console.is_terminal:  # piped to a file: don't squeeze 13 columns into 80
        out_console = Console(width=170)
    render_table(results, bounds, out_console, f"{', '.join(str(t) for t in trace)} — x{speedup}")
    meta = {"traces": [str(t) for t in trace], "workers": workers, "kv_blocks": kv_blocks, "block_size": block_size,
            "speedup": speedup, "seed": seed, "requests": len(requests)}
    if json_out:
        write_json(json_out, results, bounds, meta)
        console.print(f"wrote {json_out}")
    if plots:
        for p in write_plots(plots, outcomes, results, bounds):
            console.print(f"wrote {p}")


@app.command("check-config")
def check_config(path: Annotated[Path, typer.Argument(exists=True, dir_okay=False)]) -> None:
    """Validate a YAML config file and print it with defaults filled in."""
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    import yaml

    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


from thunderagent import cli_nats  # noqa: E402  (`frontend` and `worker`: the NATS deployment)

cli_nats.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
