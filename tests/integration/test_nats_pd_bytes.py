"""Prefill/decode disaggregation in the NATS deployment with real KV bytes: nats-server, one prefill
and two decode ``thunderagent worker`` processes and a frontend, driven with the official OpenAI
client. The decode worker process pulls each block's payload from the prefill worker process over
TCP and verifies its checksum before its engine takes the request; a restarted prefill worker that
corrupts its bytes makes the next request fall back, counted by cause; ``thunderagent probe-links``
measures the links between the worker processes."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request

import pytest

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

from nats_cluster import Cluster, cluster, executable, free_port, wait_until  # noqa: E402, F401  (cluster: a fixture)

pytestmark = [pytest.mark.nats, pytest.mark.integration]

MODEL = "thunderagent-sim"
BLOCK_BYTES = 64 << 10
TEXT = "a prompt long enough to fill several blocks of sixty-four tokens each, " * 10  # 11 full blocks


def config(faults: str = "") -> str:
    return f"""\
control_plane: {{heartbeat_interval: 0.2, heartbeat_misses: 3}}
simulation: {{speedup: 10.0}}
routing: {{seed: 7, disaggregation: {{mode: always}}}}
scheduler: {{enabled: false}}
execution_group:
  nodes:
    - {{role: prefill, count: 1, kv_blocks: 4096, block_size: 64,
       kv_cache_transfer: {{enabled: true, sim_block_bytes: {BLOCK_BYTES}{faults}}}}}
    - {{role: decode, count: 2, kv_blocks: 4096, block_size: 64}}
"""


def metric(cluster: Cluster, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.ports['f']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def process_metrics(port: int) -> dict[str, float]:
    """A worker process's own ``/metrics`` (``--metrics-port``): ``thunderagent_worker_process_*`` series by name
    and labels, less the ``worker`` label (one process, one worker)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for name, labels, value in re.findall(r"^thunderagent_worker_process_(\w+)\{(.*)\} (\S+)$", text, re.MULTILINE):
        rest = ",".join(kv for kv in labels.split(",") if not kv.startswith("worker="))
        out[name + (f"{{{rest}}}" if rest else "")] = float(value)
    return out


def log(cluster: Cluster, name: str) -> str:
    return (cluster.tmp / f"{name}.log").read_text(errors="replace")


def test_checksummed_kv_bytes_cross_between_worker_processes(cluster: Cluster):
    good = cluster.write_config("pd.yaml", "")
    good.write_text(config())
    cluster.start_nats()
    mport = {w: free_port() for w in ("p0", "d1", "d2")}  # each worker process's own metrics endpoint
    cluster.start_worker("p0", "--node", "0", "--metrics-port", str(mport["p0"]), config=good)
    for d in ("d1", "d2"):
        cluster.start_worker(d, "--node", "1", "--metrics-port", str(mport[d]), config=good)
    cluster.start_frontend("f", config=good)
    wait_until(lambda: cluster.workers("f") == {"p0", "d1", "d2"}, 30, "the frontend to discover 3 workers")
    client = cluster.client("f")

    # 1. two streamed requests: prefilled on p0, their KV bytes pulled by a decode process
    for i in range(2):
        stream = client.completions.create(model=MODEL, prompt=f"request {i}: " + TEXT, max_tokens=8, stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) != ""
        assert chunks[-1].choices[0].finish_reason == "length"
    assert metric(cluster, "thunderagent_pd_transfers_ok_total") == 2
    pulled = metric(cluster, "thunderagent_pd_kv_pulled_bytes_total")
    verified = metric(cluster, "thunderagent_pd_kv_checksums_verified_total")
    assert verified >= 2 * 11 and pulled == verified * BLOCK_BYTES
    # both sides of the connection, in their own processes
    served = [(int(b), int(n)) for b, n in re.findall(r"served: (\d+) blocks, (\d+) bytes", log(cluster, "p0"))]
    assert len(served) == 2 and sum(n for _, n in served) == pulled
    got = [(int(n), int(b)) for n, b in re.findall(r"pulled (\d+) KV bytes from p0 in \S+, (\d+) checksums verified",
                                                   log(cluster, "d1") + log(cluster, "d2"))]
    assert len(got) == 2 and sum(n for n, _ in got) == pulled and sum(b for _, b in got) == verified
    # ... and on each worker process's own metrics endpoint (before: in its log only)
    mp, md = process_metrics(mport["p0"]), [process_metrics(mport[d]) for d in ("d1", "d2")]
    assert (mp["kv_pulls_served_total"], mp["kv_bytes_sent_total"]) == (2, pulled)
    assert sum(m["kv_pulls_ok_total"] for m in md) == 2 and sum(m["kv_bytes_received_total"] for m in md) == pulled
    assert sum(m["kv_checksums_verified_total"] for m in md) == verified
    assert mp["requests_accepted_total"] == 2  # the two prefill jobs
    assert sum(m.get('requests_finished_total{reason="length"}', 0) for m in md) == 2  # the clients' requests
    assert sum(m["requests_accepted_total"] for m in md) == 2 and all(m["requests_in_flight"] == 0 for m in md)
    for m in (mp, *md):
        assert m["frontends"] == 1 and m["heartbeats_total"] > 0 and m['mark{mark="cordoned"}'] == 0
        assert m["engine_kv_total_blocks"] == 4096
    assert mp["kv_blocks_stored_total"] == 2 * 11 and mp["kv_event_batches_total"] >= 1  # p0's prefilled blocks
    assert all(m["kv_blocks_stored_total"] >= 11 for m in md)  # what each decode worker pulled, then stored

    # 2. the operator measures the links between the worker processes' byte servers
    endpoints = [f"{w}={m}" for w in ("p0", "d1") for m in re.findall(r"KV bytes served on (\S+)", log(cluster, w))]
    out = subprocess.run([executable("thunderagent"), "probe-links", *(a for e in endpoints for a in ("--endpoint", e)),
                          "--block-bytes", str(1 << 20), "--rounds", "2", "--yaml", str(cluster.tmp / "links.yaml")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^p0\s+d1\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out.stdout, re.MULTILINE), out.stdout
    assert (cluster.tmp / "links.yaml").read_text().count("{src: ") == 2

    # 3. the prefill process comes back corrupting its bytes: the pull fails its checksum, the
    # request prefills on its decode worker, counted by cause
    bad = cluster.tmp / "bad.yaml"
    bad.write_text(config(", sim_faults: {corrupt_p: 1.0}"))
    cluster.kill("p0")
    cluster.start_worker("p0", "--node", "0", "--metrics-port", str(mport["p0"]), config=bad)

    def restarted() -> bool:
        parts = log(cluster, "p0").split("KV bytes served on")
        return len(parts) == 3 and "on the bus" in parts[2]

    wait_until(restarted, 30, "p0 to restart")
    time.sleep(0.5)  # its hello (sent with that log line) reaches the frontend: the new instance replaces the old
    wait_until(lambda: cluster.workers("f") == {"p0", "d1", "d2"}, 30, "the frontend to take p0 back")
    r = client.completions.create(model=MODEL, prompt="after the restart: " + TEXT, max_tokens=8)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert metric(cluster, "thunderagent_pd_fallbacks_total", '{cause="kv_checksum"}') == 1
    assert metric(cluster, "thunderagent_pd_kv_pulled_bytes_total") == pulled  # nothing more was taken
    assert process_metrics(mport["p0"])['kv_faults_injected_total{kind="corrupt"}'] == 1  # the restarted process's
    md = [process_metrics(mport[d]) for d in ("d1", "d2")]
    assert sum(m.get('kv_pull_failures_total{cause="kv_checksum"}', 0) for m in md) == 1
