"""The scaling planner's Kubernetes action (``planner.kubernetes``): a step sets the replicas of the role's
Deployment one up or down through the API server's ``/scale`` subresource.

- In a pod the defaults need nothing: the API server from ``KUBERNETES_SERVICE_HOST`` / ``_PORT``, the
  namespace, token and CA from the pod's service account (``deploy/k8s``: a ServiceAccount with a Role
  allowing ``get`` and ``update`` on ``deployments/scale``, nothing else). The token is read at every
  action: projected service-account tokens rotate.
- Read, then write with the read's ``resourceVersion``: if anything else scaled the Deployment in between,
  the API server answers 409 and the step is given up (shown in ``actions``), never applied twice.
- The replicas stay within ``min_workers``..``max_workers``. A +1 is held while the Deployment already asks
  for more replicas than the role has workers: those pods are still starting (a vLLM pod loads its model
  for minutes), and another one would not help sooner. Which pod a -1 removes is the Deployment's choice;
  its worker sidecar gets SIGTERM and drains (README "Many processes over NATS").
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from thunderagent.config.planner import KubernetesScale

_NS_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True, slots=True)
class KubeTarget:
    api_url: str
    namespace: str
    token_file: str
    ca_file: str | None


def resolve(cfg: KubernetesScale, env: Mapping[str, str] = os.environ, ns_file: str = _NS_FILE) -> KubeTarget:
    """Fill in the in-cluster defaults. Raises ValueError naming the field when one cannot be found."""
    api = cfg.api_url
    if api is None:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("planner.kubernetes.api_url: not in a Kubernetes pod (KUBERNETES_SERVICE_HOST is "
                             "unset): set the API server's URL")
        api = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    namespace = cfg.namespace
    if namespace is None:
        try:
            namespace = Path(ns_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"planner.kubernetes.namespace: not set and this pod's ({ns_file}) cannot be read: "
                             f"{exc.strerror}") from exc
    return KubeTarget(api, namespace, cfg.token_file, cfg.ca_file)


async def scale_step(target: KubeTarget, deployment: str, delta: int, workers: int, lo: int, hi: int,
                     timeout: float) -> dict[str, Any]:
    """One planner step on ``deployment``; returns what happened (for ``GET /v1/planner``'s actions):
    ``replicas`` (from, to) when written, ``held`` when nothing needed writing, ``error`` on failure."""
    entry: dict[str, Any] = {"deployment": f"{target.namespace}/{deployment}"}
    try:
        token = Path(target.token_file).read_text().strip()
    except OSError as exc:
        entry["error"] = f"cannot read the token {target.token_file}: {exc.strerror}"
        return entry
    url = f"{target.api_url}/apis/apps/v1/namespaces/{target.namespace}/deployments/{deployment}/scale"
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    tls: ssl.SSLContext | bool = True
    if target.api_url.startswith("https://") and target.ca_file is not None:
        tls = ssl.create_default_context(cafile=target.ca_file)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), headers=headers) as http:
            async with http.get(url, ssl=tls) as resp:
                entry["status"] = resp.status
                if resp.status != 200:
                    entry["error"] = f"reading the scale: HTTP {resp.status}: {(await resp.text())[:300]}"
                    return entry
                current = await resp.json()
            have = int(current.get("spec", {}).get("replicas") or 0)
            want = min(hi, max(lo, have + delta))
            if delta > 0 and have > workers:
                entry["held"] = f"{have} replicas asked, {workers} workers joined: the others are still starting"
            elif want == have:
                entry["held"] = f"{have} replicas, at {'max_workers' if delta > 0 else 'min_workers'}"
            if "held" in entry:
                return entry
            body = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {"name": deployment, "namespace": target.namespace,
                                 "resourceVersion": current.get("metadata", {}).get("resourceVersion")},
                    "spec": {"replicas": want}}
            async with http.put(url, json=body, ssl=tls) as resp:
                entry["status"] = resp.status
                if resp.status == 409:
                    entry["error"] = "the Deployment was scaled by someone else meanwhile: step given up"
                elif resp.status != 200:
                    entry["error"] = f"writing the scale: HTTP {resp.status}: {(await resp.text())[:300]}"
                else:
                    entry["replicas"] = [have, want]
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
        entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry
