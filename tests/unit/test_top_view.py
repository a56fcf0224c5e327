"""``thunderagent top``'s arithmetic: histogram quantiles as Prometheus computes them, the hot worker rule,
rates between two scrapes, the tenants table."""

from __future__ import annotations

import pytest

from thunderagent.cli.top_view import Scrape, build_frame, hot_worker, parse_metrics, quantile, render

INF = float("inf")


@pytest.mark.parametrize(("q", "want"), [(0.5, 0.1), (0.75, 0.1 + 0.4 * 2.5 / 3), (1.0, 1.0)])
def test_quantile_interpolates_inside_the_bucket(q, want):
    assert quantile(q, [(0.1, 5.0), (0.5, 8.0), (1.0, 10.0), (INF, 10.0)]) == pytest.approx(want)


def test_quantile_of_nothing_and_of_the_inf_bucket():
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    assert quantile(0.99, [(0.1, 1.0), (60.0, 1.0), (INF, 10.0)]) == 60.0  # the largest finite bound


@pytest.mark.parametrize(("depths", "want"), [
    ({"a": 0, "b": 0, "c": 17}, "c"),
    ({"a": 0, "b": 0, "c": 3}, None),  # under the minimum
    ({"a": 10, "b": 12, "c": 20}, None),  # under 2x the median
    ({"a": 10, "b": 10, "c": 21}, "c"),
    ({}, None),
])
def test_hot_worker(depths, want):
    assert hot_worker(depths) == want


def _scrape(t: float, routed: int, ttft_fast: int, ttft_slow: int) -> Scrape:
    text = (f'thunderagent_routed_total{{worker="w0"}} {routed}\n'
            f'thunderagent_routed_hits_total{{worker="w0"}} {routed // 2}\n'
            f'thunderagent_ttft_seconds_bucket{{le="0.1"}} {ttft_fast}\n'
            f'thunderagent_ttft_seconds_bucket{{le="1.0"}} {ttft_fast + ttft_slow}\n'
            f'thunderagent_ttft_seconds_bucket{{le="+Inf"}} {ttft_fast + ttft_slow}\n')
    health = {"status": "ok", "workers": [{"id": "w0", "role": "both", "health": "healthy", "running": 1,
                                           "waiting": 0, "kv_usage": 0.5}]}
    return Scrape(t, health, parse_metrics(text))


def test_rates_and_percentiles_are_over_the_window_between_scrapes():
    old, new = _scrape(10.0, 100, 100, 0), _scrape(12.0, 120, 100, 10)  # 10 slow first tokens since the last scrape
    frame = build_frame(new, old)
    assert frame.window_s == 2.0 and frame.workers[0].routed_per_s == 10.0
    assert frame.workers[0].hit_rate == 0.5  # 10 of the 20 routed in the window found part of their prompt there
    assert 0.1 < frame.ttft[0.5] <= 1.0  # the window holds only slow ones; since start, p50 would be fast
    assert build_frame(new).ttft[0.5] <= 0.1 and build_frame(new).window_s is None


def _tenant_scrape(t: float, acme_prompt: float, acme_refused: float) -> Scrape:
    text = ('thunderagent_tenant_tokens_total{kind="prompt",tenant="acme"} %s\n'
            'thunderagent_tenant_tokens_total{kind="completion",tenant="acme"} 50\n'
            'thunderagent_tenant_tokens_total{kind="prompt",tenant="globex"} 100\n'
            'thunderagent_tenant_tokens_total{kind="completion",tenant="globex"} 10\n'
            'thunderagent_tenant_in_flight{tenant="acme"} 3\n'
            'thunderagent_tenant_refused_total{limit="tokens_per_min",tenant="acme"} %s\n'
            ) % (acme_prompt, acme_refused)
    return Scrape(t, {"status": "ok", "workers": []}, parse_metrics(text))


def test_tenants_are_shown_by_tokens_per_minute_over_the_window():
    frame = build_frame(_tenant_scrape(12.0, 1000, 4), _tenant_scrape(10.0, 400, 0))
    acme, globex = frame.tenants
    assert (acme.tenant, acme.prompt_per_min, acme.completion_per_min, acme.in_flight, acme.refused_per_s) == (
        "acme", 18_000.0, 0.0, 3, 2.0)  # 600 prompt tokens in 2 s; no completion tokens since
    assert (globex.tenant, globex.prompt_per_min, globex.in_flight, globex.refused_per_s) == ("globex", 0.0, None, 0.0)
    assert build_frame(_scrape(10.0, 1, 1, 0)).tenants == []  # keys off: no tenants table
    from rich.console import Console
    console = Console(width=160, record=True)
    console.print(render(frame, "http://x"))
    out = console.export_text()
    assert "tenants" in out and "18,000" in out


def test_a_cordoned_worker_is_shown_out_of_routing():
    health = {"status": "ok", "workers": [
        {"id": "w0", "health": "healthy", "running": 1, "waiting": 0, "kv_usage": 0.5, "cordoned": True},
        {"id": "w1", "health": "healthy", "running": 0, "waiting": 0, "kv_usage": 0.1, "cordoned": False,
         "out_of_routing": "unreachable"},
        {"id": "w2", "health": "healthy", "running": 0, "waiting": 0, "kv_usage": 0.1, "cordoned": False},
        {"id": "w3", "health": "healthy", "running": 0, "waiting": 0, "kv_usage": 0.0, "asleep": True}]}
    frame = build_frame(Scrape(1.0, health, parse_metrics("")))
    assert [w.out_of_routing for w in frame.workers] == ["cordoned", "unreachable", None, "asleep"]
    from rich.console import Console
    console = Console(width=160, record=True)
    console.print(render(frame, "http://x"))
    text = console.export_text()
    assert "out (cordoned)" in text and "out (asleep)" in text


def _transfer_scrape(t: float, ok: int, copied: int, failed_copies: int, health: dict) -> Scrape:
    text = (f"thunderagent_pd_transfers_ok_total {ok}\n"
            'thunderagent_pd_transfers_failed_total{cause="timeout"} 1\n'
            'thunderagent_pd_fallbacks_total{cause="plane_full"} 2\n'
            f"thunderagent_pd_transfer_bytes_total {ok * 250_000_000}\n"
            f"thunderagent_cache_migration_bytes_total {copied * 500_000_000}\n"
            f'thunderagent_cache_migration_copies_total{{outcome="ok"}} {copied}\n'
            f'thunderagent_cache_migration_copies_total{{outcome="timeout"}} {failed_copies}\n')
    return Scrape(t, {"status": "ok", "workers": [], **health}, parse_metrics(text))


def test_the_transfer_plane_line_shows_handoffs_bytes_copies_and_links_over_the_window():
    health = {"pd_links": [{"src": "p0", "dst": "d0", "samples": 3}, {"src": "p0", "dst": "d1", "samples": 0}],
              "cache_migration": {"planning": False}}
    frame = build_frame(_transfer_scrape(12.0, 10, 3, 1, health), _transfer_scrape(10.0, 4, 1, 1, health))
    t = frame.transfers
    assert t is not None
    assert (t.handoffs_per_s, t.handoffs_failed_per_s, t.local_per_s) == (3.0, 0.0, 0.0)  # 6 landed in 2 s
    # 6 handoffs x 250 MB + 2 copies x 500 MB in 2 s: 1.25 GB/s = 10 Gbit/s
    assert t.gbps == pytest.approx(10.0) and (t.copies_per_min, t.copies_failed_per_min) == (60.0, 0.0)
    assert (t.planning, t.links_learned) == (False, 1)
    from rich.console import Console
    console = Console(width=200, record=True)
    console.print(render(frame, "http://x"))
    out = console.export_text()
    assert "handoffs 3.0/s" in out and "KV moved 10.00 Gbit/s" in out and "planned by another frontend" in out
    # a fleet without a prefill group or migration: no line
    assert build_frame(_scrape(10.0, 1, 1, 0)).transfers is None
    only_pd = build_frame(_transfer_scrape(1.0, 1, 0, 0, {"pd_links": []}))
    assert only_pd.transfers is not None and only_pd.transfers.planning is None
