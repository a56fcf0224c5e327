"""``thunderagent workers`` against a live server: list, cordon, uncordon, add, remove, reset-cache, and the
server's refusals printed with exit status 1 (the CLI's blocking calls run in a thread: the server shares the
test's event loop)."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from thunderagent.cli import app

pytestmark = pytest.mark.integration

ADMIN_KEY, TENANT_KEY = "admin-key-0123456789abcdef", "tenant-key-0123456789abcdef"


async def _run(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return await asyncio.to_thread(CliRunner().invoke, app, ["workers", *args], env=env)


async def test_the_workers_command_drives_the_admin_api(server_factory) -> None:
    async with server_factory(control_plane={"admin_api": True}, execution_group={"nodes": [{"count": 2}]},
                              scheduler={"enabled": False}) as srv:
        url = ["--url", srv.base_url]
        listed = await _run("list", *url)
        assert listed.exit_code == 0, listed.output
        assert "worker-0" in listed.output and "worker-1" in listed.output and "simulated" in listed.output
        r = await _run("cordon", "worker-0", *url)
        assert r.exit_code == 0 and "worker-0 cordoned" in r.output and srv.fleet.cordoned == {"worker-0"}
        rows = json.loads((await _run("list", "--json", *url)).output)
        assert {w["id"]: w["cordoned"] for w in rows} == {"worker-0": True, "worker-1": False}
        assert "cordoned" in (await _run("list", *url)).output
        r = await _run("uncordon", "worker-0", *url)
        assert r.exit_code == 0 and not srv.fleet.cordoned
        r = await _run("add", "--id", "spare", *url)
        assert r.exit_code == 0 and "spare added" in r.output and "spare" in srv.fleet.workers
        r = await _run("remove", "spare", "--timeout", "5", *url)
        assert r.exit_code == 0 and "spare removed" in r.output and "spare" not in srv.fleet.workers
        # prefix caches: every worker's, or one's; a worker that refuses (a simulated one does not preempt running
        # requests): its reason printed, status 1
        await srv.client.completions.create(model=srv.fleet.model_name, prompt="cached words " * 60, max_tokens=2)
        assert sum(srv.fleet.index.num_blocks(w) for w in srv.fleet.workers) > 0
        r = await _run("reset-cache", *url)
        assert r.exit_code == 0 and r.output.splitlines() == ["worker-0: reset", "worker-1: reset"], r.output
        assert sum(srv.fleet.index.num_blocks(w) for w in srv.fleet.workers) == 0
        r = await _run("reset-cache", "worker-1", "--running", *url)
        assert r.exit_code == 1 and r.output.startswith("worker-1: not reset: a simulated worker does not preempt")
        r = await _run("reset-cache", "nope", *url)
        assert r.exit_code == 1 and "HTTP 404" in r.output
        # LoRA adapters: asked of each worker (simulated ones refuse, each line says why), status 1
        r = await _run("load-adapter", "sql", "/loras/sql", "--worker", "worker-1", *url)
        assert r.exit_code == 1 and r.output.splitlines() == [
            "worker-1: not loaded: a simulated worker serves no LoRA adapters"], r.output
        r = await _run("unload-adapter", "sql", *url)
        assert r.exit_code == 1 and len(r.output.splitlines()) == 2 and "not unloaded" in r.output
        r = await _run("pause", "--mode", "wait", *url)
        assert r.exit_code == 1 and r.output.count("not paused: a simulated worker has no pause") == 2
        r = await _run("pause", "--mode", "later", *url)
        assert r.exit_code == 2
        r = await _run("sleep", "--level", "1", "--worker", "worker-0", *url)
        assert r.exit_code == 1 and r.output.splitlines() == [
            "worker-0: not asleep: a simulated worker has no server to call /sleep on"], r.output
        assert (await _run("sleep", "--level", "3", *url)).exit_code == 2
        assert (await _run("wake-up", "--tag", "gpu", *url)).exit_code == 2
        r = await _run("unload-adapter", "", *url)  # ours: the field named
        assert r.exit_code == 1 and "HTTP 400" in r.output and "lora_name" in r.output
        # the server's refusals: printed, status 1
        r = await _run("cordon", "nope", *url)
        assert r.exit_code == 1 and "HTTP 404" in r.output and "worker_not_found" in r.output
        r = await _run("add", "--server", "http://127.0.0.1:1", *url)  # a simulated group has no server to name
        assert r.exit_code == 1 and "HTTP 400" in r.output
        r = await _run("list", "--url", "127.0.0.1:1")  # not a URL: a usage error
        assert r.exit_code == 2


async def test_keys_and_the_switch(server_factory) -> None:
    keys = {"api_keys": {TENANT_KEY: "acme"}, "admin_keys": [ADMIN_KEY], "admin_api": True}
    async with server_factory(control_plane=keys) as srv:
        url = ["--url", srv.base_url]
        assert (await _run("list", *url)).exit_code == 1  # no key: 401
        r = await _run("list", *url, env={"THUNDERAGENT_API_KEY": TENANT_KEY})
        assert r.exit_code == 1 and "admin_key_required" in r.output
        assert (await _run("list", *url, env={"THUNDERAGENT_API_KEY": ADMIN_KEY})).exit_code == 0
        assert (await _run("cordon", "worker-0", "--api-key", ADMIN_KEY, *url)).exit_code == 0
    async with server_factory() as srv:  # the switch off
        r = await _run("list", "--url", srv.base_url)
        assert r.exit_code == 1 and "admin_api_disabled" in r.output
