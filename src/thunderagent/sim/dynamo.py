"""Adapter for NVIDIA Dynamo's Rust simulator (the "mocker") in offline trace-replay mode.

It runs ``dynamo._core.run_mocker_trace_replay`` from the optional ``ai-dynamo-runtime``
wheel (tested with 1.6.1) on a Mooncake JSONL trace and turns Dynamo's summary into a
:class:`~thunderagent.sim.results.RunResult`, so both simulators can be compared side by side.

The wheel is optional: this module imports without it. Only :func:`dynamo_available` and
:func:`run_dynamo` try to import it, and ``run_dynamo`` raises ``RuntimeError`` when it is absent.

What the replay does (Dynamo 1.6.1, ``dynamo.mocker`` replay mode, read off the released wheel):

* every worker is a vLLM-like mocker engine, ``{"engine": {"block_size": B, "num_gpu_blocks": K}}``,
  with all other engine settings left at Dynamo's defaults;
* arrivals are ``(timestamp - first timestamp) / speedup``; the mocker's engine ``speedup_ratio``
  stays at 1;
* ``round_robin`` is deterministic. ``kv_router`` breaks cost ties at random, so repeated runs
  can differ slightly.

The latency percentiles are Dynamo's own numbers. They come from a DDSketch with 0.1 %
relative accuracy, so they can differ from ``Dist.of`` on the same samples by up to that much.
The means are exact.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from thunderagent.sim.results import Dist, RunResult

#: Router modes the offline replay supports.
ROUTER_MODES: tuple[str, ...] = ("round_robin", "kv_router")

#: Distribution name in our record -> key stem in Dynamo's summary.
_DIST_KEYS: dict[str, str] = {"ttft": "ttft_ms", "itl": "itl_ms", "e2e": "e2e_latency_ms"}

_RECOMPUTE_NOTE = "not reported by Dynamo's replay summary; set to NaN"


def _import_core() -> Any:
    """Import ``dynamo._core``; raise ``ImportError`` when the wheel is missing.

    Dynamo's Rust logger reads ``DYN_LOG`` once, when ``dynamo._core`` is first imported.
    At its default level, ``kv_router`` logs one INFO line per routed request. That floods
    stderr on a full trace and slows the replay, so unless the caller already set ``DYN_LOG``
    we set it to ``warn`` before the first import.
    """
    os.environ.setdefault("DYN_LOG", "warn")
    import importlib

    # import_module (not ``from dynamo import _core``) so sys.modules is authoritative
    return importlib.import_module("dynamo._core")  # optional dependency, imported lazily


def dynamo_available() -> bool:
    """True when ``ai-dynamo-runtime`` is installed and ``run_mocker_trace_replay`` exists."""
    try:
        core = _import_core()
    except Exception:  # noqa: BLE001 - ImportError, or a broken native extension (OSError, ...)
        return False
    return hasattr(core, "run_mocker_trace_replay")


def dynamo_version() -> str | None:
    """Installed version of the ``ai-dynamo-runtime`` distribution, or None."""
    try:
        return metadata.version("ai-dynamo-runtime")
    except metadata.PackageNotFoundError:
        return None


def _num(summary: Mapping[str, Any], key: str) -> float:
    """``summary[key]`` as a float; NaN when it is missing or null (e.g. no samples)."""
    value = summary.get(key)
    return math.nan if value is None else float(value)


def _dist(summary: Mapping[str, Any], stem: str) -> Dist:
    """Read Dynamo's ``mean_/median_/p90_/p99_<stem>`` fields as a :class:`Dist`."""
    return Dist(
        mean=_num(summary, f"mean_{stem}"),
        p50=_num(summary, f"median_{stem}"),
        p90=_num(summary, f"p90_{stem}"),
        p99=_num(summary, f"p99_{stem}"),
    )


def replay_kwargs(
    *,
    workers: int,
    kv_blocks: int,
    block_size: int,
    speedup: float,
    router_mode: str,
    trace_block_size: int = 512,
) -> dict[str, Any]:
    """Keyword arguments that :func:`run_dynamo` passes to ``run_mocker_trace_replay``."""
    return {
        "extra_engine_args": {"engine": {"block_size": int(block_size), "num_gpu_blocks": int(kv_blocks)}},
        "num_workers": int(workers),
        "replay_mode": "offline",
        "router_mode": router_mode,
        "arrival_speedup_ratio": float(speedup),
        "trace_block_size": int(trace_block_size),
        "trace_format": "mooncake",
    }


def run_dynamo(
    trace_path: str | os.PathLike[str],
    *,
    workers: int,
    kv_blocks: int,
    block_size: int,
    speedup: float,
    router_mode: str,
    trace_block_size: int = 512,
    queue_threshold: float | None = None,
    queue_policy: str = "wspt",
    pd: tuple[int, int] | None = None,
    pd_conditional: bool = False,
) -> RunResult:
    """Replay a Mooncake JSONL trace through Dynamo's mocker and summarize it.

    Args:
        trace_path: Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
            ``hash_ids``). Dynamo reads it directly, so no conversion or temp file is needed.
        workers: number of aggregated mocker workers.
        kv_blocks: KV blocks per worker (``num_gpu_blocks``).
        block_size: tokens per KV block in the engine.
        speedup: arrival speedup; trace gaps are divided by this factor.
        router_mode: ``"round_robin"`` or ``"kv_router"``.
        trace_block_size: tokens per trace ``hash_id`` (512 for the Mooncake traces).
        queue_threshold: ``kv_router`` only: Dynamo's router queue on
            (``KvRouterConfig.router_queue_threshold``: requests wait in the router while every
            worker is past this load), None for off (Dynamo's default).
        queue_policy: the queue's order when on: ``fcfs``, ``lcfs`` or ``wspt`` (shortest uncached
            prefill first, Smith's rule).
        pd: ``(P, D)``: the replay's disaggregated mode instead (1.6.1: ``prefill_engine_args`` /
            ``decode_engine_args`` with ``engine.worker_type`` prefill / decode, ``num_prefill_workers``,
            ``num_decode_workers``; every request prefills on the prefill pool); ``workers`` is then unused.
        pd_conditional: with ``pd``: the router's conditional disaggregation at Dynamo's defaults
            (``KvRouterConfig(conditional_disagg_enabled=True)``: policy ``isl_bounding``, a request
            prefills on its decode worker when its effective ISL is under 2,048 tokens and under 0.7 of
            its raw ISL); kv_router only.

    Returns:
        A ``RunResult`` with ``system="dynamo"`` and ``policy=router_mode``. TTFT, ITL and E2E
        are in ms. ITL pools every token gap of every request. ``prefix_reuse`` is Dynamo's
        ``prefix_cache_reused_ratio``. ``prefill_recompute_rate`` is NaN because Dynamo does
        not report it. ``throughput_rps`` is completed requests per simulated second, and
        ``wall_s`` is the measured wall time of the replay call. ``extra`` holds every raw
        summary field, plus ``dynamo_version``, ``replay_args`` and ``trace_path``.

    Raises:
        RuntimeError: ``"dynamo replay failed: ..."`` when the wheel is missing, or when the
            replay rejects its arguments or the trace.
    """
    try:
        core = _import_core()
        replay = core.run_mocker_trace_replay
    except Exception as exc:  # ImportError / AttributeError / broken native library
        raise RuntimeError(
            f"dynamo replay failed: ai-dynamo-runtime is not usable ({exc!r}); "
            "install it with `pip install 'thunderagent[compare]'`"
        ) from exc

    kwargs = replay_kwargs(
        workers=workers,
        kv_blocks=kv_blocks,
        block_size=block_size,
        speedup=speedup,
        router_mode=router_mode,
        trace_block_size=trace_block_size,
    )
    if pd is not None:
        if queue_threshold is not None or (pd_conditional and router_mode != "kv_router"):
            raise ValueError("Dynamo's disaggregated replay: no router queue here; conditional needs kv_router")
        eng = kwargs.pop("extra_engine_args")["engine"]
        del kwargs["num_workers"]
        kwargs.update(prefill_engine_args={"engine": {**eng, "worker_type": "prefill"}},
                      decode_engine_args={"engine": {**eng, "worker_type": "decode"}},
                      num_prefill_workers=int(pd[0]), num_decode_workers=int(pd[1]))
        if pd_conditional:
            kwargs["router_config"] = core.KvRouterConfig(conditional_disagg_enabled=True)
    if queue_threshold is not None:
        if router_mode != "kv_router":
            raise ValueError("Dynamo's router queue needs router_mode='kv_router'")
        kwargs["router_config"] = core.KvRouterConfig(router_queue_threshold=float(queue_threshold),
                                                      router_queue_policy=queue_policy)
    path = os.fspath(Path(trace_path))
    start = time.perf_counter()
    try:
        report = replay([path], **kwargs)
        summary: dict[str, Any] = dict(report.summary)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # Dynamo raises plain Exception/ValueError; Rust panics are BaseException
        raise RuntimeError(f"dynamo replay failed: {exc}") from exc
    wall_s = time.perf_counter() - start

    extra: dict[str, object] = dict(summary)
    shown = {k: v for k, v in kwargs.items() if k != "router_config"}
    if queue_threshold is not None:
        shown["router_config"] = {"router_queue_threshold": queue_threshold, "router_queue_policy": queue_policy}
    if pd_conditional:
        shown["router_config"] = {"conditional_disagg_enabled": True}
    extra.update(
        dynamo_version=dynamo_version(),
        replay_args={"trace_files": [path], **shown},
        trace_path=path,
        prefill_recompute_rate_note=_RECOMPUTE_NOTE,
    )
    result = _result(summary, router_mode, wall_s, extra)
    if queue_threshold is not None:
        result.policy = f"kv_router+queue({queue_policy}, {queue_threshold:g})"
    if pd is not None:
        result.policy = f"{router_mode}+pd{pd[0]}:{pd[1]}:{'conditional' if pd_conditional else 'always'}"
    return result


def _result(summary: dict[str, Any], router_mode: str, wall_s: float, extra: dict[str, object]) -> RunResult:
    """Dynamo's replay summary in our result record."""
    return RunResult(
        system="dynamo",
        policy=router_mode,
        requests=int(summary.get("completed_requests") or 0),
        ttft_ms=_dist(summary, _DIST_KEYS["ttft"]),
        itl_ms=_dist(summary, _DIST_KEYS["itl"]),
        e2e_ms=_dist(summary, _DIST_KEYS["e2e"]),
        prefix_reuse=_num(summary, "prefix_cache_reused_ratio"),
        prefill_recompute_rate=math.nan,
        throughput_rps=_num(summary, "request_throughput_rps"),
        wall_s=wall_s,
        extra=extra,
    )
