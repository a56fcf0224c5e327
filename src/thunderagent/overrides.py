"""Command-line overrides of a config: the config file (or the embedded default) with flags on top.

Shared by ``serve``, ``frontend`` and ``worker``; the result is validated as a whole, so a bad flag
is reported like a bad file field (``ConfigError`` naming it).
"""

from __future__ import annotations

from pathlib import Path

from thunderagent.config import Config, ConfigError, Policy, load_config, parse_config


def build_config(
    config: Path | None,
    host: str | None = None,
    port: int | None = None,
    workers: int | None = None,
    speedup: float | None = None,
    policy: Policy | None = None,
    *,
    model: str | None = None,
    engine: str | None = None,
    worker_endpoints: list[str] | None = None,
    block_size: int | None = None,
    nats_servers: str | None = None,
    relay: str | None = None,
    worker_api_key_env: str | None = None,
    admin_api: bool | None = None,
) -> Config:
    """The config file (or the embedded default) with command-line overrides applied on top.

    ``worker_endpoints`` (``--worker URL[=EVENTS[,REPLAY]]``) replace the node groups by one group of
    real ``engine`` servers; ``model`` is the local model directory they serve; ``relay`` sets every group's
    ``relay``; ``worker_api_key_env`` every ``--worker`` server's ``api_key_env``; ``admin_api``: the
    control plane's ``admin_api``."""
    cfg = load_config(config) if config else Config()
    data = cfg.model_dump(mode="json")
    if model is not None:
        data["model"] = model
        if data["model_name"] == Config.model_fields["model_name"].default:
            data["model_name"] = model  # what vLLM calls it by default: clients keep their model name
    if worker_endpoints:
        if workers is not None:
            raise ConfigError("--workers counts simulated workers; with --worker the servers are the workers")
        data["execution_group"]["nodes"] = [{
            "engine": engine or "vllm",
            "endpoints": [{**parse_worker_endpoint(w), **({"api_key_env": worker_api_key_env}
                                                           if worker_api_key_env is not None else {})}
                          for w in worker_endpoints],
            "block_size": block_size or data["execution_group"]["nodes"][0]["block_size"],
        }]
    elif worker_api_key_env is not None:
        raise ConfigError("--worker-api-key-env is the key of the --worker servers: give them with --worker")
    elif engine is not None and engine != "simulated":
        raise ConfigError(f"--engine {engine} needs at least one --worker URL=EVENTS (or endpoints in --config)")
    elif block_size is not None:
        for node in data["execution_group"]["nodes"]:
            node["block_size"] = block_size
    if relay is not None:  # --relay: every node group's (validated with the rest: off / unmodelled / all)
        for node in data["execution_group"]["nodes"]:
            node["relay"] = relay
    if host is not None:
        data["control_plane"]["host"] = host
    if port is not None:
        data["control_plane"]["port"] = port
    if admin_api is not None:
        data["control_plane"]["admin_api"] = admin_api
    if workers is not None:
        if len(data["execution_group"]["nodes"]) != 1:
            raise ConfigError("--workers only applies to a config with one node group; set counts in the file")
        data["execution_group"]["nodes"][0]["count"] = workers
    if speedup is not None:
        data["simulation"]["speedup"] = speedup
    if policy is not None:
        data["routing"]["policy"] = policy.value
    if nats_servers is not None:  # --nats URL[,URL...]: the servers of nats.servers
        data["nats"]["servers"] = [u.strip() for u in nats_servers.split(",") if u.strip()]
    return parse_config(data, str(config) if config else "<command line>")


def parse_worker_endpoint(spec: str) -> dict[str, str]:
    """``URL[=EVENTS[,REPLAY]]``: the engine's OpenAI base URL, its KV-event PUB endpoint and its
    replay endpoint, e.g. ``http://127.0.0.1:8101=tcp://127.0.0.1:5571,tcp://127.0.0.1:5572``."""
    url, _, zmq = spec.partition("=")
    events, _, replay = zmq.partition(",")
    out = {"url": url}
    if events:
        out["kv_events"] = events
    if replay:
        out["kv_replay"] = replay
    return out
