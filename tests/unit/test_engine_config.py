"""Attaching real engines: `serve --model --engine --worker` and the config checks behind it."""

from __future__ import annotations

import pytest

from thunderagent.overrides import build_config, parse_worker_endpoint
from thunderagent.config import ConfigError, parse_config


def test_worker_option_forms() -> None:
    assert parse_worker_endpoint("http://127.0.0.1:8101") == {"url": "http://127.0.0.1:8101"}
    assert parse_worker_endpoint("http://h:8101=tcp://h:5571") == {"url": "http://h:8101", "kv_events": "tcp://h:5571"}
    assert parse_worker_endpoint("http://h:8101=ipc:///tmp/a.sock,tcp://h:5572") == {
        "url": "http://h:8101", "kv_events": "ipc:///tmp/a.sock", "kv_replay": "tcp://h:5572"}


def test_serve_options_build_one_vllm_node() -> None:
    cfg = build_config(None, model="/models/llama", engine="vllm", block_size=32, worker_endpoints=[
        "http://127.0.0.1:8101=tcp://127.0.0.1:5571,tcp://127.0.0.1:5572", "http://127.0.0.1:8102=tcp://127.0.0.1:5573"])
    (node,) = cfg.execution_group.nodes
    assert (node.engine, node.count, node.block_size) == ("vllm", 2, 32)
    assert [e.kv_replay for e in node.endpoints] == ["tcp://127.0.0.1:5572", None]
    assert cfg.model == cfg.model_name == "/models/llama"  # clients keep the name they use with vLLM


def test_engine_defaults_to_vllm_and_sglang_is_accepted() -> None:
    assert build_config(None, model="m", worker_endpoints=["http://h:1"]).execution_group.nodes[0].engine == "vllm"
    cfg = build_config(None, model="m", engine="sglang", worker_endpoints=["http://h:1=tcp://h:2"])
    assert cfg.execution_group.nodes[0].engine == "sglang"


@pytest.mark.parametrize("kwargs, match", [
    ({"worker_endpoints": ["http://h:1"]}, "needs `model`"),
    ({"model": "m", "engine": "vllm"}, "needs at least one --worker"),
    ({"model": "m", "worker_endpoints": ["h:1"]}, "url must start with http"),
    ({"model": "m", "worker_endpoints": ["http://h:1=udp://h:2"]}, "kv_events must be a tcp:// or ipc://"),
    ({"model": "m", "workers": 2, "worker_endpoints": ["http://h:1"]}, "--workers counts simulated"),
])
def test_bad_engine_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(None, **kwargs)


def test_yaml_form_needs_a_model_dir() -> None:
    nodes = {"nodes": [{"engine": "vllm", "endpoints": [{"url": "http://h:1", "kv_events": "tcp://h:2"}]}]}
    with pytest.raises(ConfigError, match="engine vllm needs `model`"):
        parse_config({"execution_group": nodes})
    assert parse_config({"execution_group": nodes, "model": "/m"}).execution_group.nodes[0].count == 1
