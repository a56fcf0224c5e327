"""A fake vLLM server run with ``--data-parallel-size N``: N :class:`FakeEngine` ranks (each its own prefix cache and
KV-event sockets, as vLLM's engine cores have) behind one HTTP port, as vLLM's API server fronts its ranks.

As vLLM 0.32 does: a request naming ``X-data-parallel-rank: R`` goes to rank R (none: rank 0 here; vLLM would
balance it), ``/metrics`` carries each rank's samples labelled ``engine="R"`` (the process start time once), and an
operator's path (``/pause``, ``/sleep``, ``/collective_rpc``...) acts on every rank at once. ``calls`` records each
request the front received: (method, path with query, the rank header or None)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from support.fake_engine import FakeEngine

RANK_HEADER = "X-data-parallel-rank"
#: paths that act on the whole server (every rank), answered with rank 0's answer
_SERVER_WIDE = re.compile(r"^/(pause|resume|sleep|wake_up|reset_prefix_cache|collective_rpc|abort_requests|"
                          r"v1/load_lora_adapter|v1/unload_lora_adapter|start_profile|stop_profile)$")


@dataclass
class FakeDpServer:
    ranks: list[FakeEngine]
    url: str = ""
    calls: list[tuple[str, str, str | None]] = field(default_factory=list)

    async def start(self) -> None:
        for e in self.ranks:
            await e.start()
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._front)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()
        for e in self.ranks:
            await e.stop()

    def endpoints(self) -> list[dict[str, object]]:
        """The config's endpoints: one per rank, the server's url with the rank's own KV-event sockets."""
        return [{"url": self.url, "kv_events": e.events, "kv_replay": e.replay, "data_parallel_rank": r}
                for r, e in enumerate(self.ranks)]

    async def _front(self, request: web.Request) -> web.StreamResponse:
        rank = request.headers.get(RANK_HEADER)
        self.calls.append((request.method, request.path_qs, rank))
        if request.path == "/metrics":
            return web.Response(text=await self._metrics(), content_type="text/plain")
        body = await request.read()
        if _SERVER_WIDE.match(request.path):
            answers = await asyncio.gather(*(self._forward(request, e, body) for e in self.ranks))
            status, headers, data = answers[0]
            return web.Response(status=status, body=data, content_type=headers.get("Content-Type", "application/json")
                                .split(";")[0])
        target = self.ranks[int(rank) if rank is not None else 0]
        async with self._session.request(request.method, target.url + request.path_qs, data=body or None,
                                         headers=_passed(request.headers)) as resp:
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.headers.get(
                "Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def _forward(self, request: web.Request, e: FakeEngine, body: bytes) -> tuple[int, dict[str, str], bytes]:
        async with self._session.request(request.method, e.url + request.path_qs, data=body or None,
                                         headers=_passed(request.headers)) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def _metrics(self) -> str:
        lines: list[str] = []
        for r, e in enumerate(self.ranks):
            async with self._session.get(e.url + "/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("process_start_time_seconds") and r:
                    continue  # (one process: the API server's)
                if line.startswith("vllm:cache_config_info"):
                    line = line.replace("{", f'{{engine="{r}",', 1)
                lines.append(line.replace('engine="0"', f'engine="{r}"'))
        return "\n".join(lines) + "\n"


def _passed(headers: object) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in ("content-type", "authorization")}  # type: ignore[attr-defined]
