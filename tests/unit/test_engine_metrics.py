"""Engine load from Prometheus text (vLLM and SGLang pages)."""

from __future__ import annotations

from thunderagent.execution.sglang import SGLANG
from thunderagent.execution.engine_metrics import VLLM, engine_stats, parse_prometheus

# Lines as vLLM 0.32 (CPU build) serves them, with the histogram noise they sit in.
VLLM_PAGE = """\
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.79595776048e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/tmp/tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="/tmp/tiny"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="/tmp/tiny",reason="capacity"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/tiny"} 0.25
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="/tmp/tiny"} 0.0
vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",num_cpu_blocks="None",num_gpu_blocks="16384",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_vllm_page():
    s = engine_stats(VLLM_PAGE, VLLM)
    assert (s.running, s.waiting, s.kv_usage) == (3, 2, 0.25)
    assert (s.block_size, s.num_blocks, s.prefix_caching) == (32, 16384, True)
    assert s.start_time == 1.79595776048e09


def test_data_parallel_engines_are_summed_and_usage_averaged():
    page = """\
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4
"""
    s = engine_stats(page, VLLM)
    assert s.running == 3 and abs(s.kv_usage - 0.3) < 1e-9 and s.block_size is None
    # one rank listed as a worker of its own (data_parallel_rank): its samples alone; unlabelled ones are the server's
    ranked = page + 'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="900"} 1.0\n' \
                    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="800"} 1.0\n' \
                    "process_start_time_seconds 1234.5\n"
    one = engine_stats(ranked, VLLM, "1")
    assert (one.running, one.kv_usage, one.num_blocks, one.start_time) == (2, 0.4, 900, 1234.5)
    assert engine_stats(ranked, VLLM, "0").num_blocks == 800


def test_older_vllm_usage_name_and_missing_info():
    s = engine_stats('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n', VLLM)
    assert s.kv_usage == 0.5 and s.prefix_caching is None


def test_sglang_page():
    page = """\
sglang:num_running_reqs{model_name="m",tp_rank="0"} 4.0
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1.0
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
"""
    s = engine_stats(page, SGLANG)
    assert (s.running, s.waiting, s.kv_usage, s.block_size) == (4, 1, 0.5, None)


def test_parser_skips_garbage_and_unwanted():
    out = parse_prometheus('x 1\nvllm:num_requests_running{a="b \\" c"} 2\nvllm:num_requests_running nan?\n',
                           frozenset({"vllm:num_requests_running"}))
    assert out == {"vllm:num_requests_running": [({"a": 'b \\" c'}, 2.0)]}


def test_vllm_sleep_state():
    """vLLM's ``vllm:engine_sleep_state``: ``awake`` 1 on every engine is awake; 0 on any (a sleep of any level, a KV
    release) is asleep; a page without the gauge (an older vLLM, SGLang) says nothing."""
    def page(*awake: int) -> str:
        return "".join(f'vllm:engine_sleep_state{{engine="{k}",model_name="m",sleep_state="{state}"}} {value}.0\n'
                       for k, a in enumerate(awake)
                       for state, value in (("awake", a), ("weights_offloaded", 1 - a), ("discard_all", 0)))

    assert engine_stats(VLLM_PAGE + page(1), VLLM).asleep is False
    assert engine_stats(VLLM_PAGE + page(0), VLLM).asleep is True
    assert engine_stats(page(1, 0), VLLM).asleep is True  # (one data-parallel engine asleep)
    assert engine_stats(VLLM_PAGE, VLLM).asleep is None
    assert engine_stats(page(0), SGLANG).asleep is None  # (not read there)


def test_vllm_nixl_pulls_are_read_summed_and_per_rank():
    """A decode server's NIXL connector's reads (vLLM 0.32: per-engine histograms on the reading side): bytes and
    seconds summed over its transfers, and their count, cumulative; one data-parallel rank's alone when asked."""
    page = """\
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="m"} 2.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.012
vllm:nixl_xfer_time_seconds_count{engine="1",model_name="m"} 1.0
vllm:nixl_xfer_time_seconds_sum{engine="1",model_name="m"} 0.004
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 196608.0
vllm:nixl_bytes_transferred_sum{engine="1",model_name="m"} 65536.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 3.0
"""
    assert engine_stats(page, VLLM).kv_pulls == (262144.0, 0.016, 4.0)
    assert engine_stats(page, VLLM, engine="1").kv_pulls == (65536.0, 0.004, 1.0)
    assert engine_stats(VLLM_PAGE, VLLM).kv_pulls is None  # (no NIXL connector: not said)
    assert engine_stats(page, SGLANG).kv_pulls is None


def test_vllm_prefill_figures_are_read_summed_and_per_rank():
    """A server's computed prompt tokens (cached ones not counted) and its requests' seconds in prefill, both
    cumulative sums of vLLM's per-request histograms: its measured prefill rate (cache migration's recompute time)."""
    page = """\
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="128.0",model_name="m"} 1.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 3000.0
vllm:request_prefill_kv_computed_tokens_sum{engine="1",model_name="m"} 1000.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.5
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 0.5
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 4.0
"""
    assert engine_stats(page, VLLM).prefill == (4000.0, 2.0)
    assert engine_stats(page, VLLM, engine="1").prefill == (1000.0, 0.5)
    assert engine_stats(VLLM_PAGE, VLLM).prefill is None  # (an older vLLM without the computed-tokens histogram)
    assert engine_stats(page, SGLANG).prefill is None
