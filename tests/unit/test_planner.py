"""The step-wise scaling planner (control/planner.py): exact recommendations for hand-made looks."""

from __future__ import annotations

import pytest

from thunderagent.config import ConfigError, PlannerConfig, parse_config
from thunderagent.control.planner import Forecast, Planner, WorkerSample


def cfg(**kw: object) -> PlannerConfig:
    base: dict[str, object] = {"enabled": True, "interval_s": 1.0, "window_s": 10.0, "cooldown_s": 30.0,
                               "min_workers": 1, "max_workers": 4, "warm_requests": 5}
    base.update(kw)
    return PlannerConfig(**base)  # type: ignore[arg-type]


def look(p: Planner, t: float, n: int, *, waiting: int = 0, kv: float = 0.3, served: int = 0, ttft: float = 0.1,
         hits: int | None = None, role: str = "both", extra: dict[str, WorkerSample] | None = None) -> None:
    """``n`` alike workers; each has served ``served`` requests so far at ``ttft`` seconds each."""
    ws = [WorkerSample(f"w{i}", role, waiting, 1, kv, served, served if hits is None else hits, served, served * ttft)
          for i in range(n)]
    p.observe(t, ws + list((extra or {}).values()))


def run(p: Planner, t0: float, t1: float, n: int, rate: int = 2, **kw: object) -> None:
    """Looks every second from t0 to t1, each worker serving ``rate`` requests a second."""
    t = t0
    while t <= t1:
        look(p, t, n, served=int(t * rate), **kw)  # type: ignore[arg-type]
        t += 1.0


def test_overload_gives_plus_one_with_reasons_then_pending_then_cooldown() -> None:
    p = Planner(cfg(up_ttft_s=0.5, down_ttft_s=0.2))
    run(p, 0, 4, 2, waiting=3, kv=0.95)
    r = p.recommend(4.0)["both"]
    assert (r.delta, r.reasons) == (0, ("watching: 4s of samples, 5s needed",))
    run(p, 5, 10, 2, waiting=3, ttft=1.4, kv=0.95)
    r = p.recommend(10.0)["both"]
    assert r.delta == 1 and r.fresh and r.decided_at == 10.0
    assert r.reasons == ("queue: 3.00 waiting/worker >= 2", "TTFT: mean 1.400s >= 0.5s", "KV: 95% used >= 90%")
    assert r.signals.workers == 2 and r.signals.hit_rate == 1.0
    # not acted on yet: the step stays the answer (not fresh: the action fires once)
    look(p, 11, 2, waiting=3, served=22)
    r = p.recommend(11.0)["both"]
    assert (r.delta, r.fresh, r.reasons[0]) == (1, False, "pending: +1 decided at 10s, still 2 workers")
    # a worker joins: cooldown from the join, then the newcomer is cold
    look(p, 12, 3, served=24)
    r = p.recommend(12.0)["both"]
    assert (r.delta, r.reasons) == (0, ("cooling down: 0s of 30s since the last worker count change",))


def test_cold_worker_holds_until_served_or_hit_rate() -> None:
    p = Planner(cfg(cooldown_s=0.0))
    run(p, 0, 10, 2, hits=0)
    newcomer = {"w9": WorkerSample("w9", "both", 0, 1, 0.3, 2, 0, 2, 0.2)}  # 2 served, no hit
    look(p, 11, 2, served=22, hits=20, waiting=5, extra=newcomer)
    look(p, 12, 2, served=24, hits=22, waiting=5, extra={"w9": WorkerSample("w9", "both", 0, 1, 0.3, 4, 0, 4, 0.4)})
    r = p.recommend(12.0)["both"]
    assert r.delta == 0 and r.signals.cold == ("w9",)
    assert r.reasons[0].startswith("cold: w9 still warming up (< 5 served")
    # served 5 since it joined: warm; the planner now watches the window since the join
    look(p, 13, 2, served=26, hits=24, waiting=5, extra={"w9": WorkerSample("w9", "both", 5, 1, 0.3, 7, 0, 7, 0.7)})
    r = p.recommend(13.0)["both"]
    assert r.signals.cold == () and r.reasons == ("watching: 2s of samples, 5s needed",)


def test_cold_ends_when_hit_rate_reaches_the_roles() -> None:
    p = Planner(cfg(cooldown_s=0.0))
    run(p, 0, 10, 2, hits=0)  # the role's hit rate is 0 (hits stay 0)
    look(p, 11, 2, served=22, hits=0, extra={"w9": WorkerSample("w9", "both", 0, 1, 0.3, 0, 0, 0, 0.0)})
    look(p, 12, 2, served=24, hits=0, extra={"w9": WorkerSample("w9", "both", 0, 1, 0.3, 1, 0, 1, 0.1)})
    assert p.recommend(12.0)["both"].signals.cold == ()  # routed 1, hit rate 0 >= the role's 0


def test_idle_gives_minus_one_and_respects_min_workers() -> None:
    p = Planner(cfg())
    run(p, 0, 10, 3, kv=0.2, ttft=0.05)
    r = p.recommend(10.0)["both"]
    assert r.delta == -1 and r.fresh
    assert r.reasons == ("queue on 2 workers: 0.00 waiting/worker <= 0.1", "KV on 2 workers: 30% <= 50%",
                         "TTFT: mean 0.050s <= 0.5s")
    q = Planner(cfg())
    run(q, 0, 10, 1, kv=0.1, ttft=0.05)
    r = q.recommend(10.0)["both"]
    assert (r.delta, r.reasons[0]) == (0, "at min_workers (1)")


def test_kv_spread_over_one_fewer_blocks_minus_one() -> None:
    p = Planner(cfg())
    run(p, 0, 10, 2, kv=0.3, ttft=0.05)  # 30% on 2 workers is 60% on one: above 50%
    r = p.recommend(10.0)["both"]
    assert r.delta == 0 and r.reasons[0].startswith("in range:")


def test_max_workers_holds_plus_one() -> None:
    p = Planner(cfg(max_workers=2))
    run(p, 0, 10, 2, waiting=4)
    r = p.recommend(10.0)["both"]
    assert (r.delta, r.reasons) == (0, ("at max_workers (2)", "queue: 4.00 waiting/worker >= 2"))


def test_roles_are_judged_apart_and_window_forgets_old_load() -> None:
    p = Planner(cfg())
    for t in range(0, 30):
        ws = [WorkerSample("p0", "prefill", 5 if t < 15 else 0, 1, 0.3),
              WorkerSample("d0", "decode", 0, 1, 0.3), WorkerSample("d1", "decode", 0, 1, 0.1)]
        p.observe(float(t), ws)
    recs = p.recommend(29.0)
    assert set(recs) == {"decode", "prefill"}
    assert recs["prefill"].signals.queue_per_worker == 0.0  # the overload before t=15 left the 10 s window
    assert recs["prefill"].delta == 0 and recs["decode"].delta == -1


def test_pending_step_expires_and_is_decided_again() -> None:
    p = Planner(cfg(cooldown_s=5.0))
    run(p, 0, 10, 2, waiting=3)
    assert p.recommend(10.0)["both"].fresh
    run(p, 11, 16, 2, waiting=3)  # nobody acted
    r = p.recommend(16.0)["both"]
    assert (r.delta, r.fresh, r.decided_at) == (1, True, 16.0)


def test_config_knobs_need_the_switch_and_bounds() -> None:
    with pytest.raises(ConfigError, match="planner.cooldown_s.*acts only with planner.enabled"):
        parse_config({"planner": {"cooldown_s": 10}})
    with pytest.raises(ConfigError, match="max_workers"):
        parse_config({"planner": {"enabled": True, "min_workers": 3, "max_workers": 2}})
    with pytest.raises(ConfigError, match="down_ttft_s must be below up_ttft_s"):
        parse_config({"planner": {"enabled": True, "down_ttft_s": 3}})
    with pytest.raises(ConfigError, match="webhook_url"):
        parse_config({"planner": {"enabled": True, "webhook_url": "ftp://x"}})
    assert parse_config({"planner": {"enabled": True, "command": ["echo"]}}).planner.command == ["echo"]
    c = parse_config({})
    assert parse_config(c.model_dump()).planner == c.planner  # a dumped config loads again


def fc(**kw: object) -> PlannerConfig:
    """Forecast sizing on: a 4 s window, a 2 s trend (two one-second intervals), 1.5 s ahead."""
    base: dict[str, object] = {"window_s": 4.0, "trend_window_s": 2.0, "forecast_lead_s": 1.5,
                               "target_utilization": 0.5, "max_workers": 16, "up_queue_per_worker": 3.0}
    base.update(kw)
    return cfg(**base)


def busy_looks(p: Planner, counts: list[int], n: int = 2, waiting: int = 2) -> None:
    """Looks at t = 0, 1, ...: each of ``n`` workers has produced ``counts[t]`` first tokens (0.1 s each);
    ``waiting`` 2: a queue at every look (busy: the service rate is measured)."""
    for t, c in enumerate(counts):
        p.observe(float(t), [WorkerSample(f"w{i}", "both", waiting, 1, 0.3, c, c, c, c * 0.1) for i in range(n)])


def test_forecast_adds_a_worker_ahead_of_a_rising_arrival_rate() -> None:
    p = Planner(fc())
    busy_looks(p, [0, 1, 3])  # 2 workers busy (a queue at every look): 2 then 4 arrivals/s
    r = p.recommend(2.0)["both"]
    # the line through 2 req/s at 0.5 s and 4 at 1.5 s: 5 req/s now, 8 in 1.5 s; 6 first tokens in 4 busy
    # worker-seconds: 1.5 req/s each, 0.75 at 50 %: 8 / 0.75 = 10.7 -> 11 workers
    assert r.signals.forecast == Forecast(5.0, 2.0, 8.0, 1.5, 11, 11)
    assert (r.delta, r.fresh) == (1, True)
    assert r.reasons == ("forecast: arrivals 5.00 req/s (+120.00 per minute) -> 8.00 req/s in 1.5s needs 11 "
                         "workers at 50% of 1.50 req/s each",)


def test_forecast_steps_once_the_last_joined_without_cooldown_or_cold_hold() -> None:
    p = Planner(fc())
    busy_looks(p, [0, 1, 3])
    assert p.recommend(2.0)["both"].fresh  # +1 (the test above)
    ws = [WorkerSample(f"w{i}", "both", 2, 1, 0.3, 5, 5, 5, 0.5) for i in range(2)]
    p.observe(3.0, [*ws, WorkerSample("w2", "both", 2, 1, 0.3, 0, 0, 0, 0.0)])  # the new worker joined, cold
    r = p.recommend(3.0)["both"]
    # 4 arrivals/s steady; 10 first tokens in 6 busy worker-seconds: 5 workers needed, 3 up. Without the
    # forecast this look would cool down (0 s since the join) and then wait for the cold w2.
    assert r.signals.cold == ("w2",) and r.signals.forecast == Forecast(4.0, 0.0, 4.0, 10 / 6, 5, 5)
    assert (r.delta, r.fresh, r.reasons) == (1, True, ("forecast: arrivals 4.00 req/s (+0.00 per minute) -> 4.00 "
                                                       "req/s in 1.5s needs 5 workers at 50% of 1.67 req/s each",))
    ws = [WorkerSample(f"w{i}", "both", 2, 1, 0.3, 7, 7, 7, 0.7) for i in range(2)]
    p.observe(4.0, [*ws, WorkerSample("w2", "both", 2, 1, 0.3, 1, 0, 1, 0.1)])
    r = p.recommend(4.0)["both"]  # not seen yet: pending, not a second step
    assert (r.delta, r.fresh, r.reasons[0]) == (1, False, "pending: +1 decided at 3s, still 3 workers")


def test_forecast_needs_a_measured_service_rate_and_enough_history() -> None:
    p = Planner(fc())
    busy_looks(p, [0, 1, 3], waiting=0)  # never busy: the service rate is unknown, no forecast rule
    r = p.recommend(2.0)["both"]
    assert r.signals.forecast == Forecast(5.0, 2.0, 8.0, None, None, None)
    assert r.delta == 0 and r.reasons[0].startswith("in range:")
    pr = Planner(fc(service_rate_per_worker=2.0))  # not measured yet: the operator's figure
    busy_looks(pr, [0, 1, 3], waiting=0)
    r = pr.recommend(2.0)["both"]
    assert r.signals.forecast == Forecast(5.0, 2.0, 8.0, 2.0, 8, 8) and r.delta == 1
    q = Planner(fc(trend_window_s=4.0))
    busy_looks(q, [0, 1])  # 1 s of arrivals, 2 s needed
    assert q.recommend(1.0)["both"].signals.forecast is None
    lv = Planner(fc(trend_window_s=8.0))  # 2 s of arrivals: enough for the level (window_s / 2), not the slope
    busy_looks(lv, [0, 1, 3])
    r = lv.recommend(2.0)["both"]
    assert r.signals.forecast == Forecast(3.0, 0.0, 3.0, 1.5, 4, 4) and r.delta == 1
    off = Planner(cfg())  # target_utilization unset: no forecast at all
    busy_looks(off, [0, 1, 3])
    assert off.recommend(2.0)["both"].signals.forecast is None


def idle_after_busy(p: Planner) -> None:
    """3 workers: busy 2 s serving 2 req/s each (service rate 2), then idle serving 1 req/s each to t = 8."""
    for t in range(9):
        c = 2 * t if t <= 2 else 4 + (t - 2)
        p.observe(float(t), [WorkerSample(f"w{i}", "both", 2 if t <= 2 else 0, 1, 0.2, c, c, c, c * 0.05)
                             for i in range(3)])


def test_forecast_blocks_minus_one_while_one_worker_fewer_would_not_carry_the_load() -> None:
    p = Planner(fc(target_utilization=0.5))
    idle_after_busy(p)
    r = p.recommend(8.0)["both"]
    # 3 req/s at 50 % of 2 req/s needs 3 workers: the idle-looking fleet keeps its 3
    assert r.signals.forecast == Forecast(3.0, 0.0, 3.0, 2.0, 3, 3)
    assert r.delta == 0 and r.reasons[0].startswith("in range:")
    q = Planner(fc(target_utilization=1.0))
    idle_after_busy(q)
    r = q.recommend(8.0)["both"]
    assert (r.delta, r.fresh) == (-1, True)
    assert r.reasons == ("queue on 2 workers: 0.00 waiting/worker <= 0.1", "KV on 2 workers: 30% <= 50%",
                         "TTFT: mean 0.050s <= 0.5s", "forecast: arrivals 3.00 req/s (+0.00 per minute), 3.00 "
                         "req/s in 1.5s: at most 2 workers needed over 4s at 100% of 2.00 req/s each")


def test_forecast_minus_one_waits_for_a_window_of_looks_needing_one_fewer() -> None:
    """Scale-down stabilisation: a look that needed 3 workers blocks -1 until it left the 4 s window."""
    p = Planner(fc(target_utilization=1.0))
    seen = []
    for t in range(10):  # busy 2 req/s each to t = 2 (service rate 2), idle at 2 req/s each to 5, then 1
        c = 2 * t if t <= 5 else 10 + (t - 5)
        p.observe(float(t), [WorkerSample(f"w{i}", "both", 2 if t <= 2 else 0, 1, 0.2, c, c, c, c * 0.05)
                             for i in range(3)])
        if t >= 5:
            r = p.recommend(float(t))["both"]
            f = r.signals.forecast
            assert f is not None
            seen.append((t, f.needed_now, r.delta))
    # 6 req/s needs 3 at t = 5; from t = 6 the line says 1-2, but -1 waits until the t = 5 look is 4 s old
    assert seen == [(5, 3, 0), (6, 1, 0), (7, 2, 0), (8, 2, 0), (9, 2, -1)]


def test_forecast_knobs_are_validated() -> None:
    with pytest.raises(ConfigError, match="forecast_lead_s acts only with target_utilization"):
        parse_config({"planner": {"enabled": True, "forecast_lead_s": 30}})
    with pytest.raises(ConfigError, match="trend_window_s acts only with target_utilization"):
        parse_config({"planner": {"enabled": True, "trend_window_s": 60}})
    with pytest.raises(ConfigError, match="service_rate_per_worker acts only with target_utilization"):
        parse_config({"planner": {"enabled": True, "service_rate_per_worker": 0.75}})
    with pytest.raises(ConfigError, match=r"trend_window_s \(8\) must cover at least two looks"):
        parse_config({"planner": {"enabled": True, "target_utilization": 0.8, "trend_window_s": 8}})
    with pytest.raises(ConfigError, match="target_utilization"):
        parse_config({"planner": {"enabled": True, "target_utilization": 1.5}})
    with pytest.raises(ConfigError, match="planner.target_utilization.*acts only with planner.enabled"):
        parse_config({"planner": {"target_utilization": 0.8}})


BOUNDS = (0.5, 1.0, 2.0, 4.0)


def hist_sample(wid: str, values: list[float]) -> WorkerSample:
    """A worker that has served ``values`` (seconds to first token), with its cumulative histogram."""
    cum = tuple((b, sum(1 for v in values if v <= b)) for b in BOUNDS)
    return WorkerSample(wid, "both", 0, 1, 0.3, len(values), len(values), len(values), sum(values), cum)


def test_ttft_quantile_reads_the_windows_histogram_not_the_mean() -> None:
    """p90 of the window: the histograms' growth since each worker's first look in it, summed over the
    role's workers, linear within the bucket (as Prometheus' histogram_quantile)."""
    p = Planner(cfg(ttft_quantile=0.9, up_ttft_s=1.5, down_ttft_s=0.6, window_s=4.0))
    before = [0.1] * 10  # served before the window: not counted
    p.observe(0.0, [hist_sample("w0", before), hist_sample("w1", before)])
    # in the window: w0 serves 10 at 0.3 s, w1 8 at 0.8 s and 2 at 3.0 s. Cumulative: 10 <= 0.5 s, 18 <= 1 s,
    # 18 <= 2 s, 20 <= 4 s; rank 0.9 x 20 = 18 lies in (0.5, 1]: 0.5 + 0.5 x (18 - 10) / (18 - 10) = 1.0 s
    p.observe(4.0, [hist_sample("w0", before + [0.3] * 10), hist_sample("w1", before + [0.8] * 8 + [3.0] * 2)])
    sig = p.signals("both", 4.0, 0.0)
    assert (sig.ttft_stat, sig.ttft_s) == ("p90", 1.0)
    # p95: rank 19 lies in (2, 4] holding values 19-20: 2 + 2 * (19 - 18) / 2 = 3.0
    p95 = Planner(cfg(ttft_quantile=0.95, up_ttft_s=2.5, down_ttft_s=0.6, window_s=4.0))
    p95.observe(0.0, [hist_sample("w0", before), hist_sample("w1", before)])
    p95.observe(4.0, [hist_sample("w0", before + [0.3] * 10), hist_sample("w1", before + [0.8] * 8 + [3.0] * 2)])
    r = p95.recommend(4.0)["both"]
    assert (r.signals.ttft_stat, r.signals.ttft_s) == ("p95", 3.0)
    assert r.delta == 1 and r.reasons == ("TTFT: p95 3.000s >= 2.5s",)
    # the mean of the same window (0.3 x 10 + 0.8 x 8 + 3.0 x 2) / 20 = 0.77 s would not have acted
    mean = Planner(cfg(up_ttft_s=2.5, down_ttft_s=0.6, window_s=4.0))
    mean.observe(0.0, [hist_sample("w0", before), hist_sample("w1", before)])
    mean.observe(4.0, [hist_sample("w0", before + [0.3] * 10), hist_sample("w1", before + [0.8] * 8 + [3.0] * 2)])
    sig = mean.signals("both", 4.0, 0.0)
    assert sig.ttft_stat == "mean" and sig.ttft_s == pytest.approx(0.77)
    assert mean.recommend(4.0)["both"].delta == 0


def test_ttft_quantile_edges_first_bucket_past_the_last_and_no_histogram() -> None:
    p = Planner(cfg(ttft_quantile=0.5, window_s=4.0))
    p.observe(0.0, [hist_sample("w0", [])])
    p.observe(2.0, [hist_sample("w0", [0.2, 0.4])])  # both in (0, 0.5]: rank 1 of 2 -> 0.25
    assert p.signals("both", 2.0, 0.0).ttft_s == 0.25
    p.observe(4.0, [hist_sample("w0", [0.2, 0.4] + [9.0] * 8)])  # rank 5 of 10 past the last bound: 4.0
    assert p.signals("both", 4.0, 0.0).ttft_s == 4.0
    # a worker whose source has no histogram: the mean, said so
    q = Planner(cfg(ttft_quantile=0.9, window_s=4.0))
    q.observe(0.0, [WorkerSample("w0", "both", 0, 1, 0.3, 0, 0, 0, 0.0)])
    q.observe(4.0, [WorkerSample("w0", "both", 0, 1, 0.3, 4, 4, 4, 2.0)])
    sig = q.signals("both", 4.0, 0.0)
    assert (sig.ttft_stat, sig.ttft_s) == ("mean", 0.5)
    # the knob needs the planner, and a quantile strictly inside (0, 1)
    with pytest.raises(ValueError, match="ttft_quantile"):
        PlannerConfig(ttft_quantile=0.9)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="ttft_quantile"):
            cfg(ttft_quantile=bad)
