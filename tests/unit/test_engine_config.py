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
    ({"model": "m", "worker_api_key_env": "K"}, "--worker-api-key-env is the key of the --worker servers"),
    ({"model": "m", "worker_api_key_env": "", "worker_endpoints": ["http://h:1"]}, "api_key_env"),
])
def test_bad_engine_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config(None, **kwargs)


def test_yaml_form_needs_a_model_dir() -> None:
    nodes = {"nodes": [{"engine": "vllm", "endpoints": [{"url": "http://h:1", "kv_events": "tcp://h:2"}]}]}
    with pytest.raises(ConfigError, match="engine vllm needs `model`"):
        parse_config({"execution_group": nodes})
    assert parse_config({"execution_group": nodes, "model": "/m"}).execution_group.nodes[0].count == 1


def test_a_servers_api_key_comes_from_its_environment_variable_or_file(tmp_path, monkeypatch) -> None:
    from thunderagent.config.auth import server_api_key

    cfg = build_config(None, model="m", engine="openai", worker_endpoints=["http://h:1", "http://h:2"],
                       worker_api_key_env="VLLM_KEY")
    assert [e.api_key_env for e in cfg.execution_group.nodes[0].endpoints] == ["VLLM_KEY", "VLLM_KEY"]
    monkeypatch.setenv("VLLM_KEY", " sk-server-123\n")
    assert server_api_key("VLLM_KEY", None, "http://h:1") == "sk-server-123"
    (tmp_path / "key").write_text("sk-from-file\n# a comment line after it\n")
    assert server_api_key(None, str(tmp_path / "key"), "http://h:1") == "sk-from-file"
    assert server_api_key(None, None, "http://h:1") is None
    monkeypatch.delenv("VLLM_KEY")
    with pytest.raises(ConfigError, match="'api_key_env': environment variable VLLM_KEY is not set"):
        server_api_key("VLLM_KEY", None, "http://h:1")
    for bad in ("", "two words", "sk-\x7f"):
        monkeypatch.setenv("VLLM_KEY", bad)
        with pytest.raises(ConfigError, match="'api_key_env' of the endpoint http://h:1: holds no key") as err:
            server_api_key("VLLM_KEY", None, "http://h:1")
        assert bad.strip() == "" or bad not in str(err.value)  # the key is never shown
    with pytest.raises(ConfigError, match="api_key_file': cannot read"):
        server_api_key(None, str(tmp_path / "missing"), "http://h:1")
    with pytest.raises(ConfigError, match="set one"):
        parse_config({"model": "m", "execution_group": {"nodes": [{"engine": "openai", "endpoints": [
            {"url": "http://h:1", "api_key_env": "A", "api_key_file": "/k"}]}]}}, "test")
