"""A fake Kubernetes API server for the planner's scale action: the ``/scale`` subresource of Deployments,
bearer-token checked, with ``resourceVersion`` optimistic concurrency as the real one (409 on a stale write)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeKube:
    token: str
    replicas: dict[tuple[str, str], int]  # (namespace, deployment) -> spec.replicas
    version: int = 1
    bump_after_get: bool = False  # someone else scales between our read and our write
    fail_get: int | None = None  # answer GETs with this status
    writes: list[dict[str, Any]] = field(default_factory=list)
    auth_seen: list[str] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    def _scale(self, ns: str, name: str) -> dict[str, Any]:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": ns, "resourceVersion": str(self.version)},
                "spec": {"replicas": self.replicas[(ns, name)]}, "status": {"replicas": self.replicas[(ns, name)]}}

    async def _handle(self, request: web.Request) -> web.Response:
        self.auth_seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.replicas:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        if request.method == "GET":
            if self.fail_get is not None:
                return web.json_response({"kind": "Status", "code": self.fail_get}, status=self.fail_get)
            body = self._scale(*key)
            if self.bump_after_get:
                self.version += 1
            return web.json_response(body)
        body = await request.json()
        self.writes.append(body)
        if body["metadata"].get("resourceVersion") != str(self.version):
            return web.json_response({"kind": "Status", "code": 409, "reason": "Conflict"}, status=409)
        self.replicas[key] = body["spec"]["replicas"]
        self.version += 1
        return web.json_response(self._scale(*key))

    async def start(self) -> FakeKube:
        app = web.Application()
        path = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        app.router.add_get(path, self._handle)
        app.router.add_put(path, self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
