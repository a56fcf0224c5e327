"""``thunderagent top``: a live terminal view of a running server, from its ``/health`` and ``/metrics``."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Annotated, Optional

import typer
from rich.console import Group

from thunderagent.cli.top_view import HOT_FACTOR, HOT_MIN_QUEUE, Scrape, build_frame, parse_metrics, render


class ScrapeError(Exception):
    pass


def fetch(url: str, api_key: str | None, timeout: float, method: str = "GET",
          body: object = None) -> tuple[int, bytes]:
    """A server's answer, whatever its status (``body``: sent as JSON); ScrapeError when none came."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (the operator's own URL)
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:  # /health answers 503 with its body when no worker is healthy
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise ScrapeError(f"{url}: {exc}") from exc


def check_base_url(url: str) -> str:
    """``--url`` checked: an http(s) URL with a host (urllib would take a bare ``host:port`` for a scheme)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise typer.BadParameter(f"{url!r} is not an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000",
                                 param_hint="'--url'")
    return url.strip().rstrip("/")


def _metrics_path(path: str) -> str:
    if not path.startswith("/"):
        raise typer.BadParameter(f"{path!r} must start with '/', e.g. /metrics", param_hint="'--metrics-path'")
    return path


def scrape(base: str, api_key: str | None, metrics_path: str = "/metrics", timeout: float = 5.0) -> Scrape:
    status, body = fetch(f"{base}/health", api_key, timeout)
    if status in (401, 403):
        raise ScrapeError(f"/health: HTTP {status}: {body.decode(errors='replace')[:200]}")
    try:
        health = json.loads(body)
    except ValueError:
        health = None
    if status not in (200, 503) or not isinstance(health, dict):  # 503: no worker healthy, with the same body
        raise ScrapeError(f"{base}/health: HTTP {status}, not a ThunderAgent health report: "
                          f"{body.decode(errors='replace')[:200]!r}")
    if "workers" not in health:
        raise ScrapeError("/health has no per-worker detail: API keys are on; pass an admin key "
                          "(--api-key or THUNDERAGENT_API_KEY)")
    status, body = fetch(f"{base}{metrics_path}", api_key, timeout)
    if status != 200:
        hint = " (needs an admin key: --api-key or THUNDERAGENT_API_KEY)" if status in (401, 403) else ""
        raise ScrapeError(f"{metrics_path}: HTTP {status}: {body.decode(errors='replace')[:200]}{hint}")
    try:
        samples = parse_metrics(body.decode(errors="replace"))
    except ValueError as exc:  # not Prometheus text (another server, a proxy's error page)
        raise ScrapeError(f"{base}{metrics_path}: not Prometheus metrics: {exc}") from exc
    return Scrape(time.monotonic(), health, samples)


def top(
    url: Annotated[str, typer.Option(help="the server's base URL, e.g. http://127.0.0.1:8000",
                                     callback=check_base_url)],
    api_key: Annotated[Optional[str], typer.Option(
        envvar="THUNDERAGENT_API_KEY", help="an admin key (control_plane.admin_keys), sent as Authorization: "
        "Bearer; needed for /health's detail and /metrics when API keys are on")] = None,
    interval: Annotated[float, typer.Option(help="seconds between refreshes (and the window of rates and "
                                                 "percentiles)", min=0.05)] = 2.0,
    once: Annotated[bool, typer.Option(
        "--once", help="print one frame and exit (two scrapes --interval apart)")] = False,
    metrics_path: Annotated[str, typer.Option(help="where the server exports Prometheus metrics",
                                              callback=_metrics_path)] = "/metrics",
    hot_factor: Annotated[float, typer.Option(help="a worker is hot when its queue exceeds this x the median",
                                              min=1.0)] = HOT_FACTOR,
    hot_min: Annotated[int, typer.Option(help="... and at least this many requests wait on it", min=1)] = HOT_MIN_QUEUE,
) -> None:
    """Live view of the fleet: per worker health, load, KV use, queue (the hot worker highlighted);
    the fleet's TTFT/ITL percentiles, decisions per second and cache rates."""
    from rich.console import Console
    from rich.live import Live

    base = url  # checked by check_base_url
    console = Console()
    # Ctrl-C (SIGINT) ends the live view even when we were started from a script that runs its jobs
    # in the background: such a shell starts them with SIGINT ignored, and Python keeps an ignored
    # SIGINT, so the view would never end
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def frame(prev: Scrape | None) -> tuple[Scrape, Group]:
        cur = scrape(base, api_key, metrics_path)
        return cur, render(build_frame(cur, prev, hot_factor, hot_min), base)

    try:
        prev, view = frame(None)
        if once:
            time.sleep(interval)
            console.print(frame(prev)[1])
            return
        with Live(view, console=console, auto_refresh=False, screen=console.is_terminal) as live:
            while True:
                time.sleep(interval)
                prev, view = frame(prev)
                live.update(view, refresh=True)
    except ScrapeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except KeyboardInterrupt:
        return


def register(app: typer.Typer) -> None:
    app.command()(top)
