"""``thunderagent sim``: replay traces through the router, index and simulated engines."""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from thunderagent.config import Config, ConfigError, IdleResume, PacingAccounting, Policy, ResumePlacement, load_config
from thunderagent.config.transfer import sim_fields_set
from thunderagent.sim.replay_config import replay_routing


_DYNAMO_MODE = {Policy.round_robin: "round_robin", Policy.kv_aware: "kv_router"}


class SchedulerMode(str, Enum):
    off = "off"
    on = "on"


class DynamoQueuePolicy(str, Enum):
    fcfs = "fcfs"
    lcfs = "lcfs"
    wspt = "wspt"


class PdMode(str, Enum):
    always = "always"
    conditional = "conditional"
    never = "never"


class PacingMode(str, Enum):
    off = "off"
    paper = "paper"  # the paper's accounting (every program in full), placement (most free), not work-conserving
    ours = "ours"  # the config's scheduler.pacing section (default: shared prefixes once, placed where cached)
    cached = "cached"  # ours, an idle worker taking the paused program whose blocks it holds (idle_resume: cached)

_CLOSED_LOOP_HELP = ("closed loop: issue each session's requests one after another, the next one its recorded think "
                     "time (else the trace's gap, never earlier) after the previous one finished; requests without a "
                     "session keep their trace times. Reports sessions, steps/min, session completion, Jain fairness")


class Traffic(str, Enum):
    chat = "chat"
    agents = "agents"


_PER_WORKER, _RATE = 40, 1.0  # --generate's defaults: requests per worker, arrivals per worker per second


def sim(
    trace: Annotated[Optional[list[Path]], typer.Option(help="trace file or folder (Mooncake JSONL, kv-cache-tester JSON); repeat to merge", exists=True)] = None,
    generate: Annotated[Optional[Traffic], typer.Option(
        help="instead of --trace: synthetic traffic scaled to --workers (the same load per worker at any fleet "
             "size): chat (5-turn conversations sharing a 1,024-token system prompt) or agents (10-step agent "
             "programs sharing an 8,192-token tool prompt)")] = None,
    requests_per_worker: Annotated[Optional[int], typer.Option(
        help="with --generate: requests per worker (whole sessions) [default: 40]", min=1)] = None,
    rate_per_worker: Annotated[Optional[float], typer.Option(
        help="with --generate: mean arrivals per worker per second [default: 1.0]", min=1e-6)] = None,
    workers: Annotated[int, typer.Option(help="simulated workers", min=1)] = 8,
    kv_blocks: Annotated[int, typer.Option(help="KV blocks per worker", min=1)] = 16384,
    block_size: Annotated[int, typer.Option(help="tokens per KV block", min=1)] = 64,
    speedup: Annotated[float, typer.Option(help="arrival speedup: trace gaps are divided by this", min=1e-6)] = 1.0,
    policy: Annotated[Optional[list[Policy]], typer.Option(help="routing policy; repeat to compare")] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML config: routing weights and engine settings", exists=True, dir_okay=False)] = None,
    compare_dynamo: Annotated[bool, typer.Option("--compare-dynamo", help="also run Dynamo's mocker replay (pip install '.[compare]')")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write results as JSON here")] = None,
    plots: Annotated[Optional[Path], typer.Option(help="write PNG plots into this folder")] = None,
    seed: Annotated[int, typer.Option(help="RNG seed (tie-breaks); same seed, same result")] = 0,
    limit: Annotated[Optional[int], typer.Option(help="replay only the first N requests", min=1)] = None,
    closed_loop: Annotated[bool, typer.Option("--closed-loop", help=_CLOSED_LOOP_HELP)] = False,
    scheduler: Annotated[Optional[list[SchedulerMode]], typer.Option(
        help="the holding queue (the config's `scheduler:` section) off or on; repeat for side-by-side rows "
             "(default: as the config says)")] = None,
    pacing: Annotated[Optional[list[PacingMode]], typer.Option(
        help="agent-program pacing (scheduler.pacing; programs are the trace's sessions): off, paper (the ThunderAgent "
             "paper's accounting and placement), ours (the config's pacing section) or cached (ours with "
             "work_conserving and idle_resume: cached); repeat for side-by-side rows "
             "(default: as the config says)")] = None,
    dynamo_queue_threshold: Annotated[float, typer.Option(
        help="with --compare-dynamo and --scheduler on: Dynamo's kv_router is also run with its router queue on at "
             "this threshold (KvRouterConfig.router_queue_threshold)", min=0)] = 2.0,
    dynamo_queue_policy: Annotated[DynamoQueuePolicy, typer.Option(
        help="the order of Dynamo's router queue in that row")] = DynamoQueuePolicy.wspt,
    horizon: Annotated[Optional[float], typer.Option(
        help="stop at this many virtual seconds: what finished by then counts (closed-loop rates are per it)",
        min=1e-6)] = None,
    think_cap: Annotated[Optional[float], typer.Option(
        help="closed loop: cap each recorded think time at this many seconds (agentic traces record human idle "
             "time, up to hours, between tool-driven turns)", min=0)] = None,
    decision_log: Annotated[Optional[Path], typer.Option(
        help="write every routing decision here as JSON lines (overwritten; the config's control_plane.decision_log "
             "sampling and rotation apply; each line's `run` names its row); summarise with `thunderagent explain "
             "--log`", dir_okay=False)] = None,
    planner: Annotated[bool, typer.Option(
        "--planner", help="the config's scaling planner (planner: enabled) acts: start at planner.min_workers, up to "
        "--workers (README: Scaling planner)")] = False,
    planner_startup_s: Annotated[float, typer.Option(help="with --planner: seconds a started worker takes to join",
                                                     min=0)] = 60.0,
    pd: Annotated[Optional[str], typer.Option(
        help="prefill/decode disaggregation: P:D = P prefill + D decode workers of the node's size (replaces "
             "--workers); the transfer plane from the config's role prefill group's kv_cache_transfer, else its "
             "defaults")] = None,
    pd_mode: Annotated[Optional[list[PdMode]], typer.Option(
        help="with --pd: routing.disaggregation.mode; repeat for side-by-side rows (default: the config's)")] = None,
    pd_slow_link: Annotated[float, typer.Option(
        help="with --pd, fault injection: transfers take this many times the configured link's time", min=1e-6)] = 1.0,
    pd_interrupt: Annotated[float, typer.Option(
        help="with --pd, fault injection: probability that a transfer fails halfway", min=0, max=1)] = 0.0,
    pd_target_full: Annotated[float, typer.Option(
        help="with --pd, fault injection: probability that the decode worker looks full when a transfer starts",
        min=0, max=1)] = 0.0,
) -> None:
    """Replay traces through the router, index and simulated engines on a virtual clock."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from thunderagent.sim.bounds import reuse_bounds
    from thunderagent.sim.driver import Simulator
    from thunderagent.sim.traces import TraceError

    console = Console(stderr=True)
    policies = policy or [Policy.round_robin, Policy.kv_aware]
    try:
        cfg = load_config(config) if config else Config()
        # the node shape: the first group that decodes (a role prefill group shapes --pd's prefill workers)
        nodes = cfg.execution_group.nodes
        shape = {"kv_blocks": kv_blocks, "block_size": block_size}
        node = next((n for n in nodes if n.role.value != "prefill"), nodes[0]).model_copy(update=shape)
        if not cfg.routing.fallback_to_local and (pd is None or any(m is not PdMode.always for m in pd_mode or [])):
            raise ConfigError(f"{config}: routing.fallback_to_local: false (strict disaggregation) needs --pd P:D "
                              "(prefill and decode workers) and --pd-mode always")
        if cfg.control_plane.request_timeout_s is not None:
            raise ConfigError(f"{config}: control_plane.request_timeout_s acts on a live server; the simulator "
                              "replays every request to its end: remove it")
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    pd_setups = _pd_setups(cfg, node, pd, pd_mode, pd_slow_link, pd_interrupt, pd_target_full, seed)
    if pd_setups[0] is not None:
        workers = pd_setups[0].prefill + pd_setups[0].decode
    try:
        requests = _requests(trace, generate, requests_per_worker, rate_per_worker, workers, seed, block_size)
    except TraceError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if limit:
        requests = sorted(requests, key=lambda r: r.arrival_s)[:limit]
    if think_cap is not None:
        if not closed_loop:
            typer.echo("error: --think-cap needs --closed-loop (think times only act in closed loop)", err=True)
            raise typer.Exit(2)
        requests = [r if r.think_s is None or r.think_s <= think_cap else replace(r, think_s=think_cap)
                    for r in requests]
    if compare_dynamo:
        _check_dynamo(trace or [], limit, closed_loop)
    if plots is not None:
        _check_plots()
    routing = replay_routing(cfg.routing)  # (the Simulator applies it too: here for the header line)
    console.print(f"{len(requests):,} requests, {workers} workers x {kv_blocks} blocks x {block_size} tokens, "
                  f"speedup {speedup}" + (", closed loop" if closed_loop else "")
                  + ("" if routing.double_hash else ", double-hash guard off"))
    bounds = reuse_bounds(requests, block_size, workers * kv_blocks)
    outcomes, results = [], []
    # The serving default (on) does not change replays: the simulator holds requests only when the
    # config file says so itself, or --scheduler on.
    asked = cfg.scheduler.enabled and "enabled" in cfg.scheduler.model_fields_set
    modes = scheduler or [SchedulerMode.on if asked else SchedulerMode.off]
    pacings = pacing or [PacingMode.ours if cfg.scheduler.pacing.enabled else PacingMode.off]
    if planner and (not cfg.planner.enabled or pd is not None or (closed_loop and horizon is None)):
        typer.echo("error: --planner needs a config with planner: enabled: true, no --pd, and with --closed-loop a "
                   "--horizon (the planner's looks go on until then)", err=True)
        raise typer.Exit(2)
    dlog = _open_decision_log(cfg, decision_log)
    for pol, mode, pace, pds in ((p, m, g, d) for p in policies for m in modes for g in pacings for d in pd_setups):
        sched = _scheduler_config(cfg, mode, pace)
        label = (pol.value + ("+scheduler" if sched.enabled else "")
                 + (f"+pacing:{pace.value}" if pace is not PacingMode.off else "")
                 + (f"+pd{pds.prefill}:{pds.decode}:{pds.disagg.mode}" if pds is not None else ""))
        if planner:  # the planner sizes the fleet (sim/scaling.py)
            from thunderagent.sim.scaling import ScalingSim

            outcome = ScalingSim(node, routing, pol, mode="step", initial=min(cfg.planner.min_workers, workers),
                                 max_workers=workers, planner=cfg.planner, startup_s=planner_startup_s, seed=seed,
                                 scheduler=sched, decision_log=dlog, run_label=label + "+planner").replay(
                requests, 0.0, speedup, closed_loop=closed_loop, horizon_s=horizon).outcome
            assert outcome is not None
            outcome.result.policy = label = label + "+planner"
            outcomes.append(outcome)
            results.append(outcome.result)
            console.print(f"{label}: {outcome.result.extra['scaling']}")
            continue
        simulator = Simulator(node, routing, workers, pol, seed=seed, scheduler=sched, decision_log=dlog,
                              run_label=label, pd=pds)
        with Progress(TextColumn(f"thunderagent {label}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as prog:
            task = prog.add_task("replay", total=len(requests))
            outcome = simulator.run(requests, speedup, progress=lambda k: prog.advance(task, k),
                                    closed_loop=closed_loop, horizon_s=horizon)
        outcome.result.policy = label
        outcomes.append(outcome)
        results.append(outcome.result)
        if compare_dynamo and pds is not None and pol in _DYNAMO_MODE and pace is pacings[0] and mode is modes[0]:
            from thunderagent.sim.dynamo import run_dynamo

            # Dynamo's disaggregated replay (always, or its router's conditional disaggregation);
            # ``never`` has no Dynamo counterpart but aggregated workers
            if pds.disagg.mode != "never" and (pol is Policy.kv_aware or pds.disagg.mode == "always"):
                with console.status(f"dynamo {_DYNAMO_MODE[pol]} pd"):
                    results.append(run_dynamo(trace[0], workers=workers, kv_blocks=kv_blocks, block_size=block_size,
                                              speedup=speedup, router_mode=_DYNAMO_MODE[pol],
                                              pd=(pds.prefill, pds.decode),
                                              pd_conditional=pds.disagg.mode == "conditional"))
        elif compare_dynamo and pol in _DYNAMO_MODE and pace is pacings[0]:
            from thunderagent.sim.dynamo import run_dynamo

            # Dynamo at its defaults once per policy; beside our holding queue's row, Dynamo's
            # kv_router with its router queue on
            queues: list[float | None] = [None] if mode is modes[0] else []
            if mode is SchedulerMode.on and pol is Policy.kv_aware:
                queues.append(dynamo_queue_threshold)
            for queue in queues:
                with console.status(f"dynamo {_DYNAMO_MODE[pol]}"):
                    results.append(run_dynamo(trace[0], workers=workers, kv_blocks=kv_blocks, block_size=block_size,
                                              speedup=speedup, router_mode=_DYNAMO_MODE[pol],
                                              queue_threshold=queue, queue_policy=dynamo_queue_policy.value))
    if dlog is not None:
        dlog.close()
        console.print(f"wrote {dlog.written:,} decisions to {decision_log}")
    source = ([str(t) for t in trace] if trace else
              [(f"generated {generate.value if generate else ''}: {requests_per_worker or _PER_WORKER} requests per "
                f"worker at {rate_per_worker or _RATE:g}/s per worker")])
    _report(console, source, results, outcomes, bounds, json_out, plots,
            {"traces": source, "workers": workers, "kv_blocks": kv_blocks,
             "block_size": block_size, "speedup": speedup, "seed": seed, "requests": len(requests),
             **({"closed_loop": True} if closed_loop else {})})


def _requests(trace: list[Path] | None, generate: Traffic | None, per_worker: int | None, rate: float | None,
              workers: int, seed: int, block_size: int) -> list[Any]:
    """The replay's requests: the traces', or --generate's for ``workers`` (exactly one of the two)."""
    from thunderagent.sim.generators import fleet_traffic
    from thunderagent.sim.traces import load_traces

    if (trace is None) == (generate is None):
        raise typer.BadParameter("give --trace or --generate (exactly one)", param_hint="--trace / --generate")
    if trace is not None:
        if per_worker is not None or rate is not None:
            raise typer.BadParameter("acts with --generate only", param_hint="--requests-per-worker / --rate-per-worker")
        return load_traces(trace)
    assert generate is not None
    return fleet_traffic(generate.value, workers, per_worker or _PER_WORKER, rate or _RATE, seed=seed,
                         block_size=block_size)


def _pd_setups(cfg: Config, node: Any, pd: str | None, modes: list[PdMode] | None, slow: float, interrupt: float,
               full: float, seed: int) -> list[Any]:
    """One setup per --pd-mode ([None] without --pd)."""
    from thunderagent.config import KvTransferConfig, Role
    from thunderagent.sim.driver import PdSetup
    from thunderagent.sim.pd import PdFaults

    if pd is None:
        if modes or slow != 1.0 or interrupt or full:
            typer.echo("error: --pd-mode and the --pd-* fault options need --pd P:D", err=True)
            raise typer.Exit(2)
        return [None]
    try:
        p, d = (int(x) for x in pd.split(":"))
        if p < 1 or d < 1:
            raise ValueError
    except ValueError as exc:
        typer.echo(f"error: --pd takes P:D, two counts >= 1 (prefill:decode workers), got {pd!r}", err=True)
        raise typer.Exit(2) from exc
    pre = [n for n in cfg.execution_group.nodes if n.role is Role.prefill]
    transfer = pre[0].kv_cache_transfer if pre else KvTransferConfig(enabled=True)
    if sim := sim_fields_set(transfer):
        typer.echo(f"error: kv_cache_transfer.{sim[0]} acts on a live server's simulated workers; the simulator "
                   "moves virtual bytes (bytes_per_token) and injects faults with --pd-slow-link/--pd-interrupt/"
                   "--pd-target-full: remove it", err=True)
        raise typer.Exit(2)
    if transfer.warmup_tokens:
        typer.echo("error: kv_cache_transfer.warmup_tokens warms a live fleet's links up (NIXL handshakes, first "
                   "measures); the simulator's links start from bandwidth_gbps / links: remove it", err=True)
        raise typer.Exit(2)
    faults = PdFaults(slow, interrupt, full, seed)
    base = cfg.routing.disaggregation
    pnode = pre[0].model_copy(update={"kv_blocks": node.kv_blocks, "block_size": node.block_size}) if pre else None
    return [PdSetup(p, d, base.model_copy(update={"mode": m.value}), transfer, faults, pnode)
            for m in (modes or [PdMode(base.mode)])]


def _open_decision_log(cfg: Config, path: Path | None) -> Any:
    """The decision log's writer (None without ``--decision-log``), on a fresh file: the file and
    rotated files of an earlier run are removed, so ``explain`` reads this run only."""
    if path is None:
        return None
    from thunderagent.observe.decision_log import DecisionLog

    for old in (path, *path.parent.glob(f"{path.name}.*")):
        if old == path or old.suffix[1:].isdigit():
            old.unlink(missing_ok=True)
    return DecisionLog(cfg.control_plane.decision_log.model_copy(update={"path": str(path)}))


def _scheduler_config(cfg: Config, mode: SchedulerMode, pace: PacingMode) -> Any:
    pacing = cfg.scheduler.pacing.model_copy(update={"enabled": pace is not PacingMode.off})
    if pace is PacingMode.paper:
        pacing = pacing.model_copy(update={"accounting": PacingAccounting.paper,
                                           "placement": ResumePlacement.most_free, "work_conserving": False,
                                           "idle_resume": IdleResume.head, "sticky": True})
    elif pace is PacingMode.cached:
        pacing = pacing.model_copy(update={"work_conserving": True, "idle_resume": IdleResume.cached})
    return cfg.scheduler.model_copy(update={"enabled": mode is SchedulerMode.on, "pacing": pacing})


def _check_plots() -> None:
    """--plots draws with matplotlib, an extra (a server does not need it): say so before the replay."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None or importlib.util.find_spec("numpy") is None:
        raise typer.BadParameter("needs matplotlib and numpy: pip install 'thunderagent[plots]'",
                                 param_hint="--plots")


def _check_dynamo(trace: list[Path], limit: int | None, closed_loop: bool) -> None:
    from thunderagent.sim.dynamo import dynamo_available
    from thunderagent.sim.traces import detect_format

    if closed_loop:
        typer.echo("error: --closed-loop cannot be combined with --compare-dynamo (Dynamo's replay is open-loop)",
                   err=True)
        raise typer.Exit(2)
    if len(trace) != 1 or detect_format(trace[0]) != "mooncake" or limit:
        typer.echo("error: --compare-dynamo needs exactly one Mooncake JSONL --trace and no --limit "
                   "(Dynamo's replay reads that format only)", err=True)
        raise typer.Exit(2)
    if not dynamo_available():
        typer.echo("error: --compare-dynamo needs ai-dynamo-runtime: pip install -e '.[compare]'", err=True)
        raise typer.Exit(2)


def _report(console: Any, trace: list[str], results: list[Any], outcomes: list[Any], bounds: Any,
            json_out: Path | None, plots: Path | None, meta: dict[str, object]) -> None:
    """The table on stdout, then the JSON and plot files asked for."""
    from rich.console import Console

    from thunderagent.sim.report import render_table, write_json, write_plots

    speedup = meta["speedup"]
    out_console = Console()
    if not out_console.is_terminal:  # piped to a file: don't squeeze 13 columns into 80
        out_console = Console(width=170)
    loop = " — closed loop" if meta.get("closed_loop") else ""
    render_table(results, bounds, out_console, f"{', '.join(trace)} — x{speedup}{loop}")
    _closed_loop_lines(out_console, results)
    for r in results:
        if r.decision_us is not None:
            dur = r.extra.get("duration_s") or 0.0
            out_console.print(
                f"{r.system} {r.policy}: routing decision (hash, admission, route) p50 {r.decision_us.p50:,.0f} µs "
                f"p99 {r.decision_us.p99:,.0f} µs; replay {r.wall_s:,.1f} s wall; KV events into the index "
                f"{r.extra['kv_event_blocks'] / dur if dur > 0 else 0.0:,.0f} blocks per virtual second")
        rejected, unfinished = r.extra.get("rejected_requests", 0), r.extra.get("incomplete_requests", 0)
        refused = r.extra.get("refused_requests", 0)
        lost = []
        if refused:
            lost.append(f"{refused:,} refused by the router (strict disaggregation: no prefill worker or room left "
                        "for them; or fallback reject with every worker busy)")
        if rejected > refused:
            lost.append(f"{rejected - refused:,} ended without a token (refused by their worker: longer than its "
                        "KV cache)")
        if unfinished:
            lost.append(f"{unfinished:,} not finished" + (" by the horizon" if r.extra.get("horizon_s") else ""))
        if lost:  # the table's requests column counts what ended, these included
            out_console.print(f"{r.system} {r.policy}: of {meta['requests']:,} requests, {'; '.join(lost)}")
        if rerouted := r.extra.get("pd", {}).get("rerouted"):
            out_console.print(f"{r.system} {r.policy}: strict, failures routed again without the worker at fault: "
                              + ", ".join(f"{n:,} {cause}" for cause, n in sorted(rerouted.items())))
    if json_out:
        write_json(json_out, results, bounds, meta)
        console.print(f"wrote {json_out}")
    if plots:
        for p in write_plots(plots, outcomes, results, bounds):
            console.print(f"wrote {p}")


def _closed_loop_lines(console: Any, results: list[Any]) -> None:
    """Under the table, per closed-loop run: sessions, steps/min, session completion, Jain fairness."""
    for r in results:
        x = r.extra
        if "sessions" not in x:
            continue
        c = x["session_completion_s"]
        console.print(
            f"closed loop {r.system} {r.policy}: {x['sessions']} sessions, {x['steps_per_min']:,.2f} steps/min, "
            f"session completion mean {_num(c['mean'])} s p50 {_num(c['p50'])} s p99 {_num(c['p99'])} s "
            f"({c['n']} complete), Jain fairness of steps/min {_num(x['jain_fairness_steps'], 3)}"
            + (f", {x['unissued_requests']} never issued" if x.get("unissued_requests") else "")
        )
        if "pacing" in x:
            pc = x["pacing"]
            console.print(f"  pacing: {pc['pauses']} pauses, {pc['resumes']} resumes ({pc['forced_resumes']} forced), "
                          f"pause cycles per program per 10 min mean "
                          f"{_num(pc['pause_cycles_per_program_per_10min']['mean'], 2)} max "
                          f"{_num(pc['pause_cycles_per_program_per_10min']['max'], 2)}")


def _num(v: float, nd: int = 1) -> str:
    return "—" if v != v else f"{v:,.{nd}f}"


def register(app: typer.Typer) -> None:
    app.command()(sim)
