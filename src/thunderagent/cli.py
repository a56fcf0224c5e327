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
) -> Config:
    """The config file (or the embedded default) with command-line overrides applied on top."""
    cfg = load_config(config) if config else Config()
    data = cfg.model_dump(mode="json")
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
    log_level: Annotated[str, typer.Option(help="debug shows every routing decision")] = "info",
) -> None:
    """Run the OpenAI-compatible frontend, the KV-aware router and the simulated workers in one process."""
    from aiohttp import web

    from thunderagent.server.app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = build_config(config, host, port, workers, speedup, policy)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    cp = cfg.control_plane
    n = sum(node.count for node in cfg.execution_group.nodes)
    typer.echo(f"ThunderAgent on http://{cp.host}:{cp.port}/v1 — {n} simulated workers, policy {cfg.routing.policy.value}")
    web.run_app(create_app(cfg), host=cp.host, port=cp.port, print=None, access_log=None)


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
