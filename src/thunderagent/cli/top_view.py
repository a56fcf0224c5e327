"""What ``thunderagent top`` shows, computed from two scrapes of ``/health`` and ``/metrics``.

Pure: a :class:`Scrape` is plain data (its time, the health JSON, the Prometheus samples); :func:`build_frame`
turns the previous and the latest scrape into a :class:`Frame`; :func:`render` draws it with rich. Fetching
lives in :mod:`thunderagent.cli.top`. With API keys on, a tenants table shows each tenant's tokens per
minute, requests in flight (tenants with a ``max_in_flight``) and refusals; with a prefill group or cache
migration, a transfer-plane line (handoffs, KV moved, copies, links learned)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table
from rich.text import Text

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> [(labels, value)]

HOT_FACTOR = 2.0  # a worker is hot when its queue exceeds this many times the fleet's median ...
HOT_MIN_QUEUE = 4  # ... and at least this many requests wait on it (2 vs 0 waiting is noise, not skew)
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Scrape:
    t: float  # monotonic seconds
    health: dict[str, object]
    samples: Samples


@dataclass
class WorkerRow:
    id: str
    role: str
    health: str
    running: int
    waiting: int
    kv_usage: float
    indexed_blocks: int | None
    out_of_routing: str | None
    routed_per_s: float | None
    hot: bool = False
    #: requests routed to it while it held part of their prompt / requests routed to it (over the window)
    hit_rate: float | None = None


@dataclass
class TenantRow:
    """One tenant (API keys on): its tokens per minute, requests in flight (limited tenants) and refusals."""

    tenant: str
    prompt_per_min: float | None
    completion_per_min: float | None
    in_flight: int | None  # None: no in-flight limit (not counted)
    refused_per_s: float | None


@dataclass
class TransferLine:
    """The transfer plane over the window (shown with a prefill group or cache migration on)."""

    handoffs_per_s: float | None  # prefill/decode handoffs that landed
    handoffs_failed_per_s: float | None
    local_per_s: float | None  # requests prefilled on their decode worker instead (fallbacks)
    gbps: float | None  # KV moved by handoffs and copies (the plane's estimates)
    copies_per_min: float | None  # cache migration's copies that landed
    copies_failed_per_min: float | None
    planning: bool | None  # this frontend plans the copies (several NATS frontends: one does); None: no migration
    links_learned: int  # link estimates with at least one measured sample


@dataclass
class Frame:
    status: str
    workers: list[WorkerRow]
    window_s: float | None  # None: one scrape, rates and percentiles are since the server started
    ttft: dict[float, float | None] = field(default_factory=dict)  # quantile -> seconds
    itl: dict[float, float | None] = field(default_factory=dict)
    decisions_per_s: float | None = None
    hit_rate: float | None = None  # predicted hit tokens / prompt tokens
    reuse_rate: float | None = None  # tokens engines served from cache / prompt tokens
    recompute_rate: float | None = None
    held: int | None = None  # requests in the scheduler's holding queue
    queue_skew: float | None = None  # max queue depth / median
    hot: str | None = None
    tenants: list[TenantRow] = field(default_factory=list)  # most tokens first
    transfers: TransferLine | None = None


def parse_metrics(text: str) -> Samples:
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)


def total(samples: Samples, name: str) -> float:
    return sum(v for _, v in samples.get(name, ()))


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, v in samples.get(name, ()):
        out[labels.get(label, "")] += v
    return dict(out)


def buckets(samples: Samples, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative ``(le, count)`` pairs, summed over its label sets, in ``le`` order."""
    return sorted((float(le), n) for le, n in by_label(samples, f"{name}_bucket", "le").items())


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket that holds rank ``q * count``;
    None with no observations. A rank in the ``+Inf`` bucket reads as the largest finite bound."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank:
            if math.isinf(le):
                return lo_bound
            if count == lo_count:
                return le
            return lo_bound + (le - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = le, count
    return lo_bound


def bucket_delta(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(old)
    return [(le, max(0.0, n - before.get(le, 0.0))) for le, n in new]


def hot_worker(depths: dict[str, float], factor: float = HOT_FACTOR, minimum: float = HOT_MIN_QUEUE) -> str | None:
    """The worker whose queue is deepest, if it exceeds ``factor`` x the fleet's median and ``minimum``."""
    if not depths:
        return None
    wid = max(sorted(depths), key=lambda w: depths[w])
    median = statistics.median(depths.values())
    return wid if depths[wid] >= minimum and depths[wid] > factor * median else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _rates(cur: Scrape, prev: Scrape | None) -> tuple[Samples, float | None]:
    """Counter and histogram samples over the window between the scrapes (or since start with one)."""
    if prev is None:
        return cur.samples, None
    window: Samples = {}
    for name, rows in cur.samples.items():
        before = {tuple(sorted(l.items())): v for l, v in prev.samples.get(name, ())}
        window[name] = [(l, v - before.get(tuple(sorted(l.items())), 0.0)) for l, v in rows]
    return window, max(cur.t - prev.t, 1e-9)


def build_frame(cur: Scrape, prev: Scrape | None = None, hot_factor: float = HOT_FACTOR,
                hot_min: float = HOT_MIN_QUEUE) -> Frame:
    win, dt = _rates(cur, prev)
    per_s = (lambda n: n / dt) if dt else (lambda n: None)
    routed = by_label(win, "thunderagent_routed_total", "worker")
    hits = by_label(win, "thunderagent_routed_hits_total", "worker")
    workers = [WorkerRow(str(w["id"]), str(w.get("role", "")), str(w["health"]), int(w["running"]),
                         int(w["waiting"]), float(w["kv_usage"]), w.get("indexed_blocks"),
                         w.get("out_of_routing") or ("cordoned" if w.get("cordoned") else None)
                         or ("asleep" if w.get("asleep") else "paused" if w.get("paused") else None),
                         per_s(routed.get(str(w["id"]), 0.0)),
                         hit_rate=_ratio(hits.get(str(w["id"]), 0.0), routed.get(str(w["id"]), 0.0)))
               for w in cur.health.get("workers", [])]  # type: ignore[union-attr]
    depths = {w.id: float(w.waiting) for w in workers}
    hot = hot_worker(depths, hot_factor, hot_min)
    for w in workers:
        w.hot = w.id == hot
    median = statistics.median(depths.values()) if depths else 0.0
    prompt = total(win, "thunderagent_prompt_tokens_total")
    sched = cur.health.get("scheduler")
    frame = Frame(str(cur.health.get("status", "?")), workers, dt,
                  decisions_per_s=per_s(total(win, "thunderagent_routing_decision_seconds_count")),
                  hit_rate=_ratio(total(win, "thunderagent_predicted_hit_tokens_total"), prompt),
                  reuse_rate=_ratio(total(win, "thunderagent_cached_tokens_total"), prompt),
                  recompute_rate=_ratio(total(win, "thunderagent_prefill_recompute_tokens_total"), prompt),
                  held=sched.get("held") if isinstance(sched, dict) else None,
                  queue_skew=_ratio(max(depths.values(), default=0.0), max(median, 1.0)), hot=hot)
    for name, into in (("thunderagent_ttft_seconds", frame.ttft), ("thunderagent_itl_seconds", frame.itl)):
        hist = buckets(win, name)
        for q in QUANTILES:
            into[q] = quantile(q, hist)
    frame.tenants = _tenants(cur, win, per_s)
    frame.transfers = _transfers(cur.health, win, per_s)
    return frame


def _transfers(health: dict[str, object], win: Samples, per_s: Callable[[float], float | None]) -> TransferLine | None:
    mig = health.get("cache_migration")
    links = health.get("pd_links", health.get("migration_links"))
    if mig is None and links is None:
        return None
    copies = by_label(win, "thunderagent_cache_migration_copies_total", "outcome")
    moved = per_s(total(win, "thunderagent_pd_transfer_bytes_total")
                  + total(win, "thunderagent_cache_migration_bytes_total"))

    def per_min(v: float) -> float | None:
        r = per_s(v)
        return None if r is None else r * 60

    return TransferLine(per_s(total(win, "thunderagent_pd_transfers_ok_total")),
                        per_s(total(win, "thunderagent_pd_transfers_failed_total")),
                        per_s(total(win, "thunderagent_pd_fallbacks_total")),
                        None if moved is None else moved * 8 / 1e9,
                        per_min(copies.get("ok", 0.0)), per_min(sum(v for k, v in copies.items() if k != "ok")),
                        bool(mig.get("planning")) if isinstance(mig, dict) else None,
                        sum(1 for x in links if isinstance(x, dict) and x.get("samples")) if isinstance(links, list)
                        else 0)


def _tenants(cur: Scrape, win: Samples, per_s: Callable[[float], float | None]) -> list[TenantRow]:
    tokens: dict[tuple[str, str], float] = defaultdict(float)
    for labels, v in win.get("thunderagent_tenant_tokens_total", ()):
        tokens[labels.get("tenant", ""), labels.get("kind", "")] += v
    in_flight = {labels.get("tenant", ""): int(v) for labels, v in cur.samples.get("thunderagent_tenant_in_flight", ())}
    refused = by_label(win, "thunderagent_tenant_refused_total", "tenant")
    names = {t for t, _ in tokens} | set(in_flight) | set(refused)

    def per_min(v: float) -> float | None:
        r = per_s(v)
        return None if r is None else r * 60

    rows = [TenantRow(t, per_min(tokens.get((t, "prompt"), 0.0)), per_min(tokens.get((t, "completion"), 0.0)),
                      in_flight.get(t), per_s(refused.get(t, 0.0))) for t in names]
    return sorted(rows, key=lambda r: (-(r.prompt_per_min or 0.0) - (r.completion_per_min or 0.0), r.tenant))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _workers_table(frame: Frame) -> Table:
    table = Table(title="workers", title_justify="left", expand=False)
    for col in ("worker", "role", "health", "running", "waiting", "KV use", "indexed", "routed/s", "hit rate", ""):
        table.add_column(col, justify="left" if col in ("worker", "role", "health", "") else "right")
    for w in frame.workers:
        health = w.health if not w.out_of_routing else f"out ({w.out_of_routing})"
        mark = Text("HOT queue", style="bold red") if w.hot else Text("")
        table.add_row(w.id, w.role, Text(health, style="green" if health == "healthy" else "yellow"),
                      str(w.running), str(w.waiting), f"{w.kv_usage:.1%}", _num(w.indexed_blocks, "{:.0f}"),
                      _num(w.routed_per_s), _pct(w.hit_rate), mark, style="on dark_red" if w.hot else None)
    return table


def _tenants_table(frame: Frame) -> Table:
    table = Table(title="tenants", title_justify="left", expand=False)
    for col in ("tenant", "prompt tokens/min", "completion tokens/min", "in flight", "refused/s"):
        table.add_column(col, justify="left" if col == "tenant" else "right")
    for t in frame.tenants:
        table.add_row(t.tenant, _num(t.prompt_per_min, "{:,.0f}"), _num(t.completion_per_min, "{:,.0f}"),
                      _num(t.in_flight, "{:.0f}"), _num(t.refused_per_s),
                      style="yellow" if t.refused_per_s else None)
    return table


def render(frame: Frame, url: str) -> Group:
    window = f"last {frame.window_s:.1f} s" if frame.window_s else "since start"
    head = Text.assemble(("thunderagent top ", "bold"), (url, "cyan"), f"  status {frame.status}  ({window})")
    fleet = Table(title="fleet", title_justify="left", show_header=True)
    for col in ("", "p50", "p90", "p99"):
        fleet.add_column(col, justify="right" if col else "left")
    fleet.add_row("TTFT", *(_ms(frame.ttft.get(q)) for q in QUANTILES))
    fleet.add_row("ITL", *(_ms(frame.itl.get(q)) for q in QUANTILES))
    hot = (Text(f"hot worker {frame.hot}", style="bold red") if frame.hot else Text("no hot worker"))
    summary = Text(
        f"decisions/s {_num(frame.decisions_per_s)}   hit rate {_pct(frame.hit_rate)}   "
        f"reuse {_pct(frame.reuse_rate)}   recompute {_pct(frame.recompute_rate)}   "
        f"held {_num(frame.held, '{:.0f}')}   queue skew {_num(frame.queue_skew)}x   ")
    summary.append_text(hot)
    parts = [head, _workers_table(frame)]
    if frame.tenants:  # API keys on
        parts.append(_tenants_table(frame))
    parts += [fleet, summary]
    if (t := frame.transfers) is not None:
        line = (f"transfers: handoffs {_num(t.handoffs_per_s)}/s (failed {_num(t.handoffs_failed_per_s)}/s, "
                f"prefilled locally {_num(t.local_per_s)}/s)   KV moved {_num(t.gbps, '{:.2f}')} Gbit/s   "
                f"links learned {t.links_learned}")
        if t.planning is not None:
            line += (f"   copies {_num(t.copies_per_min)}/min (failed {_num(t.copies_failed_per_min)}/min, "
                     f"{'planned here' if t.planning else 'planned by another frontend'})")
        parts.append(Text(line, style="yellow" if t.handoffs_failed_per_s or t.copies_failed_per_min else None))
    return Group(*parts)
