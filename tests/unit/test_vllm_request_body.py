"""What the vLLM adapter sends: token ids, limits, tenant salt, the client's sampling settings and priority."""

from __future__ import annotations

from thunderagent.config import EndpointConfig, NodeConfig
from thunderagent.execution.vllm import EngineWorker
from support.callbacks import Recorder
from thunderagent.types import EngineRequest, Sampling


def make_worker(**node_fields: str) -> EngineWorker:
    node = NodeConfig(engine="vllm", block_size=32, endpoints=[EndpointConfig(url="http://127.0.0.1:9")],
                      **node_fields)
    cb = Recorder().callbacks()
    return EngineWorker("w0", node, node.endpoints[0], cb, heartbeat_interval=1.0)


def test_body_forwards_only_what_the_client_set():
    w = make_worker()
    req = EngineRequest("r1", [1, 2, 3], [], 0, 7, cache_salt="tenant-a",
                        sampling=Sampling(temperature=0.0, top_p=None, seed=42))
    body = w._body(req, "/models/m")
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 7 and body["stream"] is True
    assert body["cache_salt"] == "tenant-a"
    assert body["temperature"] == 0.0 and body["seed"] == 42
    assert "top_p" not in body  # unset: vLLM's default applies


def test_body_without_sampling_keeps_engine_defaults():
    body = make_worker()._body(EngineRequest("r2", [5], [], 0, 1), "/models/m")
    assert not {"temperature", "top_p", "seed", "cache_salt"} & set(body)
    assert body["model"] == "/models/m"


def test_priority_goes_to_vllm_negated_only_under_its_priority_policy():
    high = EngineRequest("r3", [5], [], 0, 1, priority=3)
    low = EngineRequest("r4", [5], [], 0, 1, priority=-2)
    # fcfs (the default): vLLM would ignore or refuse the field, so none is sent; our priority acts in
    # ThunderAgent's own holding queue only
    assert "priority" not in make_worker()._body(high, "/models/m")
    w = make_worker(scheduling_policy="priority")
    assert w._body(high, "/models/m")["priority"] == -3  # vLLM serves lower values first
    assert w._body(low, "/models/m")["priority"] == 2
    assert "priority" not in w._body(EngineRequest("r5", [5], [], 0, 1), "/models/m")  # 0: vLLM's default
