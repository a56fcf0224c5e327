"""Command line: ``thunderagent serve | sim | explain | top | workers | check-config | frontend | worker |
probe-links``.

One module per command group: :mod:`.serve` (the single-process server and config check),
:mod:`.sim` (trace replay), :mod:`.explain` (decision logs), :mod:`.top` (a live view of a running
server), :mod:`.workers` (its worker endpoints), :mod:`.nats` (the multi-process deployment), :mod:`.probe`
(link measurement).
"""

from __future__ import annotations

import typer

from thunderagent.cli import explain as cli_explain
from thunderagent.cli import nats as cli_nats
from thunderagent.cli import probe as cli_probe
from thunderagent.cli import serve as cli_serve
from thunderagent.cli import sim as cli_sim
from thunderagent.cli import top as cli_top
from thunderagent.cli import workers as cli_workers

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ThunderAgent: KV-cache-aware LLM router.")
cli_serve.register(app)
cli_sim.register(app)
cli_explain.register(app)
cli_nats.register(app)
cli_top.register(app)
cli_workers.register(app)
cli_probe.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
