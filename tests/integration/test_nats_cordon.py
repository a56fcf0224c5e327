"""Cordon over NATS: the worker process keeps the mark, so a cordon asked of one frontend takes the worker out
of every frontend's routing, a frontend started later included, and an uncordon through another puts it back.
Adding or removing workers is refused there (worker processes join and leave by themselves). A prefix-cache
reset asked of one frontend is done by the worker processes, and every frontend's index follows."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

from nats_cluster import Cluster, cluster, wait_until  # noqa: E402, F401  (on sys.path; cluster: a fixture)

pytestmark = [pytest.mark.nats, pytest.mark.integration]

MODEL = "thunderagent-sim"


def admin(c: Cluster, frontend: str, path: str, body: object | None = None) -> tuple[int, dict]:
    return post(c, frontend, f"/v1/admin/workers{path}", body)


def post(c: Cluster, frontend: str, path: str, body: object | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{c.ports[frontend]}{path}",
                                 data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def cordoned(c: Cluster, frontend: str) -> set[str]:
    return {w["id"] for w in c.health(frontend)["workers"] if w["cordoned"]}


def routed_to(c: Cluster, frontend: str, n: int) -> set[str]:
    client = c.client(frontend)
    return {client.completions.with_raw_response.create(model=MODEL, prompt=f"request {i} of {frontend}",
                                                        max_tokens=2).headers["x-thunderagent-worker"]
            for i in range(n)}


def test_a_cordon_through_one_frontend_holds_on_every_frontend(cluster: Cluster) -> None:
    conf = cluster.config
    conf.write_text(conf.read_text().replace("control_plane: {", "control_plane: {admin_api: true, "))
    cluster.start_nats()
    for w in ("w0", "w1"):
        cluster.start_worker(w)
    for f in ("fa", "fb"):
        cluster.start_frontend(f)
    for f in ("fa", "fb"):
        wait_until(lambda f=f: cluster.workers(f) == {"w0", "w1"}, 30, f"{f} to discover 2 workers")

    assert admin(cluster, "fa", "/w0/cordon") == (200, {"id": "w0", "cordoned": True, "in_flight": 0})
    assert cordoned(cluster, "fa") == {"w0"}  # at once on the frontend asked
    wait_until(lambda: cordoned(cluster, "fb") == {"w0"}, 5, "fb to read the mark in w0's heartbeat")
    assert routed_to(cluster, "fa", 6) == {"w1"} and routed_to(cluster, "fb", 6) == {"w1"}

    cluster.start_frontend("fc")  # started after the cordon: learns it from the worker
    wait_until(lambda: cluster.workers("fc") == {"w0", "w1"} and cordoned(cluster, "fc") == {"w0"}, 30,
               "fc to discover both workers, w0 cordoned")
    assert routed_to(cluster, "fc", 6) == {"w1"}

    assert admin(cluster, "fb", "/w0/uncordon")[0] == 200
    for f in ("fa", "fb", "fc"):
        wait_until(lambda f=f: not cordoned(cluster, f), 5, f"{f} to take w0 back")
    assert routed_to(cluster, "fa", 12) == {"w0", "w1"}

    status, err = admin(cluster, "fa", "", {"url": "http://127.0.0.1:1"})
    assert status == 409 and err["error"]["code"] == "not_supported"
    status, err = admin(cluster, "fa", "/w1/remove")
    assert status == 409 and err["error"]["code"] == "not_supported" and not cordoned(cluster, "fa")

    # a prefix-cache reset through one frontend: each worker process empties its engine and answers; the frontend
    # asked drops its entries at once, the others follow the workers' AllBlocksCleared events
    cluster.client("fb").completions.create(model=MODEL, prompt="a shared prompt about tides. " * 40, max_tokens=2)
    for f in ("fa", "fb", "fc"):
        wait_until(lambda f=f: sum(cluster.indexed(f).values()) > 0, 5, f"{f} to index the prompt's blocks")
    status, body = post(cluster, "fc", "/v1/admin/reset_prefix_cache")
    assert (status, body) == (200, {"success": True, "workers": [{"id": "w0", "success": True},
                                                                  {"id": "w1", "success": True}]})
    assert sum(cluster.indexed("fc").values()) == 0
    for f in ("fa", "fb"):
        wait_until(lambda f=f: sum(cluster.indexed(f).values()) == 0, 5, f"{f} to follow the workers' events")
    # a LoRA adapter load is asked of each worker process too: these simulated ones refuse, saying why
    status, body = post(cluster, "fa", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/loras/sql"})
    assert status == 502 and body["error"]["code"] == "servers_refused"
    assert body["workers"] == [{"id": w, "success": False, "error": "a simulated worker serves no LoRA adapters"}
                               for w in ("w0", "w1")]
    status, body = post(cluster, "fb", "/pause?mode=wait")  # and a pause: no simulated worker has one
    assert status == 502 and all("has no pause" in w["error"] for w in body["workers"])
    status, body = post(cluster, "fa", "/stop_profile")  # and vLLM's parameterless calls
    assert status == 502 and all("has no server to call /stop_profile" in w["error"] for w in body["workers"])

    cluster.kill("w1")  # a worker that no longer answers: the frontend says so, nothing changes
    status, err = admin(cluster, "fa", "/w1/cordon")
    assert (status, err["error"]["code"]) in ((504, "worker_timeout"), (404, "worker_not_found"))
    assert "w1" not in cordoned(cluster, "fa")
