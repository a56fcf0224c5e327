"""``thunderagent explain --log FILE``: summarise a decision log (``observe/decision_summary.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer


def explain(
    log: Annotated[list[Path], typer.Option(
        "--log", help="decision log (control_plane.decision_log.path, or `sim --decision-log`); its rotated files "
        "(FILE.1, FILE.2, ...) are read too; repeat to merge", exists=True, dir_okay=False)],
    json_out: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Why requests went where they did: decisions by reason, cache hits and misses, workers skipped."""
    import msgspec

    from thunderagent.observe.decision_summary import LogError, log_files, read_lines, summarise

    files = log_files(log)
    try:
        runs = summarise(read_lines(files))
    except LogError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if json_out:
        out = {"files": [str(f) for f in files], "runs": runs}
        typer.echo(msgspec.json.format(msgspec.json.encode(out)).decode())
        return
    _render(files, runs)


def _render(files: list[Path], runs: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"{len(files)} file(s): " + ", ".join(str(f) for f in files))
    if not runs:
        console.print("no decisions logged")
    for name, s in runs.items():
        n = s["decisions"]
        console.rule(f"{name}: {n:,} decisions, {s['requests']:,} requests, {s['retries']:,} routed again")
        c, r = s["cache"], s["cache_rates"]
        console.print(f"cache: hit {c['hit']:,} ({r.get('hit', 0):.1%}) · elsewhere {c['elsewhere']:,} "
                      f"({r.get('elsewhere', 0):.1%}) · miss everywhere {c['miss']:,} ({r.get('miss', 0):.1%})")
        tok = s["tokens"]
        console.print(f"prompt tokens {tok['prompt']:,}: predicted cached {tok['predicted_cached']:,}, "
                      f"best known anywhere {tok['best_known_cached']:,}; queue wait mean "
                      f"{s['queue_wait_s']['mean']:.3f} s max {s['queue_wait_s']['max']:.3f} s, "
                      f"{s['queue_wait_s']['sent_ahead_for_cache']:,} sent ahead for their cache")
        _table(console, Table, "went elsewhere: why", ("why", "decisions"), s["elsewhere_why"].items())
        _table(console, Table, "decisions by reason", ("reason", "decisions"), s["by_reason"].items())
        rows = [(w, x["chosen"], x["busy_filtered"], "; ".join(f"{k} ×{v}" for k, v in x["skipped"].items()) or "—")
                for w, x in s["workers"].items()]
        _table(console, Table, "workers", ("worker", "chosen", "busy-filtered", "skipped (why)"), rows)


def _table(console: Any, table_cls: Any, title: str, cols: tuple[str, ...], rows: Any) -> None:
    rows = list(rows)
    if not rows:
        return
    t = table_cls(title=title, title_justify="left")
    for k, col in enumerate(cols):
        t.add_column(col, justify="left" if k in (0, len(cols) - 1) and not col.startswith("dec") else "right")
    for row in rows:
        t.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in row))
    console.print(t)


def register(app: typer.Typer) -> None:
    app.command()(explain)
