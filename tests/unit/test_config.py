from __future__ import annotations

from pathlib import Path

import pytest

from thunderagent.overrides import build_config
from thunderagent.config import Config, ConfigError, Policy, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_embedded_deployment():
    cfg = Config()
    assert cfg.control_plane.host == "127.0.0.1" and cfg.control_plane.port == 8000
    assert sum(n.count for n in cfg.execution_group.nodes) == 4
    assert cfg.routing.policy is Policy.kv_aware and cfg.routing.memory_watermark == 0.7


def test_example_yaml_loads():
    cfg = load_config(ROOT / "configs" / "example.yaml")
    node = cfg.execution_group.nodes[0]
    assert node.kv_blocks == 16384 and node.block_size == 64 and node.count == 4
    assert cfg.routing.policy is Policy.kv_aware


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"routing": {"policy": "fastest"}}, "routing.policy"),
        ({"control_plane": {"port": 70000}}, "control_plane.port"),
        ({"execution_group": {"nodes": [{"kv_blocks": 0}]}}, "execution_group.nodes.0.kv_blocks"),
        ({"execution_group": {"nodes": [{"role": "router"}]}}, "execution_group.nodes.0.role"),
        ({"routing": {"memory_watermark": 1.5}}, "routing.memory_watermark"),
        ({"routing": {"temprature": 1}}, "routing.temprature"),
        ({"execution_group": {"nodes": []}}, "execution_group"),
    ],
)
def test_bad_config_names_the_field(data, field):
    with pytest.raises(ConfigError) as exc:
        parse_config(data, "x.yaml")
    assert f"field '{field}'" in str(exc.value)
    assert str(exc.value).startswith("x.yaml:")


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)


def test_cli_overrides_apply_on_top_of_file():
    cfg = build_config(ROOT / "configs" / "example.yaml", port=9001, workers=2, policy=Policy.round_robin)
    assert cfg.control_plane.port == 9001
    assert cfg.execution_group.nodes[0].count == 2
    assert cfg.routing.policy is Policy.round_robin
    with pytest.raises(ConfigError, match="speedup"):
        build_config(None, speedup=-1.0)
    assert cfg.control_plane.admin_api is False  # off unless asked
    assert build_config(None, admin_api=True).control_plane.admin_api is True  # --admin-api
    on = ROOT / "configs" / "example.yaml"
    assert build_config(on, admin_api=False).control_plane.admin_api is False  # --no-admin-api


@pytest.mark.parametrize("data, field, words", [
    ({"routing": {"preempt_tier_weight": 2.0}}, "routing.preempt_tier_weight", "preempt_enabled: true"),
    ({"routing": {"preempt_enabled": True, "preempt_memory_cost_s": -1}}, "routing.preempt_memory_cost_s",
     "greater than or equal to 0"),
    ({"execution_group": {"nodes": [{"scheduling_policy": "priority"}]}},
     "execution_group.nodes.0.scheduling_policy", "engine simulated does not take it"),
    ({"model": "/m", "execution_group": {"nodes": [{"engine": "sglang", "scheduling_policy": "priority",
                                                    "endpoints": [{"url": "http://h:1"}]}]}},
     "execution_group.nodes.0.scheduling_policy", "engine sglang does not take it"),
    ({"routing": {"fallback_to_local": False}}, "routing",
     "fallback_to_local: false (strict disaggregation) needs disaggregation.mode always (it is conditional"),
    ({"routing": {"fallback_to_local": False, "disaggregation": {"mode": "always"}}}, "<root>",
     "routing.disaggregation acts only with a role: prefill node group"),
    ({"execution_group": {"nodes": [{"kv_cache_transfer": {"enabled": True}}]}},
     "<root>", "execution_group.nodes.0.kv_cache_transfer.enabled: the transfer plane is configured on the role: "
     "prefill group"),
    ({"execution_group": {"nodes": [{"kv_cache_transfer": {"bandwidth_gbps": 100}}]}},
     "execution_group.nodes.0.kv_cache_transfer.bandwidth_gbps", "acts only with kv_cache_transfer.enabled: true"),
    ({"execution_group": {"nodes": [{"role": "prefill"}, {"role": "decode"}]}},
     "<root>", "execution_group.nodes.0.kv_cache_transfer.enabled must be true on a role: prefill group"),
    ({"execution_group": {"nodes": [{"role": "prefill", "kv_cache_transfer": {"enabled": True}}]}},
     "<root>", "role prefill workers need a role decode or both group"),
    ({"routing": {"disaggregation": {"mode": "always"}}},
     "<root>", "routing.disaggregation acts only with a role: prefill node group"),
    ({"routing": {"route_key": "cookie:tenant"}}, "routing.route_key", "pattern"),
    ({"scheduler": {"max_wait_s": 0}}, "scheduler.max_wait_s", "greater than 0"),
    ({"routing": {"hot_prefix": {"max_replicas": 3}}}, "routing.hot_prefix.max_replicas",
     "acts only with routing.hot_prefix.enabled: true"),
    ({"routing": {"hot_prefix": {"enabled": True, "max_replicas": 0}}}, "routing.hot_prefix.max_replicas",
     "greater than or equal to 1"),
    ({"routing": {"hot_prefix": {"enabled": True, "room_backlog_passes": 1.0}}}, "routing.hot_prefix",
     "room_backlog_passes (1.0) must be below hot_backlog_passes (1.0)"),
    ({"routing": {"policy": "round_robin", "hot_prefix": {"enabled": True}}}, "routing",
     "hot_prefix.enabled acts with policy kv_aware only"),
])
def test_fields_that_would_need_unbuilt_features_are_refused_by_name(data, field, words) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data, "x.yaml")
    assert f"field '{field}'" in str(err.value) and words in str(err.value)


def test_a_disaggregated_fleet_is_accepted() -> None:
    cfg = parse_config({"execution_group": {"nodes": [
        {"role": "prefill", "count": 2, "max_batch_size": 32,
         "kv_cache_transfer": {"enabled": True, "bandwidth_gbps": 400, "max_inflight": 8}},
        {"role": "decode", "count": 6, "max_batch_size": 64}]},
        "routing": {"disaggregation": {"mode": "always"}}}, "x.yaml")
    pre, dec = cfg.execution_group.nodes
    assert pre.kv_cache_transfer.max_inflight == 8 and dec.max_batch_size == 64
    assert cfg.routing.disaggregation.mode == "always"
    strict = parse_config(cfg.model_dump() | {"routing": {"fallback_to_local": False,
                                                          "disaggregation": {"mode": "always"}}}, "x.yaml")
    from thunderagent.scheduler.disagg import make_disaggregator

    made = make_disaggregator(strict)
    assert not strict.routing.fallback_to_local and made is not None and made.strict
    assert make_disaggregator(cfg).strict is False  # type: ignore[union-attr]


def test_seed_fields_with_their_working_values_are_accepted() -> None:
    cfg = parse_config({"routing": {"preempt_enabled": False, "fallback_to_local": True, "route_key": "body:user"},
                        "scheduler": {"enabled": True, "max_queued": 10}}, "x.yaml")
    assert cfg.routing.route_key == "body:user" and cfg.scheduler.enabled and cfg.scheduler.max_queued == 10


def test_hot_prefix_switch_and_knobs_load_together() -> None:
    cfg = parse_config({"routing": {"hot_prefix": {"enabled": True, "max_replicas": 3, "retire_after_s": 5}}}, "x.yaml")
    hot = cfg.routing.hot_prefix
    assert (hot.enabled, hot.max_replicas, hot.retire_after_s, hot.min_requests) == (True, 3, 5.0, 2)
    assert parse_config({}, "x.yaml").routing.hot_prefix.enabled is False  # off by default (README: no gain measured)
    again = parse_config(cfg.model_dump(mode="json"), "x.yaml")
    assert again.routing.hot_prefix == hot


def test_preemption_switch_and_knobs_act_together() -> None:
    cfg = parse_config({"routing": {"preempt_enabled": True, "preempt_tier_weight": 3.0,
                                    "preempt_memory_cost_s": 0.0}}, "x.yaml")
    assert (cfg.routing.preempt_tier_weight, cfg.routing.preempt_memory_cost_s) == (3.0, 0.0)
    # a dumped config (defaults filled in) loads again, with the switch off
    again = parse_config(parse_config({}, "x.yaml").model_dump(mode="json"), "x.yaml")
    assert again.routing.preempt_enabled is False
    # the switch acts in simulated engines only: a fleet of vLLM servers is pointed at vLLM's own policy
    with pytest.raises(ConfigError, match="scheduling_policy: priority"):
        parse_config({"model": "/m", "routing": {"preempt_enabled": True}, "execution_group": {"nodes": [
            {"engine": "vllm", "endpoints": [{"url": "http://h:1"}]}]}}, "x.yaml")
    vllm = parse_config({"model": "/m", "execution_group": {"nodes": [
        {"engine": "vllm", "scheduling_policy": "priority", "endpoints": [{"url": "http://h:1"}]}]}}, "x.yaml")
    assert vllm.execution_group.nodes[0].scheduling_policy == "priority"


def test_pacing_knobs_need_the_switch_and_hysteresis() -> None:
    cfg = parse_config({"scheduler": {"pacing": {"enabled": True, "pause_threshold": 1.5, "resume_threshold": 1.2,
                                                 "accounting": "paper", "placement": "most_free"}}})
    p = cfg.scheduler.pacing
    assert (p.enabled, p.pause_threshold, p.accounting.value, p.placement.value) == (True, 1.5, "paper", "most_free")
    with pytest.raises(ConfigError, match=r"scheduler\.pacing\.tick_s.*scheduler\.pacing\.enabled: true"):
        parse_config({"scheduler": {"pacing": {"tick_s": 2.0}}})
    with pytest.raises(ConfigError, match="resume_threshold .* must be below pause_threshold"):
        parse_config({"scheduler": {"pacing": {"enabled": True, "resume_threshold": 0.95}}})
    with pytest.raises(ConfigError, match=r"scheduler\.pacing\.placement"):
        parse_config({"scheduler": {"pacing": {"enabled": True, "placement": "anywhere"}}})


def test_pacing_idle_resume_cached_needs_work_conservation() -> None:
    cfg = parse_config({"scheduler": {"pacing": {"enabled": True, "idle_resume": "cached"}}})
    assert cfg.scheduler.pacing.idle_resume.value == "cached" and cfg.scheduler.pacing.work_conserving
    with pytest.raises(ConfigError, match=r"idle_resume: cached .* work_conserving: true"):
        parse_config({"scheduler": {"pacing": {"enabled": True, "idle_resume": "cached", "work_conserving": False}}})
    with pytest.raises(ConfigError, match=r"scheduler\.pacing\.idle_resume.*scheduler\.pacing\.enabled: true"):
        parse_config({"scheduler": {"pacing": {"idle_resume": "cached"}}})


def test_tokenizer_knobs_act_or_are_refused() -> None:
    tok = parse_config({"control_plane": {"tokenizer": {"threads": 4, "offload_bytes": 1024}}}).control_plane.tokenizer
    assert (tok.threads, tok.offload_bytes, tok.prefix_cache_mb) == (4, 1024, 64.0)
    assert parse_config({"model": "/m", "control_plane": {"tokenizer": {"prefix_cache_mb": 0}}}).model == "/m"
    with pytest.raises(ConfigError, match=r"control_plane\.tokenizer\.offload_bytes.*threads > 0"):
        parse_config({"control_plane": {"tokenizer": {"threads": 0, "offload_bytes": 1024}}})
    with pytest.raises(ConfigError, match=r"prefix_cache_mb acts only with `model`"):
        parse_config({"control_plane": {"tokenizer": {"prefix_cache_mb": 8}}})
    with pytest.raises(ConfigError, match=r"control_plane\.tokenizer\.threads"):
        parse_config({"control_plane": {"tokenizer": {"threads": -1}}})
