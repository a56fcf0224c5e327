"""Command line of the multi-process deployment: ``thunderagent frontend`` and ``thunderagent worker``.

Registered on the main Typer app by ``thunderagent.cli``. Needs the ``nats`` extra
(``pip install 'thunderagent[nats]'``); the single-process ``serve`` does not.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from thunderagent.config import ConfigError, Policy
from thunderagent.native import state as native_state

NatsOpt = Annotated[Optional[str], typer.Option(
    "--nats", help="NATS server URL(s), comma separated (default: nats.servers of the config, else nats://127.0.0.1:4222)"
)]
PrefixOpt = Annotated[str, typer.Option(help="subject prefix: deployments sharing one NATS server use different ones")]
ConfigOpt = Annotated[Optional[Path], typer.Option(help="YAML config file (give frontends and workers the same one)",
                                                   exists=True, dir_okay=False)]
LogOpt = Annotated[str, typer.Option(help="debug shows every routing decision")]
AdminOpt = Annotated[Optional[bool], typer.Option(
    "--admin-api/--no-admin-api", help="the operator's /v1/admin/workers endpoints (control_plane.admin_api; off by "
    "default): with API keys on they need an admin key, with keys off anyone reaching the port may use them")]


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def frontend(
    nats: NatsOpt = None,
    host: Annotated[Optional[str], typer.Option(help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option(help="HTTP port (default 8000)", min=0, max=65535)] = None,
    config: ConfigOpt = None,
    policy: Annotated[Optional[Policy], typer.Option(help="routing policy")] = None,
    prefix: PrefixOpt = "ta",
    admin_api: AdminOpt = None,
    log_level: LogOpt = "info",
) -> None:
    """Run an OpenAI-compatible frontend whose workers are discovered over NATS (run several: replicas)."""
    from thunderagent.overrides import build_config
    from thunderagent.bus.connect import connect_options
    from thunderagent.bus.nats import BusError, NatsBus
    from thunderagent.frontend.app import create_app
    from thunderagent.frontend.server import run_frontend
    from thunderagent.assemble import build_nats_fleet, load_tokenizer
    from thunderagent.control.nats_membership import NatsMembership

    _logging(log_level)
    try:
        cfg = build_config(config, host, port, None, None, policy, nats_servers=nats, admin_api=admin_api)
        # real engines: the model's own tokenizer (`model:` in the config), loaded before serving
        tokenizer = load_tokenizer(cfg)
        bus = NatsBus(cfg.nats.servers, "frontend", options=connect_options(cfg.nats))
        fleet = build_nats_fleet(cfg, bus, prefix=prefix, policy=policy)
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    cp = cfg.control_plane
    assert isinstance(fleet.membership, NatsMembership)
    typer.echo(f"ThunderAgent frontend {fleet.membership.frontend_id} on http://{cp.host}:{cp.port}/v1 — workers from {bus.url}")
    typer.echo(native_state().summary)
    try:
        run_frontend(create_app(cfg, fleet=fleet, tokenizer=tokenizer, peers=fleet.membership.peers,
                                shared_limits=fleet.membership.tenants), cp.host, cp.port)
    except BusError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


def worker(
    nats: NatsOpt = None,
    id: Annotated[Optional[str], typer.Option("--id", help="worker id (default <host>-<pid>)")] = None,
    config: ConfigOpt = None,
    node: Annotated[int, typer.Option(help="node group of the config this worker runs", min=0)] = 0,
    endpoint: Annotated[int, typer.Option(help="real engines: which endpoint of the node group", min=0)] = 0,
    speedup: Annotated[
        Optional[float], typer.Option(help="simulated engine time per wall second (default 1.0)", min=0.001)
    ] = None,
    prefix: PrefixOpt = "ta",
    log_level: LogOpt = "info",
    metrics_port: Annotated[Optional[int], typer.Option(
        help="serve this process's own Prometheus metrics on GET /metrics at this port (default: none)",
        min=1, max=65535)] = None,
    metrics_host: Annotated[str, typer.Option(
        help="address the --metrics-port endpoint binds (0.0.0.0 for a scrape from outside the host)")] = "127.0.0.1",
) -> None:
    """Run one worker (a simulated engine, or an attached real engine) on the NATS bus."""
    from thunderagent.overrides import build_config
    from thunderagent.bus.nats import BusError
    from thunderagent.execution.nats_worker import default_worker_id, run_worker

    _logging(log_level)
    wid = id or default_worker_id()
    if metrics_port is None and metrics_host != "127.0.0.1":
        typer.echo("error: --metrics-host needs --metrics-port", err=True)
        raise typer.Exit(2)
    try:
        cfg = build_config(config, speedup=speedup, nats_servers=nats)
        started = None
        if metrics_port is not None:
            from thunderagent.control.worker_metrics import metrics_endpoint

            started = metrics_endpoint(metrics_host, metrics_port)
        asyncio.run(run_worker(cfg, wid, node, endpoint, prefix, on_started=started))
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except BusError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


def register(app: typer.Typer) -> None:
    app.command()(frontend)
    app.command()(worker)
