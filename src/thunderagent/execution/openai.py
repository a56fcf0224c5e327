"""Any OpenAI-compatible server as a worker (``engine: openai``): llama.cpp's server, TGI, Ollama,
vLLM or SGLang started without KV events.

The vLLM adapter (:class:`~thunderagent.execution.vllm.EngineWorker`) without its KV-event part, in
the :data:`OPENAI` flavour:

- **requests** are relayed unchanged (:mod:`~thunderagent.execution.openai_relay`): the client's
  body goes to the server byte for byte, the server's answer (SSE events or JSON) comes back as it
  was sent. Requests without a client body (a conformance check, a migrated continuation) go as
  token-id completions, like vLLM's;
- **the index** knows only the router's own predictions (no events: routing sends a repeated
  prefix back where it predicted the prefix is cached, until the prediction's TTL runs out);
- **load** is the in-flight accounting, raised to the server's own figures when it publishes a
  Prometheus ``/metrics`` page with names we know (vLLM, SGLang, llama.cpp, TGI); a server without
  ``/metrics`` (404) is polled on ``/v1/models`` for liveness only.
"""

from __future__ import annotations

from thunderagent.config import Config, EndpointConfig, NodeConfig
from thunderagent.execution.engine_metrics import EngineFlavor
from thunderagent.execution.handle import WorkerCallbacks, WorkerFactory, WorkerHandle
from thunderagent.execution.http_transport import HttpTransport
from thunderagent.execution.openai_relay import Relay
from thunderagent.execution.vllm import EngineWorker
from thunderagent.types import LoadReport

__all__ = ["OPENAI", "OpenAIWorker", "openai_factory"]

OPENAI = EngineFlavor(
    "openai",
    # the first name present on the page wins: vLLM, SGLang, llama.cpp (--metrics), TGI
    running=("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing",
             "tgi_batch_current_size"),
    waiting=("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred", "tgi_queue_size"),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
              "llamacpp:kv_cache_usage_ratio"),
    # no block-size refusal: without events our hashes are our own predictions, whatever the server's pages
    cache_info=None,
    return_token_ids=False,  # not an OpenAI field: a strict server would refuse it
    hints="any OpenAI-compatible server; /metrics optional",
    metrics_optional=True,
    states_limits=False,
    lists_models=True,
    sleep_state="vllm:engine_sleep_state",  # (a vLLM server's)
    pause_state="/is_paused",  # (a vLLM server's in its dev mode; any other answers 404 once and is not asked again)
)


class OpenAIWorker(EngineWorker):
    """:class:`EngineWorker` of a server without KV events, relaying passthrough requests."""

    def __init__(self, worker_id: str, node: NodeConfig, endpoint: EndpointConfig, callbacks: WorkerCallbacks, *,
                 heartbeat_interval: float, connect_timeout: float = 5.0,
                 transport: HttpTransport | None = None, lease: float | None = None) -> None:
        if endpoint.kv_events or endpoint.kv_replay:
            raise ValueError(f"{worker_id}: engine openai takes no kv_events / kv_replay endpoints")
        super().__init__(worker_id, node, endpoint, callbacks, heartbeat_interval=heartbeat_interval, flavor=OPENAI,
                         connect_timeout=connect_timeout, transport=transport, lease=lease)
        self._requests.relay = Relay(self._requests)

    def load(self) -> LoadReport:
        """The server's queue is invisible from outside: what was sent to it counts as running up to
        the node's ``max_batch_size`` and as waiting past it; a server that serves ``/metrics``
        raises both to its own figures (requests of other clients included)."""
        s = self._health.stats
        reqs = self._requests
        n, cap = len(reqs), self.node.max_batch_size
        total = s.num_blocks or self.node.kv_blocks
        assert self._loop is not None, "start() was not called"
        return LoadReport(self.worker_id, self._loop.time(), max(s.running, min(n, cap)), max(s.waiting, n - cap),
                          reqs.queued_tokens, reqs.decode_tokens, round(s.kv_usage * total), 0, total)


def openai_factory(cfg: Config) -> WorkerFactory:
    """The factory the fleet uses for nodes whose ``engine`` is ``openai``."""

    def make(node: NodeConfig, worker_id: str, k: int, callbacks: WorkerCallbacks) -> WorkerHandle:
        return OpenAIWorker(worker_id, node, node.endpoints[k], callbacks,
                            heartbeat_interval=cfg.control_plane.heartbeat_interval,
                            lease=cfg.control_plane.heartbeat_interval * cfg.control_plane.heartbeat_misses)

    return make
