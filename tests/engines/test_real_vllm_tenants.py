"""Tenants against a real vLLM server: with API keys on, the body sent to vLLM carries the
tenant-derived ``cache_salt``, so vLLM's own prefix cache gives 0 cached tokens across tenants and
hits within one. Keys are generated at run time."""

from __future__ import annotations

import random
import secrets
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.engines.conftest import front_config, thunderagent
from tests.engines.vllm_env import BLOCK_SIZE, VllmServer
from thunderagent.config import parse_config
from thunderagent.execution import engine_requests

pytestmark = pytest.mark.real_engine


async def test_tenants_do_not_share_vllms_prefix_cache(
    vllm_servers: list[VllmServer], tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    key_a, key_b = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    base = front_config(tiny_model_dir, vllm_servers[:1])  # one server: both tenants reach the same cache
    data = base.model_dump(mode="json")
    data["control_plane"]["api_keys"] = {key_a: "acme", key_b: "globex"}
    cfg = parse_config(data, "test")
    sent: list[dict[str, Any]] = []
    real = engine_requests.request_body

    def spy(*args: Any, **kw: Any) -> dict[str, Any]:
        body = real(*args, **kw)
        sent.append(body)
        return body

    monkeypatch.setattr(engine_requests, "request_body", spy)
    prompt = [random.Random(11).randrange(10, 500) for _ in range(12 * BLOCK_SIZE)]
    async with thunderagent(cfg, vllm_servers[:1]) as front, aiohttp.ClientSession() as s:

        async def cached(key: str) -> int:
            async with s.post(f"{front.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": front.model, "prompt": prompt, "max_tokens": 1}) as r:
                body = await r.json()
                assert r.status == 200, body
                return int(body["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)

        assert await cached(key_a) == 0
        assert await cached(key_a) >= 11 * BLOCK_SIZE  # vLLM's own count: a hit within the tenant
        assert await cached(key_b) == 0  # the same prompt, the same server, another tenant
        assert await cached(key_b) >= 11 * BLOCK_SIZE
    assert [b.get("cache_salt") for b in sent] == ["tenant:acme"] * 2 + ["tenant:globex"] * 2
