"""Tenants and API keys over HTTP against the simulated fleet: 401 without a valid key, no cached
prefix shared across tenants (hits within one), admin endpoints behind admin keys, keys off as before.
Keys are generated per test run; none is stored in the repository."""

from __future__ import annotations

import secrets

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from support.server import Server

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
PROMPT = [{"role": "user", "content": "Shared system prompt of every tenant, long enough to fill blocks. " * 8}]
KEY_A, KEY_B, ADMIN = (secrets.token_urlsafe(24) for _ in range(3))


def _keys_on(**extra: object) -> dict[str, object]:
    return {"control_plane": {"api_keys": {KEY_A: "acme", KEY_B: "globex"}, "admin_keys": [ADMIN], **extra}}


def _client(srv: Server, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key=key, max_retries=0, timeout=30)


async def _cached(client: AsyncOpenAI, **extra: object) -> int:
    resp = await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, **extra)
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    return resp.usage.prompt_tokens_details.cached_tokens or 0


async def test_tenants_never_share_a_cached_prefix(server_factory):
    async with server_factory(**_keys_on()) as srv:
        a, b = _client(srv, KEY_A), _client(srv, KEY_B)
        assert await _cached(a) == 0
        assert await _cached(a) > 0  # a tenant hits its own prefix
        assert await _cached(b) == 0  # the same prompt from another tenant: no hit
        assert await _cached(b) > 0
        # a client salt subdivides its tenant, and cannot reach another tenant's (or the unsalted) cache
        assert await _cached(a, extra_body={"cache_salt": "team-1"}) == 0
        assert await _cached(b, extra_body={"cache_salt": "team-1"}) == 0
        assert await _cached(b, extra_body={"cache_salt": "team-1"}) > 0
        assert await _cached(a, extra_body={"cache_salt": "globex"}) == 0
        for c in (a, b):
            await c.close()


async def test_the_engine_runs_with_the_tenant_salt(server_factory, monkeypatch):
    async with server_factory(**_keys_on()) as srv:
        seen: list[tuple[str | None, str]] = []
        real = srv.fleet.start_generation

        async def spy(prompt_ids, max_tokens, **kw):
            seen.append((kw.get("cache_salt"), kw.get("route_key")))
            return await real(prompt_ids, max_tokens, **kw)

        monkeypatch.setattr(srv.fleet, "start_generation", spy)
        a = _client(srv, KEY_A)
        await _cached(a, extra_headers={"x-thunderagent-route-key": "not-acme"})
        await _cached(a, extra_body={"cache_salt": "s1"})
        await a.close()
        # the tenant is the salt (subdivided by the client's) and the route key (fair shares per tenant)
        assert seen == [("tenant:acme", "acme"), ("tenant:acme:s1", "acme")]


async def test_no_key_or_a_bad_key_is_401_in_openai_shape(server_factory):
    async with server_factory(**_keys_on()) as srv:
        for key in ("wrong-" + secrets.token_urlsafe(24), ADMIN):  # an admin key is not a tenant key
            bad = _client(srv, key)
            with pytest.raises(openai.AuthenticationError) as exc:
                await bad.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)
            await bad.close()
            err = exc.value.response.json()["error"]
            assert exc.value.status_code == 401 and err["type"] == "invalid_request_error"
            assert err["code"] == "invalid_api_key" and err["message"]
            assert exc.value.response.headers["WWW-Authenticate"].startswith("Bearer")
        async with aiohttp.ClientSession() as s:
            for path in ("/v1/models", "/v1/completions", "/no/such/path"):  # unknown paths are not open
                async with s.request("GET" if "models" in path else "POST", srv.base_url + path) as r:
                    assert r.status == 401, path
                    assert (await r.json())["error"]["code"] == "missing_api_key"
            async with s.get(srv.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}) as r:
                assert r.status == 200
        metrics = srv.fleet.metrics.render().decode()
        assert 'thunderagent_requests_total{endpoint="/v1/chat/completions",status="401"} 2.0' in metrics


async def test_admin_endpoints_need_an_admin_key(server_factory):
    async with server_factory(**_keys_on()) as srv, aiohttp.ClientSession() as s:
        for path in ("/metrics", "/v1/planner"):
            for headers, status in (({}, 401), ({"Authorization": "Bearer " + KEY_A}, 403)):
                async with s.get(srv.base_url + path, headers=headers) as r:
                    assert r.status == status, (path, headers)
                    err = (await r.json())["error"]
                    assert err["code"] == ("missing_api_key" if status == 401 else "admin_key_required")
        admin = {"Authorization": "Bearer " + ADMIN}
        async with s.get(srv.base_url + "/metrics", headers=admin) as r:
            assert r.status == 200
        # /health: public and minimal; the detail with an admin key
        for headers in ({}, {"Authorization": "Bearer " + KEY_A}):
            async with s.get(srv.base_url + "/health", headers=headers) as r:
                assert r.status == 200 and await r.json() == {"status": "ok", "healthy_workers": 4}
        async with s.get(srv.base_url + "/health", headers=admin) as r:
            assert r.status == 200 and len((await r.json())["workers"]) == 4
        async with s.get(srv.base_url + "/health", headers={"Authorization": "Bearer nope-nope-nope-nope"}) as r:
            assert r.status == 401
        async with s.get(srv.base_url + "/openapi.json") as r:
            assert r.status == 200


async def test_a_tenant_reaches_only_its_own_programs_and_an_admin_names_the_tenant(server_factory):
    """Program ids are namespaced by tenant: two tenants that pick the same id run two programs; a
    tenant key lists, reads and releases its own (by its own id), never another tenant's; an admin key
    sees all, with their tenant, and names one program's tenant with ``?tenant=``."""
    async with server_factory(**_keys_on()) as srv, aiohttp.ClientSession() as s:
        a, b = _client(srv, KEY_A), _client(srv, KEY_B)
        for client, steps in ((a, 2), (b, 1)):
            for _ in range(steps):
                await _cached(client, extra_body={"program_id": "agent-1"})
        await _cached(b, extra_headers={"x-thunderagent-program-id": "solo"})
        as_a, as_b, admin = ({"Authorization": "Bearer " + k} for k in (KEY_A, KEY_B, ADMIN))

        async def call(method: str, path: str, headers: dict[str, str], body: object = None) -> tuple[int, dict]:
            async with s.request(method, srv.base_url + path, json=body, headers=headers) as r:
                return r.status, await r.json()

        for path in ("/v1/programs", "/v1/programs/agent-1", "/v1/programs/agent-1/release", "/programs/release"):
            assert (await call("GET" if "release" not in path else "POST", path, {}))[0] == 401
        status, mine = await call("GET", "/v1/programs", as_a)
        assert status == 200 and [(p["tenant"], p["id"], p["steps"]) for p in mine["data"]] == [("acme", "agent-1", 2)]
        assert mine["total"] == 1 and mine["by_state"] == {"reasoning": 0, "acting": 1, "paused": 0}
        status, one = await call("GET", "/v1/programs/agent-1", as_b)
        assert status == 200 and (one["tenant"], one["id"], one["steps"]) == ("globex", "agent-1", 1)
        # worker ids are the fleet's detail: null for a tenant key, the worker for an admin key
        assert mine["data"][0]["worker"] is None and one["worker"] is None and one["pinned"] is None
        status, seen = await call("GET", "/v1/programs/agent-1?tenant=globex", admin)
        assert status == 200 and seen["worker"] in srv.fleet.workers
        assert (await call("GET", "/v1/programs/solo", as_a))[0] == 404  # globex's, not acme's
        status, err = await call("GET", "/v1/programs?tenant=globex", as_a)
        assert status == 403 and err["error"]["param"] == "tenant"
        status, every = await call("GET", "/v1/programs", admin)
        assert sorted((p["tenant"], p["id"]) for p in every["data"]) == [("acme", "agent-1"), ("globex", "agent-1"), ("globex", "solo")]
        status, theirs = await call("GET", "/v1/programs?tenant=globex&state=acting", admin)
        assert status == 200 and theirs["total"] == 2 and theirs["by_state"]["acting"] == 2
        status, err = await call("GET", "/v1/programs/agent-1", admin)  # which tenant's? say so
        assert status == 404 and "?tenant=" in err["error"]["message"]
        assert (await call("GET", "/v1/programs?tenant=no/such", admin))[0] == 400
        # release: a tenant its own (the paper proxy's form too), never another's; an admin by tenant
        status, done = await call("POST", "/programs/release", as_b, {"program_id": "agent-1"})
        assert status == 200 and done == {"id": "agent-1", "tenant": "globex", "released": True}
        assert (await call("POST", "/v1/programs/solo/release", as_a))[0] == 404
        assert (await call("POST", "/v1/programs/agent-1/release", as_b))[0] == 404  # gone already
        assert srv.fleet.programs.get("acme/agent-1") is not None  # acme's agent-1 untouched
        status, done = await call("POST", "/v1/programs/solo/release?tenant=globex", admin)
        assert status == 200 and done["tenant"] == "globex"
        assert (await call("POST", "/v1/programs/agent-1/release", as_a))[0] == 200
        assert len(srv.fleet.programs) == 0
        for c in (a, b):
            await c.close()


async def test_one_tenants_flood_of_program_ids_does_not_evict_anothers_programs(server_factory):
    """Past ``scheduler.max_programs`` a tenant sending new program ids evicts its own idle programs
    once it holds the most: the other tenant's programs live on (max-min fair share)."""
    async with server_factory(**_keys_on(), scheduler={"max_programs": 8}) as srv:
        a, b = _client(srv, KEY_A), _client(srv, KEY_B)
        for i in range(3):
            await _cached(a, extra_body={"program_id": f"keep-{i}"})
        for i in range(40):
            await _cached(b, extra_body={"program_id": f"flood-{i}"})
        progs = srv.fleet.programs
        assert sorted(p.program_id for p in progs if p.tenant == "acme") == ["acme/keep-0", "acme/keep-1", "acme/keep-2"]
        assert sorted(p.program_id for p in progs if p.tenant == "globex") == [f"globex/flood-{i}" for i in range(35, 40)]
        assert progs.evicted == 35
        metrics = srv.fleet.metrics.render().decode()  # whose programs went: the flooding tenant's
        assert 'thunderagent_programs_evicted_total{tenant="globex"} 35.0' in metrics
        assert 'thunderagent_programs_evicted_total{tenant="acme"}' not in metrics
        for c in (a, b):
            await c.close()


async def test_the_routing_explanation_needs_an_admin_key_too(server_factory):
    """``explain`` shows every worker's load (the /health detail admins alone see): a tenant key asking
    for it (body or header, plain or streamed) gets a 403 and nothing is routed; a key listed as both
    tenant and admin gets it."""
    dual = secrets.token_urlsafe(24)
    cfg = {"control_plane": {"api_keys": {KEY_A: "acme", dual: "ops"}, "admin_keys": [ADMIN, dual]}}
    async with server_factory(**cfg) as srv:
        a, ops = _client(srv, KEY_A), _client(srv, dual)
        for extra in ({"extra_body": {"explain": True}}, {"extra_headers": {"x-thunderagent-explain": "1"}},
                      {"extra_body": {"explain": True}, "stream": True}):
            with pytest.raises(openai.PermissionDeniedError) as exc:
                await a.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, **extra)
            err = exc.value.body
            assert err["code"] == "admin_key_required" and err["param"] == "explain", err
        assert srv.fleet.index.num_blocks() == 0  # nothing was routed (no prediction, no prefill)
        resp = await ops.chat.completions.with_raw_response.create(model=MODEL, messages=PROMPT, max_tokens=4,
                                                                    extra_body={"explain": True})
        body = resp.http_response.json()
        assert body["thunderagent"]["worker"] == resp.headers["x-thunderagent-worker"]
        assert len(body["thunderagent"]["candidates"]) >= 1
        # the tenant key serves without it; the refused requests prefilled nothing of acme's prompt
        assert await _cached(a) == 0 and await _cached(a) > 0
        for c in (a, ops):
            await c.close()


async def test_tenants_see_no_worker_ids(server_factory):
    """Worker ids are the fleet's detail (what /health shows admins): with keys on, a tenant key's
    answers, plain and streamed, carry no ``x-thunderagent-worker``; a key that is also an admin key's
    do, naming a worker of the fleet."""
    dual = secrets.token_urlsafe(24)
    cfg = {"control_plane": {"api_keys": {KEY_A: "acme", dual: "ops"}, "admin_keys": [ADMIN, dual]}}
    async with server_factory(**cfg) as srv:
        a, ops = _client(srv, KEY_A), _client(srv, dual)
        for stream in (False, True):
            for client, shown in ((a, False), (ops, True)):
                async with client.chat.completions.with_streaming_response.create(
                        model=MODEL, messages=PROMPT, max_tokens=4, stream=stream) as resp:
                    assert resp.status_code == 200
                    await resp.read()
                    worker = resp.headers.get("x-thunderagent-worker")
                assert (worker in srv.fleet.workers) if shown else worker is None, (stream, shown, worker)
        for c in (a, ops):
            await c.close()


async def test_keys_from_a_file_and_an_environment_variable(server_factory, tmp_path, monkeypatch):
    key_c, key_d, admin = (secrets.token_urlsafe(24) for _ in range(3))
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# key tenant\n{key_c} initech\n")
    monkeypatch.setenv("TA_TEST_API_KEYS", f"{key_d}: hooli\n")
    monkeypatch.setenv("TA_TEST_ADMIN_KEYS", admin)
    cp = {"api_keys_file": str(keys), "api_keys_env": "TA_TEST_API_KEYS", "admin_keys_env": "TA_TEST_ADMIN_KEYS"}
    async with server_factory(control_plane=cp) as srv:
        c, d = _client(srv, key_c), _client(srv, key_d)
        assert await _cached(c) == 0 and await _cached(c) > 0
        assert await _cached(d) == 0
        await c.close()
        await d.close()
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.base_url + "/v1/programs", headers={"Authorization": "Bearer " + admin}) as r:
                assert r.status == 200


async def test_keys_off_everything_as_before(server_factory):
    async with server_factory() as srv, aiohttp.ClientSession() as s:
        assert await _cached(srv.client) == 0 and await _cached(srv.client) > 0  # api_key="unused" is ignored
        async with s.get(srv.base_url + "/health") as r:
            assert "workers" in await r.json()
        async with s.get(srv.base_url + "/v1/programs") as r:
            assert r.status == 200
        async with s.get(srv.base_url + "/metrics") as r:
            assert r.status == 200
