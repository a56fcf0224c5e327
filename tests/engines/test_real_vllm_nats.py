"""Sampling parameters reach a real vLLM server behind a NATS worker; so does a relayed request.

nats-server, one ``thunderagent worker`` process attached to one of the session's vLLM servers and one
``thunderagent frontend`` process, all on 127.0.0.1, driven with the official OpenAI client. The
client's ``temperature`` / ``seed`` cross the bus in ``GenerateRequest`` and the worker sends them to
vLLM: greedy output is reproducible, a seed reproduces a sample, and both equal what vLLM itself
answers to the same token ids with the same parameters.

Were the sampling fields dropped on the wire, the worker would send vLLM no ``temperature`` and no
``seed`` (``VllmWorker._body`` adds only what the request carries), so vLLM would sample every request
at its default temperature 1.0 (the tiny model's generation_config sets none), unseeded. The tiny
model's random weights give a nearly flat next-token distribution over ~570 tokens: two unseeded
24-token samples practically never agree, so every equality below would fail.

The prompt stays under one KV block: no request hits vLLM's prefix cache, so every request computes
the same prompt the same way (the flat distribution leaves greedy decoding little margin).
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import free_port, wait_until_blocking

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

from openai import OpenAI  # noqa: E402

from tests.engines.conftest import note  # noqa: E402
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer  # noqa: E402
from tests.integration.nats_cluster import Cluster  # noqa: E402
from thunderagent.frontend.hf_tokenizer import HfTokenizer  # noqa: E402

pytestmark = [pytest.mark.real_engine, pytest.mark.nats]

MODEL_NAME = "tiny"
PROMPT = "the router sends every request to the worker"
MAX_TOKENS = 24
SEEDS = (11, 12, 13)

CONFIG = """\
model: {model}
model_name: {name}
control_plane: {{heartbeat_interval: 0.5, heartbeat_misses: 10}}
routing: {{seed: 7}}
execution_group:
  nodes:
    - engine: vllm
      block_size: {block_size}
      endpoints:
        - {{url: "{url}", kv_events: "{events}", kv_replay: "{replay}"}}
"""


@pytest.fixture
def deployment(tmp_path: Path, vllm_servers: list[VllmServer], tiny_model_dir: Path) -> Iterator[Cluster]:
    """nats-server, worker ``w0`` on the first vLLM server, frontend ``fa``; all killed afterwards."""
    server = vllm_servers[0]
    cluster = Cluster(tmp_path)  # writes a simulated-engine config: replaced by the vLLM one
    cluster.config.write_text(CONFIG.format(
        model=tiny_model_dir, name=MODEL_NAME, block_size=BLOCK_SIZE, url=server.url, events=server.events,
        replay=server.replay))
    try:
        t0 = time.monotonic()
        cluster.start_nats()
        cluster.ports["w0-metrics"] = free_port()  # the worker process's own endpoint
        cluster.start_worker("w0", "--metrics-port", str(cluster.ports["w0-metrics"]))
        cluster.start_frontend("fa")

        def worker_listed() -> bool:
            for name in ("nats", "w0", "fa"):
                if cluster.exited(name):  # pytest.fail is no Exception: not retried
                    pytest.fail(f"{name} exited ({cluster.procs[name].returncode}):\n{cluster.logs()}")
            return cluster.workers("fa") == {"w0"}

        wait_until_blocking(worker_listed, 90, "the frontend to list worker w0 as healthy")
        note(f"NATS deployment (frontend + vLLM worker) up in {time.monotonic() - t0:.0f}s")
        yield cluster
    finally:
        cluster.close()
        print(cluster.logs())  # captured: pytest shows it only when the test failed


def _client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_sampling_parameters_reach_vllm_behind_a_nats_worker(
    deployment: Cluster, vllm_servers: list[VllmServer], tiny_model_dir: Path
) -> None:
    front = _client(f"http://127.0.0.1:{deployment.ports['fa']}/v1")
    engine = _client(f"{vllm_servers[0].url}/v1")
    # the token ids the frontend sends vLLM for PROMPT: the same tokenizer, the same call
    ids = HfTokenizer(tiny_model_dir).encode(PROMPT)
    assert 0 < len(ids) < BLOCK_SIZE, "the prompt must stay under one block (no prefix-cache hits)"

    def via(**sampling: float | int) -> str:
        raw = front.completions.with_raw_response.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                         **sampling)  # type: ignore[arg-type]
        assert raw.headers["x-thunderagent-worker"] == "w0"
        out = raw.parse()
        assert out.usage is not None and out.usage.prompt_tokens == len(ids), "frontend tokenized differently"
        assert out.choices[0].finish_reason in ("length", "stop")
        return out.choices[0].text

    def direct(**sampling: float | int) -> str:
        out = engine.completions.create(model=str(tiny_model_dir), prompt=ids, max_tokens=MAX_TOKENS,
                                        **sampling)  # type: ignore[arg-type]
        return out.choices[0].text

    try:
        # (a) greedy: reproducible through ThunderAgent, and what vLLM itself decodes
        greedy = via(temperature=0)
        assert greedy, "greedy decoding produced no text"
        assert via(temperature=0) == greedy
        assert direct(temperature=0) == greedy

        # (b) seeded sampling: a seed reproduces its sample, through ThunderAgent and at the engine
        samples = {}
        for seed in SEEDS:
            samples[seed] = via(temperature=1.0, seed=seed)
            assert via(temperature=1.0, seed=seed) == samples[seed], f"seed {seed} not reproduced"
            assert direct(temperature=1.0, seed=seed) == samples[seed], f"seed {seed}: vLLM itself samples otherwise"
        assert len(set(samples.values())) > 1, f"different seeds gave one text: {samples}"
        assert any(s != greedy for s in samples.values()), "temperature 1.0 sampled exactly the greedy text"

        # (c) a request the token path does not model (tools, logprobs) is relayed over the bus with the
        # client's body (GenerateRequest.passthrough) and answered by vLLM as it would answer it directly
        raw = front.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, logprobs=True,
            top_logprobs=2, tools=[{"type": "function", "function": {"name": "read_file", "parameters": {}}}],
            tool_choice="none", extra_body={"ignore_eos": True})
        assert raw.headers["x-thunderagent-worker"] == "w0"
        content = raw.parse().choices[0].logprobs.content  # type: ignore[union-attr]
        assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)

        # (d) the worker process's own metrics: the nine requests it served, its vLLM server's KV-event stream
        # (read by the adapter in this process, so exported here) and the server's KV size
        with urllib.request.urlopen(f"http://127.0.0.1:{deployment.ports['w0-metrics']}/metrics", timeout=10) as r:
            text = r.read().decode()
        series = {k: float(v) for k, v in re.findall(r"^(thunderagent_\S+) (\S+)$", text, re.MULTILINE)}
        done = sum(v for k, v in series.items() if k.startswith("thunderagent_worker_process_requests_finished_total"))
        assert series['thunderagent_worker_process_requests_accepted_total{worker="w0"}'] == 9 and done == 9, text
        info = r'^thunderagent_worker_process_info\{engine="vllm",instance="\w+",role="both",worker="w0"\} 1\.0$'
        assert re.search(info, text, re.MULTILINE), text
        assert 'thunderagent_kv_event_batches_total{outcome="applied",worker="w0"}' in series, text
        assert series['thunderagent_kv_event_batches_total{outcome="undecodable",worker="w0"}'] == 0
        assert series['thunderagent_worker_process_engine_kv_total_blocks{worker="w0"}'] > 0
    finally:
        front.close()
        engine.close()
