"""``thunderagent workers``: the operator's worker endpoints of a running server (``/v1/admin/workers``) from the
command line: list, cordon, uncordon, add, remove, reset their prefix caches, load and unload LoRA adapters,
pause and resume their generation, put them to sleep and wake them. The server needs ``control_plane.admin_api``
(``--admin-api``); with API keys on, an admin key (``--api-key`` or ``THUNDERAGENT_API_KEY``)."""

from __future__ import annotations

import json
from urllib.parse import urlencode
from typing import Annotated, Any, NoReturn, Optional

import typer

from thunderagent.cli.top import ScrapeError, check_base_url, fetch

workers = typer.Typer(no_args_is_help=True, help="List, cordon, uncordon, add or remove a running server's workers "
                      "(its /v1/admin/workers; the server runs with --admin-api).")

UrlOpt = Annotated[str, typer.Option(help="the server's base URL, e.g. http://127.0.0.1:8000",
                                     callback=check_base_url)]
WorkersOpt = Annotated[Optional[list[str]], typer.Option("--worker", help="only this worker (repeat; default: all)")]
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
    _refused(status, raw)


def _refused(status: int, raw: bytes) -> NoReturn:
    """The server's error (OpenAI's shape) printed; the command ends with status 1."""
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
    adapters = any(w.get("adapters") for w in data)
    table = Table(box=None)
    for name in ("worker", "group", "engine", "health", "routing", "running", "waiting", "in flight",
                 *(("url",) if urls else ()), *(("adapters",) if adapters else ())):
        table.add_column(name, no_wrap=True)
    for w in data:
        routing = "cordoned" if w.get("cordoned") else (f"out ({w['out_of_routing']})" if w.get("out_of_routing")
                                                        else "skipped" if w.get("skipped")
                                                        else "asleep (last)" if w.get("asleep")
                                                        else "paused (last)" if w.get("paused") else "in")
        table.add_row(str(w["id"]), "" if w.get("group") is None else str(w["group"]), str(w.get("engine") or ""),
                      str(w["health"]), routing, str(w["running"]), str(w["waiting"]), str(w["in_flight"]),
                      *((str(w.get("url") or ""),) if urls else ()),
                      *((", ".join(w.get("adapters") or ()),) if adapters else ()))
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
    handed = r.get("prefixes_handed_off") or 0  # (an older server does not say)
    kept = f", {handed} cached prefixes copied to other workers" if handed else ""
    typer.echo(f"{r['id']} removed{moved}{kept}")


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
    _per_worker(r["workers"], "reset")
    if not r["success"]:
        raise typer.Exit(1)


@workers.command()
def pause(url: UrlOpt, mode: Annotated[str, typer.Option(
              help="abort: end the servers' requests in flight; wait: let them finish; keep: freeze them")] = "abort",
          keep_cache: Annotated[bool, typer.Option("--keep-cache", help="do not clear the servers' caches")] = False,
          worker: WorkersOpt = None, api_key: KeyOpt = None) -> None:
    """Pause the generation of every server, or those named (vLLM's /pause: an RL trainer's weight update; a rolling
    one, a part at a time); a paused server gets requests only while no other can take them. Status 1 unless every
    one of them paused."""
    if mode not in ("abort", "wait", "keep"):
        raise typer.BadParameter(f"one of abort, wait, keep; got {mode!r}", param_hint="'--mode'")
    query = urlencode([("mode", mode), ("clear_cache", "false" if keep_cache else "true"),
                       *(("workers", w) for w in worker or ())])
    _fleet_call(f"{url}/pause?{query}", api_key, None, None, "paused")


@workers.command()
def resume(url: UrlOpt, worker: WorkersOpt = None, api_key: KeyOpt = None) -> None:
    """Resume the generation of every server, or those named (vLLM's /resume)."""
    query = urlencode([("workers", w) for w in worker or ()])
    _fleet_call(f"{url}/resume" + (f"?{query}" if query else ""), api_key, None, None, "resumed")


@workers.command()
def sleep(url: UrlOpt, level: Annotated[int, typer.Option(
              min=0, max=2, help="0: pause scheduling; 1: also offload the weights, discard the KV cache; 2: discard "
              "both")] = 1,
          mode: Annotated[str, typer.Option(
              help="abort: end the servers' requests in flight; wait: let them finish; keep: freeze them")] = "abort",
          worker: WorkersOpt = None, api_key: KeyOpt = None) -> None:
    """Put the fleet's servers to sleep (vLLM's /sleep, VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode): routing
    sends requests to a sleeping server only while no awake one can take them. Status 1 unless every one slept."""
    if mode not in ("abort", "wait", "keep"):
        raise typer.BadParameter(f"one of abort, wait, keep; got {mode!r}", param_hint="'--mode'")
    query = urlencode([("level", level), ("mode", mode), *(("workers", w) for w in worker or ())])
    _fleet_call(f"{url}/sleep?{query}", api_key, None, None, "asleep")


@workers.command("wake-up")
def wake_up(url: UrlOpt, tag: Annotated[Optional[list[str]], typer.Option(
                "--tag", help="wake only this part (weights, kv_cache, scheduling; repeat; default: all)")] = None,
            worker: WorkersOpt = None, api_key: KeyOpt = None) -> None:
    """Wake the fleet's servers (vLLM's /wake_up); a server woken whole is back in routing. Status 1 unless every one
    of them woke (a partial wake-up, with --tag, says so per worker)."""
    for t in tag or ():
        if t not in ("weights", "kv_cache", "scheduling"):
            raise typer.BadParameter(f"one of weights, kv_cache, scheduling; got {t!r}", param_hint="'--tag'")
    query = urlencode([*(("tags", t) for t in tag or ()), *(("workers", w) for w in worker or ())])
    _fleet_call(f"{url}/wake_up" + (f"?{query}" if query else ""), api_key, None, None, "awake")


@workers.command("load-adapter")
def load_adapter(name: Annotated[str, typer.Argument(help="the adapter's name (the model name clients send)")],
                 path: Annotated[str, typer.Argument(help="its directory, as the servers see it")], url: UrlOpt,
                 worker: WorkersOpt = None,
                 inplace: Annotated[bool, typer.Option("--inplace", help="replace an adapter of that name")] = False,
                 api_key: KeyOpt = None) -> None:
    """Load a LoRA adapter on the fleet's servers (vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); status 1 unless
    every one of them did."""
    body: dict[str, Any] = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
    _fleet_call(url + "/v1/load_lora_adapter", api_key, body, worker, "loaded")


@workers.command("unload-adapter")
def unload_adapter(name: Annotated[str, typer.Argument(help="the adapter's name")], url: UrlOpt,
                   worker: WorkersOpt = None, api_key: KeyOpt = None) -> None:
    """Unload a LoRA adapter from the fleet's servers; status 1 unless every one of them did."""
    _fleet_call(url + "/v1/unload_lora_adapter", api_key, {"lora_name": name}, worker, "unloaded")


def _fleet_call(url: str, api_key: str | None, body: dict[str, Any] | None, worker: list[str] | None,
                done: str) -> None:
    """A call answered with each worker's answer (printed, one line each); status 1 unless all of them did it."""
    if worker and body is not None:
        body["workers"] = worker
    try:
        status, raw = fetch(url, api_key, 60.0, "POST", body)
    except ScrapeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or "workers" not in answer:  # ours (bad input, the switch): as any refusal
        _refused(status, raw)
    _per_worker(answer["workers"], done)
    if status != 200:
        raise typer.Exit(1)


def _per_worker(answers: list[dict[str, Any]], done: str) -> None:
    for w in answers:
        status = w.get("answer", {}).get("status") if isinstance(w.get("answer"), dict) else None
        said = f" ({status})" if done == "awake" and status == "sleeping" else ""  # (a partial wake-up)
        typer.echo(f"{w['id']}: " + (done + said if w["success"] else f"not {done}: {w.get('error')}"))


def register(app: typer.Typer) -> None:
    app.add_typer(workers, name="workers")
