"""``thunderagent workers``: the operator's worker endpoints of a running server (``/v1/admin/workers``) from the
command line: list, cordon, uncordon, add, remove, and reset their prefix caches. The server needs
``control_plane.admin_api`` (``--admin-api``); with API keys on, an admin key (``--api-key`` or
``THUNDERAGENT_API_KEY``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from thunderagent.cli.top import ScrapeError, check_base_url, fetch

workers = typer.Typer(no_args_is_help=True, help="List, cordon, uncordon, add or remove a running server's workers "
                      "(its /v1/admin/workers; the server runs with --admin-api).")

UrlOpt = Annotated[str, typer.Option(help="the server's base URL, e.g. http://127.0.0.1:8000",
                                     callback=check_base_url)]
KeyOpt = Annotated[Optional[str], typer.Option(
    envvar="THUNDERAGENT_API_KEY", help="an admin key (control_plane.admin_keys), sent as Authorization: Bearer; "
    "needed when API keys are on")]
PATH = "/v1/admin/workers"


def _call(method: str, url: str, api_key: str | None, body: dict[str, Any] | None = None,
          timeout: float = 30.0) -> Any:
    """The server's JSON answer; its error (OpenAI's shape) printed and the command ended with status 1."""
    try:
        status, raw = fetch(url, api_key, timeout, method, body)
    except ScrapeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if status < 400:
        return json.loads(raw)
    try:
        err = json.loads(raw)["error"]
        what = f"{err['message']}" + (f" (code {err['code']})" if err.get("code") else "")
    except (ValueError, KeyError, TypeError):
        what = raw.decode(errors="replace")[:200]
    typer.echo(f"error: HTTP {status}: {what}", err=True)
    raise typer.Exit(1)


@workers.command("list")
def list_workers(url: UrlOpt, api_key: KeyOpt = None,
                 as_json: Annotated[bool, typer.Option("--json", help="the server's JSON as it came")] = False) -> None:
    """Every worker: group, engine, health, cordon mark, load, requests in flight on the server asked, its URL."""
    data = _call("GET", url + PATH, api_key)["data"]
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    urls = any(w.get("url") for w in data)  # (a simulated fleet, or one over NATS, has none to show)
    table = Table(box=None)
    for name in ("worker", "group", "engine", "health", "routing", "running", "waiting", "in flight",
                 *(("url",) if urls else ())):
        table.add_column(name, no_wrap=True)
    for w in data:
        routing = "cordoned" if w.get("cordoned") else (f"out ({w['out_of_routing']})" if w.get("out_of_routing")
                                                        else "skipped" if w.get("skipped") else "in")
        table.add_row(str(w["id"]), "" if w.get("group") is None else str(w["group"]), str(w.get("engine") or ""),
                      str(w["health"]), routing, str(w["running"]), str(w["waiting"]), str(w["in_flight"]),
                      *((str(w.get("url") or ""),) if urls else ()))
    Console().print(table)


@workers.command()
def cordon(worker: Annotated[str, typer.Argument(help="the worker's id")], url: UrlOpt, api_key: KeyOpt = None) -> None:
    """Take a worker out of routing; its requests in flight finish there."""
    r = _call("POST", f"{url}{PATH}/{worker}/cordon", api_key)
    typer.echo(f"{r['id']} cordoned ({r['in_flight']} requests in flight on it here)")


@workers.command()
def uncordon(worker: Annotated[str, typer.Argument(help="the worker's id")], url: UrlOpt,
             api_key: KeyOpt = None) -> None:
    """Put a cordoned worker back in routing."""
    r = _call("POST", f"{url}{PATH}/{worker}/uncordon", api_key)
    typer.echo(f"{r['id']} back in routing")


@workers.command()
def add(url: UrlOpt, server: Annotated[Optional[str], typer.Option(
            help="the engine server's OpenAI base URL (none: one more simulated engine)")] = None,
        kv_events: Annotated[Optional[str], typer.Option(help="its KV-event PUB endpoint (vLLM / SGLang)")] = None,
        kv_replay: Annotated[Optional[str], typer.Option(help="its replay endpoint")] = None,
        server_api_key_env: Annotated[Optional[str], typer.Option(
            help="the environment variable (of the server process) holding the key the engine server demands")] = None,
        group: Annotated[Optional[int], typer.Option(help="the node group (needed when the config has several)")]
        = None,
        worker_id: Annotated[Optional[str], typer.Option("--id", help="its id (default: the next worker-N)")] = None,
        api_key: KeyOpt = None) -> None:
    """Add a worker to a running `thunderagent serve` (not written to its config file)."""
    body = {k: v for k, v in (("url", server), ("kv_events", kv_events), ("kv_replay", kv_replay),
                              ("api_key_env", server_api_key_env), ("group", group), ("id", worker_id))
            if v is not None}
    r = _call("POST", url + PATH, api_key, body)
    typer.echo(f"{r['id']} added")


@workers.command()
def remove(worker: Annotated[str, typer.Argument(help="the worker's id")], url: UrlOpt,
           force: Annotated[bool, typer.Option("--force", help="move its requests at once instead of waiting")]
           = False,
           timeout: Annotated[float, typer.Option(help="seconds to wait for its requests to finish", min=0,
                                                  max=3600)] = 30.0,
           api_key: KeyOpt = None) -> None:
    """Cordon a worker of a `thunderagent serve`, let its requests finish (or move them: --force), remove it."""
    r = _call("POST", f"{url}{PATH}/{worker}/remove", api_key, {"force": force, "timeout_s": timeout},
              timeout=timeout + 30)
    moved = f", {r['requests_moved']} requests moved to other workers" if r["requests_moved"] else ""
    typer.echo(f"{r['id']} removed{moved}")


@workers.command("reset-cache")
def reset_cache(url: UrlOpt, worker: Annotated[Optional[list[str]], typer.Argument(
                    help="the workers' ids (none: every worker)")] = None,
                running: Annotated[bool, typer.Option(
                    "--running", help="also the blocks of running requests (vLLM preempts them)")] = False,
                external: Annotated[bool, typer.Option(
                    "--external", help="also a KV connector's cache (vLLM's reset_external)")] = False,
                api_key: KeyOpt = None) -> None:
    """Empty the workers' prefix caches (after a weight update: their KV is stale); the index follows. Status 1
    unless every one of them reset."""
    body: dict[str, Any] = {"reset_running_requests": running, "reset_external": external}
    if worker:
        body["workers"] = worker
    r = _call("POST", url + "/v1/admin/reset_prefix_cache", api_key, body, timeout=60)
    for w in r["workers"]:
        typer.echo(f"{w['id']}: " + ("reset" if w["success"] else f"not reset: {w.get('error')}"))
    if not r["success"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(workers, name="workers")
