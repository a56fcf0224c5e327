"""``thunderagent serve`` (one process: frontend, router and workers) and ``check-config``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from thunderagent.cli.nats import AdminOpt
from thunderagent.config import ConfigError, Policy, load_config
from thunderagent.native import state as native_state
from thunderagent.overrides import build_config


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
    engine: Annotated[Optional[str], typer.Option(
        help="engine of the --worker servers: vllm (default), sglang, or openai (any OpenAI-compatible server, "
             "no KV events: --worker URL)")] = None,
    worker: Annotated[Optional[list[str]], typer.Option(
        help="an engine server: URL=EVENTS[,REPLAY], e.g. http://127.0.0.1:8101=tcp://127.0.0.1:5571,"
             "tcp://127.0.0.1:5572 (repeat per server)")] = None,
    block_size: Annotated[Optional[int], typer.Option(
        help="KV block size in tokens: must equal the engines' --block-size", min=1)] = None,
    relay: Annotated[Optional[str], typer.Option(
        help="vllm/sglang: which requests go to the servers with the client's body: unmodelled (default: those "
             "with tools, logprobs... that the token path lacks), all, or off (those are a 400)")] = None,
    worker_api_key_env: Annotated[Optional[str], typer.Option(
        help="environment variable holding the API key the --worker servers demand (their --api-key): sent as "
             "Authorization: Bearer")] = None,
    admin_api: AdminOpt = None,
    log_level: Annotated[str, typer.Option(help="debug shows every routing decision")] = "info",
) -> None:
    """Run the OpenAI-compatible frontend and the KV-aware router in one process, in front of simulated
    workers or of real engine servers (--model DIR --worker URL=EVENTS ...)."""
    from thunderagent.frontend.app import create_app
    from thunderagent.frontend.server import run_frontend

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if engine is not None and engine not in ("vllm", "sglang", "openai", "simulated"):
            raise ConfigError(f"--engine must be vllm, sglang or openai, got {engine!r}")
        cfg = build_config(config, host, port, workers, speedup, policy, model=model, engine=engine,
                           worker_endpoints=worker, block_size=block_size, relay=relay,
                           worker_api_key_env=worker_api_key_env, admin_api=admin_api)
        if cfg.nats.index != "replica":
            raise ConfigError("nats.index: sharded splits the index between `thunderagent frontend` replicas; "
                              "`serve` is one process with the whole index: remove it")
        application = create_app(cfg)  # loads the model's tokenizer (before serving)
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    cp = cfg.control_plane
    kinds = sorted({node.engine for node in cfg.execution_group.nodes})
    n = sum(node.count for node in cfg.execution_group.nodes)
    typer.echo(f"ThunderAgent on http://{cp.host}:{cp.port}/v1 — {n} {'/'.join(kinds)} workers, "
               f"model {cfg.model_name}, policy {cfg.routing.policy.value}")
    typer.echo(native_state().summary)
    run_frontend(application, cp.host, cp.port)  # with the control plane's connection limits


def check_config(path: Annotated[Path, typer.Argument(exists=True, dir_okay=False)]) -> None:
    """Validate a YAML config file and print it with defaults filled in."""
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    import yaml

    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))




def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command("check-config")(check_config)
