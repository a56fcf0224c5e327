"""The planner's Kubernetes action (control/planner_k8s.py) against a fake API server on 127.0.0.1: a step
reads the Deployment's scale and writes it one up or down with the read's resourceVersion, within the
planner's bounds, holds a +1 while pods are still starting, and gives a step up on a conflict."""

from __future__ import annotations

import pytest

from support.fake_k8s import FakeKube
from thunderagent.config.planner import KubernetesScale
from thunderagent.control.planner_k8s import KubeTarget, resolve, scale_step

pytestmark = pytest.mark.integration

NS, DEP = "thunderagent", "vllm"


@pytest.fixture
async def kube(tmp_path):
    fake = await FakeKube(token="s3cret", replicas={(NS, DEP): 2}).start()
    (tmp_path / "token").write_text("s3cret\n")
    try:
        yield fake, KubeTarget(fake.url, NS, str(tmp_path / "token"), None)
    finally:
        await fake.stop()


async def step(target: KubeTarget, delta: int, workers: int, lo: int = 1, hi: int = 4) -> dict:
    return await scale_step(target, DEP, delta, workers, lo, hi, timeout=5.0)


async def test_a_step_reads_then_writes_one_replica_up_and_down_with_the_read_version(kube):
    fake, target = kube
    assert await step(target, +1, workers=2) == {"deployment": f"{NS}/{DEP}", "status": 200, "replicas": [2, 3]}
    assert fake.replicas[(NS, DEP)] == 3
    assert fake.writes[-1]["metadata"]["resourceVersion"] == "1" and fake.writes[-1]["spec"] == {"replicas": 3}
    assert set(fake.auth_seen) == {"Bearer s3cret"}  # the token file's content, stripped
    assert (await step(target, -1, workers=3))["replicas"] == [3, 2]
    assert fake.replicas[(NS, DEP)] == 2


async def test_bounds_and_starting_pods_hold_a_step_without_writing(kube):
    fake, target = kube
    held = await step(target, +1, workers=1)  # 2 asked, 1 joined: one is still starting
    assert held["held"] == "2 replicas asked, 1 workers joined: the others are still starting"
    assert (await step(target, +1, workers=2, hi=2))["held"] == "2 replicas, at max_workers"
    assert (await step(target, -1, workers=2, lo=2))["held"] == "2 replicas, at min_workers"
    assert fake.writes == [] and fake.replicas[(NS, DEP)] == 2


async def test_a_conflict_gives_the_step_up_and_errors_are_reported(kube, tmp_path):
    fake, target = kube
    fake.bump_after_get = True  # another writer between our read and our write
    out = await step(target, +1, workers=2)
    assert out["status"] == 409 and "scaled by someone else" in out["error"]
    assert fake.replicas[(NS, DEP)] == 2  # nothing applied twice
    fake.bump_after_get, fake.fail_get = False, 403
    out = await step(target, +1, workers=2)
    assert out["status"] == 403 and out["error"].startswith("reading the scale: HTTP 403")
    missing = KubeTarget(fake.url, NS, str(tmp_path / "nope"), None)
    assert "cannot read the token" in (await step(missing, +1, workers=2))["error"]
    gone = KubeTarget(fake.url, NS, target.token_file, None)
    assert (await scale_step(gone, "other", +1, 2, 1, 4, 5.0))["status"] == 404


def test_in_cluster_defaults_and_clear_errors_when_not_in_a_pod(tmp_path):
    cfg = KubernetesScale(deployments={"both": "vllm"})
    ns = tmp_path / "namespace"
    ns.write_text("fleet-a\n")
    t = resolve(cfg, env={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}, ns_file=str(ns))
    assert (t.api_url, t.namespace) == ("https://10.0.0.1:6443", "fleet-a")
    assert resolve(cfg, env={"KUBERNETES_SERVICE_HOST": "fd00::1"}, ns_file=str(ns)).api_url == "https://[fd00::1]:443"
    with pytest.raises(ValueError, match=r"planner.kubernetes.api_url: not in a Kubernetes pod"):
        resolve(cfg, env={}, ns_file=str(ns))
    with pytest.raises(ValueError, match=r"planner.kubernetes.namespace: not set"):
        resolve(cfg, env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, ns_file=str(tmp_path / "absent"))
    explicit = KubernetesScale(deployments={"both": "vllm"}, namespace="x", api_url="http://127.0.0.1:1/")
    assert resolve(explicit, env={}).api_url == "http://127.0.0.1:1"
