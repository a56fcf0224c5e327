"""Property-based fuzzing of the HTTP API from its own OpenAPI document (schemathesis + hypothesis).

Every operation of ``/openapi.json`` gets schema-valid cases (checked against the document's status
codes, content types and response schemas) and schema-violating ones (must be rejected with a 4xx).
Whatever the case: no response >= 500, every error in OpenAI's shape, and the server stays up.
Deterministic (``derandomize``) and bounded: a fixed number of cases per operation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from integration.conftest import test_config as make_config
from support.server import running_server
from thunderagent.frontend.anthropic import ANTHROPIC_PATHS
from thunderagent.execution.server_admin import SERVER_CALLS

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

#: generated cases per operation (positive, negative): 2,000 in all, plus one per parameterless GET.
#: Generation is the cost (~20 ms a case on a shared 2-core machine, most of it in hypothesis), so the
#: cheap operations get more cases than the chat endpoint.
CASES = {
    "POST /v1/chat/completions": (300, 200),
    "POST /v1/completions": (350, 250),
    "POST /v1/programs/{program_id}/release": (250, 200),
    "POST /programs/release": (250, 200),
    "GET /v1/programs": (60, 60),
    "GET /v1/programs/{program_id}": (60, 60),
}
MIN_TOTAL = 2000
# Small KV pools (1,024 tokens per worker) and a fast simulated engine: a schema-valid request may
# ask for up to the whole context, and must still finish in milliseconds.
FUZZ_CONFIG = {
    "execution_group": {"nodes": [{"count": 2, "kv_blocks": 64, "block_size": 16}]},
    "simulation": {"speedup": 2000.0},
    "control_plane": {"body_timeout_s": 2.0, "idle_timeout_s": 5.0},
}


class ServerThread:
    """The real server on 127.0.0.1 in its own event loop thread (schemathesis calls are blocking)."""

    def __init__(self, config: dict | None = None) -> None:
        self.config = FUZZ_CONFIG if config is None else config
        self.base_url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with running_server(make_config(**self.config)) as srv:
            self.base_url = srv.base_url
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(30), "server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def assert_sane(response: requests.Response, case: schemathesis.Case) -> None:
    if response.status_code == 502 and response.request.path_url.split("?")[0] in SERVER_CALL_PATHS:
        # the one 5xx by design: the servers refused an operator's call (here: simulated workers have no server)
        doc = response.json()
        assert doc["error"]["code"] == "servers_refused" and doc["workers"], response.text[:500]
        assert all(not w["success"] and w["error"] for w in doc["workers"]), response.text[:500]
        return
    if response.status_code == 503 and response.request.path_url.split("?")[0] in SERVER_CALL_PATHS | RESET_PATHS:
        assert response.json()["error"]["code"] == "no_healthy_worker", response.text[:500]  # (no worker left)
        return
    assert response.status_code < 500, f"{response.status_code} for {case.as_curl_command()}: {response.text[:500]}"
    if response.status_code >= 400:
        doc = response.json()
        err = doc["error"]
        if response.request.path_url.split("?")[0] in ANTHROPIC_PATHS:  # Anthropic's shape there
            assert doc["type"] == "error" and set(err) == {"type", "message"} and err["message"], response.text[:500]
            return
        assert set(err) == {"message", "type", "param", "code"} and err["message"], response.text[:500]


def fuzz(op, mode: GenerationMode, n: int, base_url: str, session: requests.Session,
         statuses: Counter[int]) -> None:
    @settings(max_examples=n, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, session=session, timeout=10)
        statuses[response.status_code] += 1
        assert_sane(response, case)
        if mode is GenerationMode.POSITIVE:
            case.validate_response(response, checks=[
                status_code_conformance, content_type_conformance, response_schema_conformance])

    run()


def test_fuzz_every_operation_of_the_openapi_document():
    statuses: Counter[int] = Counter()
    t0 = time.monotonic()
    with ServerThread() as server, requests.Session() as session:
        doc = session.get(server.base_url + "/openapi.json", timeout=10).json()
        schema = schemathesis.openapi.from_dict(doc)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 9 and set(CASES) <= {op.label for op in operations}
        for op in operations:
            positive, negative = CASES.get(op.label, (1, 0))  # a GET without parameters has one case
            for mode, n in ((GenerationMode.POSITIVE, positive), (GenerationMode.NEGATIVE, negative)):
                if n:
                    t = time.monotonic()
                    fuzz(op, mode, n, server.base_url, session, statuses)
                    print(f"{op.label} {mode}: {n} cases, {time.monotonic() - t:.1f}s")
        assert session.get(server.base_url + "/health", timeout=10).status_code == 200  # still up
    total = sum(statuses.values())
    print(f"fuzz: {total} cases in {time.monotonic() - t0:.1f}s, statuses {dict(sorted(statuses.items()))}")
    assert total >= MIN_TOTAL, statuses
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses[200] >= 10  # schema-valid cases reach the handlers and generate


#: the operator's endpoints, on (``control_plane.admin_api``): cases per operation (positive, negative)
#: an operator's calls on the servers: 502 ``servers_refused`` when they refused (the answer names each worker's reason)
SERVER_CALL_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pause", "/resume",
                               *SERVER_CALLS})
RESET_PATHS = frozenset({"/v1/admin/reset_prefix_cache", "/reset_prefix_cache"})
ADMIN_CASES = {
    "POST /v1/admin/workers": (120, 80),
    "POST /v1/admin/workers/{worker_id}/cordon": (40, 0),  # (a free-form path id has no invalid form)
    "POST /v1/admin/workers/{worker_id}/uncordon": (40, 0),
    "POST /v1/admin/workers/{worker_id}/remove": (60, 60),
    "GET /v1/admin/workers": (1, 0),
    # the calls on the servers (the simulated workers have none: a refusal each, a 502 servers_refused)
    "POST /v1/admin/reset_prefix_cache": (40, 40),
    "POST /v1/admin/workers/{worker_id}/reset_prefix_cache": (20, 0),
    "POST /reset_prefix_cache": (20, 20),
    "POST /v1/load_lora_adapter": (40, 40),
    "POST /v1/unload_lora_adapter": (20, 20),
    "POST /pause": (20, 20),
    "POST /resume": (5, 0),
    "GET /is_paused": (2, 0),
    "POST /stop_profile": (2, 0),
    "POST /sleep": (20, 20),
    "POST /wake_up": (10, 10),
    "GET /get_world_size": (5, 5),
    "GET /server_info": (5, 5),
    "POST /collective_rpc": (20, 20),
    "POST /init_weight_transfer_engine": (10, 10),
}


def test_fuzz_the_admin_api():
    """Workers added (simulated), cordoned, removed by generated calls: never a 5xx, errors in OpenAI's shape, and
    the fleet the calls left behind still serves (a worker is put back if none is left)."""
    statuses: Counter[int] = Counter()
    config = {**FUZZ_CONFIG, "control_plane": {**FUZZ_CONFIG["control_plane"], "admin_api": True}}
    with ServerThread(config) as server, requests.Session() as session:
        schema = schemathesis.openapi.from_dict(session.get(server.base_url + "/openapi.json", timeout=10).json())
        operations = {op.label: op for op in (r.ok() for r in schema.get_all_operations())}
        for label, (positive, negative) in ADMIN_CASES.items():
            for mode, n in ((GenerationMode.POSITIVE, positive), (GenerationMode.NEGATIVE, negative)):
                if n:
                    fuzz(operations[label], mode, n, server.base_url, session, statuses)
        workers = session.get(server.base_url + "/v1/admin/workers", timeout=10).json()["data"]
        for w in workers:
            session.post(f"{server.base_url}/v1/admin/workers/{w['id']}/uncordon", timeout=10)
        if not workers:
            assert session.post(server.base_url + "/v1/admin/workers", json={}, timeout=10).status_code == 201
        r = session.post(server.base_url + "/v1/completions", timeout=10,
                         json={"model": "thunderagent-sim", "prompt": "still serving", "max_tokens": 2})
        assert r.status_code == 200, r.text
    print(f"admin fuzz: statuses {dict(sorted(statuses.items()))}")
    assert not [s for s in statuses if s >= 500 and s not in (502, 503)], statuses  # (checked per answer above)
    assert statuses[502] >= 10  # the calls reached the workers
    assert statuses[201] >= 5 and statuses[200] >= 1 and statuses[404] >= 5  # the handlers were reached
