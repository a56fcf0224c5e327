"""Reports of simulation runs: a rich table, the JSON file, PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from thunderagent.sim.bounds import Bounds
from thunderagent.sim.driver import SimOutcome
from thunderagent.sim.results import RunResult


def _f(x: float, nd: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"


def render_table(results: Sequence[RunResult], bounds: Bounds | None, console: Console, title: str) -> None:
    t = Table(title=title)
    for col in ("system", "policy", "requests", "TTFT mean", "TTFT p50", "TTFT p99", "ITL mean", "ITL p99", "E2E mean",
                "reuse", "of LRU bound", "recompute", "req/s", "wall s"):
        t.add_column(col, justify="right" if col not in ("system", "policy") else "left")
    for r in results:
        frac = r.prefix_reuse / bounds.global_lru_reuse if bounds and bounds.global_lru_reuse else math.nan
        t.add_row(
            r.system, r.policy, str(r.requests), _f(r.ttft_ms.mean), _f(r.ttft_ms.p50), _f(r.ttft_ms.p99),
            _f(r.itl_ms.mean, 2), _f(r.itl_ms.p99, 1), _f(r.e2e_ms.mean), f"{r.prefix_reuse:.2%}",
            _f(frac * 100, 0) + " %",
            "—" if math.isnan(r.prefill_recompute_rate) else f"{r.prefill_recompute_rate:.2%}",
            _f(r.throughput_rps, 2), _f(r.wall_s, 1),
        )
    console.print(t)
    if bounds is not None:
        console.print(
            f"bounds for this fleet's capacity: global LRU reuse {bounds.global_lru_reuse:.2%}, "
            f"infinite cache {bounds.infinite_cache_reuse:.2%} of {bounds.prompt_tokens:,} prompt tokens"
        )


def write_json(path: Path, results: Sequence[RunResult], bounds: Bounds | None, meta: dict[str, object]) -> None:
    def clean(x: object) -> object:  # JSON has no NaN
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    doc = {
        "meta": meta,
        "runs": [clean(r.to_json()) for r in results],
        "bounds": None if bounds is None else {
            "global_lru_reuse": bounds.global_lru_reuse,
            "infinite_cache_reuse": bounds.infinite_cache_reuse,
            "prompt_tokens": bounds.prompt_tokens,
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))


def write_plots(
    outdir: Path, outcomes: Sequence[SimOutcome], results: Sequence[RunResult], bounds: Bounds | None
) -> list[Path]:
    """TTFT CDF per run, per-worker load over time per run, reuse vs bound. Returns written files."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)

    def save(fig: Any, name: str) -> Path:
        path = outdir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    written = [save(_ttft_cdf(plt, outcomes), "ttft_cdf.png")]
    for o in outcomes:
        if o.load_samples:
            written.append(save(_load_plot(plt, o), f"load_{o.result.policy}.png"))
    written.append(save(_reuse_plot(plt, results, bounds), "reuse_vs_bound.png"))
    return written


def _ttft_cdf(plt: Any, outcomes: Sequence[SimOutcome]) -> Any:
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for o in outcomes:
        xs = np.sort(np.asarray(o.ttft_ms))
        if len(xs):
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{o.result.system} {o.result.policy}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF (ThunderAgent simulator)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _load_plot(plt: Any, o: SimOutcome) -> Any:
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4))
    data = np.asarray(o.load_samples)
    for w in range(data.shape[1]):
        ax.plot(o.load_times, data[:, w], lw=0.7, label=f"worker-{w}")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("running + waiting requests")
    ax.set_title(f"Per-worker load: {o.result.policy}")
    ax.legend(fontsize=7, ncol=4)
    return fig


def _reuse_plot(plt: Any, results: Sequence[RunResult], bounds: Bounds | None) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r.system}\n{r.policy}" for r in results]
    ax.bar(labels, [r.prefix_reuse * 100 for r in results], color="tab:blue")
    if bounds is not None:
        ax.axhline(bounds.global_lru_reuse * 100, color="tab:orange", ls="--", label="global LRU bound")
        ax.axhline(bounds.infinite_cache_reuse * 100, color="tab:red", ls=":", label="infinite cache")
        ax.legend()
    ax.set_ylabel("prefix reuse (% of prompt tokens)")
    ax.set_title("Prefix reuse vs achievable")
    return fig
