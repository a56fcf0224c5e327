"""A real vLLM server (CPU build) run with ``--data-parallel-size 2``, listed once per rank (``data_parallel_rank``):
each rank is a worker of its own, fed by its own KV-event socket (vLLM adds the rank to the port), and every request
names its rank (``X-data-parallel-rank``): a conversation's later turns go back to the rank that holds its prefix,
and vLLM itself reports the prefix cached there; each rank's load comes from its own ``engine`` samples; a pause
through ThunderAgent reaches the server and marks both ranks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from support.waiting import free_port_pair, wait_until
from tests.engines.conftest import engine_python, one_server, thunderagent
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer
from thunderagent.config import parse_config

pytestmark = pytest.mark.real_engine
RANKS = 2


@dataclass
class DpServer(VllmServer):
    """A data-parallel server: KV events on ``tcp://*:P`` (vLLM refuses an ipc:// endpoint for ranks past 0; it
    binds ``*``), ranks at P, P + 1; replay likewise from ``replay_port``."""

    events_port: int = field(default_factory=free_port_pair)

    def new_ports(self) -> None:
        super().new_ports()
        self.events_port, self.replay_port = free_port_pair(), free_port_pair()

    @property
    def events(self) -> str:
        return f"tcp://*:{self.events_port}"

    def rank_endpoints(self) -> list[dict[str, object]]:
        return [{"url": self.url, "kv_events": f"tcp://127.0.0.1:{self.events_port + r}",
                 "kv_replay": f"tcp://127.0.0.1:{self.replay_port + r}", "data_parallel_rank": r}
                for r in range(RANKS)]


@pytest.fixture(scope="module")
def dp_server(engine_tmp: Path, tiny_model_dir: Path) -> Iterator[DpServer]:
    workdir = engine_tmp / "vllm-dp"
    server = DpServer("dp", engine_python(workdir), tiny_model_dir, workdir, replay_port=free_port_pair(),
                      extra_args=("--data-parallel-size", str(RANKS)))
    with one_server(server, "vLLM data-parallel server (2 ranks)"):
        yield server


async def test_each_rank_of_a_data_parallel_server_is_routed_on_its_own_cache(tiny_model_dir: Path,
                                                                              dp_server: DpServer) -> None:
    cfg = parse_config({
        "model": str(tiny_model_dir), "model_name": "tiny", "routing": {"seed": 7},
        "control_plane": {"heartbeat_interval": 0.5, "heartbeat_misses": 10, "admin_api": True},
        "execution_group": {"nodes": [{"engine": "vllm", "block_size": BLOCK_SIZE,
                                       "endpoints": dp_server.rank_endpoints()}]},
    }, "test")
    async with thunderagent(cfg, [dp_server]) as front, aiohttp.ClientSession() as s:
        fleet = front.fleet
        homes: dict[int, str] = {}
        for turn in range(3):
            for conv in range(2):
                prompt = f"conversation {conv}: " + "a long shared prefix of this conversation " * 6 + f"turn {turn}"
                raw = await front.client.completions.with_raw_response.create(model=front.model, prompt=prompt,
                                                                              max_tokens=2, timeout=60)
                worker, out = raw.headers["x-thunderagent-worker"], raw.parse()
                homes.setdefault(conv, worker)
                assert worker == homes[conv], (conv, turn, worker, homes)
                cached = out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0
                if turn:  # vLLM's own count: the rank the header named holds the conversation's prefix
                    assert cached >= 2 * BLOCK_SIZE, (conv, turn, cached)
            if turn == 0:  # the first turns' blocks, from each rank's own socket, on its own worker
                await wait_until(lambda: all(len(fleet.index.confirmed_blocks(w)) >= 2 for w in set(homes.values())),
                                 30, "each rank's KV events indexed on its worker")
        assert set(homes.values()) == set(fleet.workers)  # (two conversations on two idle ranks: one each)
        async with s.post(front.base_url + "/pause?mode=keep&clear_cache=false") as r:
            assert r.status == 200 and [w["success"] for w in (await r.json())["workers"]] == [True, True]
        assert fleet.paused == set(fleet.workers)
        async with s.post(front.base_url + "/resume") as r:
            assert r.status == 200
        assert not fleet.paused
