"""The engine adapters' KV-event streams on ``/metrics`` (``Metrics.watch_kv_streams``), read at each
scrape, and which of a static membership's workers have one."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from thunderagent.config import ExecutionGroupConfig
from thunderagent.control.membership import StaticMembership
from thunderagent.control.metrics import Metrics
from thunderagent.execution.kv_stream import StreamStats


def samples(text: str, name: str) -> dict[tuple[str, str], float]:
    return {(s.labels["worker"], s.labels["outcome"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name}


def test_stream_counters_are_read_at_each_scrape() -> None:
    m = Metrics()
    streams = {"worker-1": StreamStats(batches=7, duplicates=2, gaps=1, replays=2, catch_ups=1, resyncs=0,
                                       restarts=1, decode_errors=3)}
    m.watch_kv_streams(lambda: streams)
    got = samples(m.render().decode(), "thunderagent_kv_event_batches_total")
    assert got == {("worker-1", "applied"): 7, ("worker-1", "duplicate"): 2, ("worker-1", "gap"): 1,
                   ("worker-1", "replay"): 2, ("worker-1", "catch_up"): 1, ("worker-1", "resync"): 0,
                   ("worker-1", "engine_restart"): 1, ("worker-1", "undecodable"): 3}
    streams["worker-1"].batches += 5  # the stream moved on: the next scrape says so
    streams["worker-2"] = StreamStats(catch_ups=1)
    got = samples(m.render().decode(), "thunderagent_kv_event_batches_total")
    assert got[("worker-1", "applied")] == 12 and got[("worker-2", "catch_up")] == 1 and len(got) == 16


class _Engine:  # an engine adapter as far as the membership reads it
    def __init__(self, stats: StreamStats) -> None:
        self.stats = stats

    def kv_stream_stats(self) -> StreamStats:
        return self.stats


def test_only_engine_adapters_export_a_stream() -> None:
    membership = StaticMembership(ExecutionGroupConfig(), {"simulated": lambda *a: None})  # type: ignore[arg-type,return-value]
    stats = StreamStats(batches=4)
    membership.handles = {"worker-0": object(), "worker-1": _Engine(stats)}  # type: ignore[dict-item]
    assert membership._kv_streams() == {"worker-1": stats}
