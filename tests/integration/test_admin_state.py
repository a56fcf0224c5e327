"""The operator's changes kept across a restart of ``serve`` (``control_plane.admin_state_file``): workers added and
removed, cordons; the file always the fleet's state, a configured worker named by id and server url (a config that
moved its servers does not get the wrong one removed or cordoned), a bad file or setting refused before serving."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from integration.conftest import test_config as make_config
from support.openai_backend import MODEL as OPENAI_MODEL
from support.openai_backend import OpenAIBackend
from support.server import running_server
from support.waiting import wait_until
from thunderagent.assemble import build_nats_fleet
from thunderagent.config import ConfigError, parse_config
from thunderagent.frontend.app import create_app

pytestmark = pytest.mark.integration

ADMIN = "/v1/admin/workers"


async def _call(s: aiohttp.ClientSession, path: str, body: object = None) -> tuple[int, dict]:
    async with s.post(path, json=body) as r:
        return r.status, await r.json()


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


async def test_added_removed_and_cordoned_workers_survive_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "admin.json"
    cfg = make_config(control_plane={"admin_api": True, "admin_state_file": str(state)},
                      execution_group={"nodes": [{"count": 2}]}, scheduler={"enabled": False})
    async with running_server(cfg) as srv, aiohttp.ClientSession() as s:
        base = srv.base_url
        assert _read(state) == {"version": 1, "added": [], "removed": [], "cordoned": []}  # written at start
        assert (await _call(s, base + ADMIN, {"id": "spare"}))[0] == 201
        assert (await _call(s, f"{base}{ADMIN}/worker-0/cordon"))[0] == 200
        assert (await _call(s, f"{base}{ADMIN}/worker-1/remove", {"timeout_s": 5}))[0] == 200
        assert _read(state) == {"version": 1, "added": [{"id": "spare", "group": 0}],
                                "removed": [{"id": "worker-1"}], "cordoned": [{"id": "worker-0"}]}
        assert not list(tmp_path.glob(".admin.json.*"))  # (no temporary file left behind)
    async with running_server(cfg) as srv, aiohttp.ClientSession() as s:  # the restart
        base = srv.base_url
        assert sorted(srv.fleet.workers) == ["spare", "worker-0"] and srv.fleet.cordoned == {"worker-0"}
        await wait_until(lambda: len(srv.fleet.registry.routable()) == 2, 10, "both workers heartbeat")
        for k in range(4):  # worker-0 still cordoned: everything to the added one
            async with s.post(base + "/v1/completions", json={"model": srv.fleet.model_name, "prompt": f"r{k}",
                                                               "max_tokens": 2}) as r:
                assert r.status == 200 and r.headers["x-thunderagent-worker"] == "spare"
        assert (await _call(s, f"{base}{ADMIN}/worker-0/uncordon"))[0] == 200
        assert (await _call(s, f"{base}{ADMIN}/spare/remove", {"timeout_s": 5}))[0] == 200
        assert _read(state) == {"version": 1, "added": [], "removed": [{"id": "worker-1"}], "cordoned": []}
        status, body = await _call(s, base + ADMIN, {})  # a new id: not the removed worker-1's
        assert (status, body["id"]) == (201, "worker-2")
        state.unlink()
        state.mkdir()  # (the file cannot be replaced now): the change stands, the answer says it is not kept
        status, body = await _call(s, f"{base}{ADMIN}/worker-2/cordon")
        assert status == 500 and body["error"]["code"] == "state_not_saved" and srv.fleet.cordoned == {"worker-2"}
        assert "a restart would not keep it" in body["error"]["message"]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".admin.json.")]


async def test_a_configured_server_is_named_by_its_url(tmp_path: Path) -> None:
    """worker-1 removed while it was server B; the config then lists B first: worker-1 is now server A, so the entry
    is not applied (both servers serve), while an added server comes back with its url."""
    a, b, c = OpenAIBackend("a"), OpenAIBackend("b"), OpenAIBackend("c")
    for x in (a, b, c):
        await x.start()
    state = tmp_path / "admin.json"

    def cfg(*urls: str):  # type: ignore[no-untyped-def]
        return parse_config({"model_name": OPENAI_MODEL, "control_plane": {
            "heartbeat_interval": 0.1, "heartbeat_misses": 5, "admin_api": True, "admin_state_file": str(state)},
            "execution_group": {"nodes": [{"engine": "openai", "block_size": 16,
                                           "endpoints": [{"url": u} for u in urls]}]}}, "test")
    try:
        async with running_server(cfg(a.url, b.url)) as srv, aiohttp.ClientSession() as s:
            assert (await _call(s, f"{srv.base_url}{ADMIN}/worker-1/remove"))[0] == 200
            assert (await _call(s, srv.base_url + ADMIN, {"url": c.url, "id": "gpu-c"}))[0] == 201
        assert _read(state) == {"version": 1, "added": [{"id": "gpu-c", "group": 0, "url": c.url}],
                                "removed": [{"id": "worker-1", "url": b.url}], "cordoned": []}
        async with running_server(cfg(a.url, b.url)) as srv:  # the same config: worker-1 (B) stays removed
            assert {w: getattr(h, "url", None) for w, h in srv.fleet.workers.items()} == {
                "worker-0": a.url, "gpu-c": c.url}
        async with running_server(cfg(b.url, a.url)) as srv:  # B moved first: worker-1 is A now, kept
            assert {w: getattr(h, "url", None) for w, h in srv.fleet.workers.items()} == {
                "worker-0": b.url, "worker-1": a.url, "gpu-c": c.url}
        assert _read(state)["removed"] == []  # (the file is the fleet as it now is)
    finally:
        for x in (a, b, c):
            await x.stop()


def test_bad_files_and_settings_are_refused_before_serving(tmp_path: Path) -> None:
    state = tmp_path / "admin.json"
    cfg = make_config(control_plane={"admin_api": True, "admin_state_file": str(state)})
    for text, says in (("not json", "is not a state this version wrote"),
                       ('{"version": 2}', "has version 2"),
                       ('{"added": [{"id": "x", "group": 3}]}', "added worker 'x': group: the fleet has node groups"),
                       ('{"added": [{"id": "x", "group": 0, "url": "http://h:1"}]}', "a simulated engine has no "
                                                                                      "server to name"),
                       ('{"added": [{"id": "worker-1", "group": 0}]}', "names another worker too"),
                       ('{"added": [], "extra": 1}', "is not a state this version wrote")):
        state.write_text(text)
        with pytest.raises(ValueError, match="control_plane.admin_state_file") as err:
            create_app(cfg)
        assert says in str(err.value), (text, err.value)
    state.write_text('{"added": [{"id": "worker-1", "group": 0}], "removed": [{"id": "worker-1"}]}')
    create_app(cfg)  # (worker-1 removed: its id may name an added worker)
    missing = make_config(control_plane={"admin_api": True, "admin_state_file": str(tmp_path / "no" / "s.json")})
    with pytest.raises(ValueError, match="does not exist or cannot be written"):
        create_app(missing)
    with pytest.raises(ConfigError, match="admin_state_file keeps what the admin API changed: it needs admin_api"):
        make_config(control_plane={"admin_state_file": str(state)})
    with pytest.raises(ValueError, match="is for `thunderagent serve`: over NATS each worker process keeps its cordon"):
        build_nats_fleet(cfg, None)  # type: ignore[arg-type]  (refused before the bus is used)
