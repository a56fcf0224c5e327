"""SGLang servers as workers: the vLLM adapter with SGLang's metric names.

SGLang publishes KV events in vLLM's envelope (``[ts, events, attn_dp_rank]``, tagged events, the
same ZMQ PUB + replay ROUTER), one ``BlockStored`` per page, so
:mod:`~thunderagent.execution.kv_frames` decodes both.
Start SGLang with ``--page-size`` equal to our ``block_size`` (its default page size is 1) and
``--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
"tcp://*:5558"}'``; ``--enable-cache-report`` puts ``cached_tokens`` in its usage. Its completions
stream carries no token ids: completion tokens are counted one per streamed chunk.

Status: event decoding is tested on SGLang-shaped frames; the HTTP side has not been run against a
real SGLang server here (no CPU build of SGLang is installable in the test environment).
"""

from __future__ import annotations

from thunderagent.config import Config
from thunderagent.execution.engine_metrics import EngineFlavor
from thunderagent.execution.vllm import engine_factory
from thunderagent.execution.handle import WorkerFactory

SGLANG = EngineFlavor(
    "sglang",
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    cache_info=None,  # page size is checked on the events' block_size
    return_token_ids=False,
    hints="--page-size N --enable-metrics --enable-cache-report --kv-events-config ...",
)


def sglang_factory(cfg: Config) -> WorkerFactory:
    return engine_factory(cfg, SGLANG)
