"""``planner``: the step-wise scaling planner (``control/planner.py``; seed 004 §3.2).

Off by default. Every knob below acts only with ``enabled: true`` (refused otherwise, naming the field)."""

from __future__ import annotations

import re

from pydantic import Field, ValidationInfo, field_validator, model_validator

from thunderagent.config._base import _Strict, knob_needs_switch

_KNOBS = ("interval_s", "window_s", "cooldown_s", "min_workers", "max_workers", "warm_requests", "max_cold_s",
          "up_queue_per_worker", "up_ttft_s", "up_kv_usage", "down_queue_per_worker", "down_ttft_s",
          "down_kv_usage", "target_utilization", "forecast_lead_s", "trend_window_s", "service_rate_per_worker",
          "ttft_quantile", "command", "webhook_url", "kubernetes", "action_timeout_s")

_SA = "/var/run/secrets/kubernetes.io/serviceaccount"
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,251}[a-z0-9])?$")


class KubernetesScale(_Strict):
    """Scale a Deployment per worker role through the Kubernetes API (its ``/scale`` subresource): a +1 / -1
    sets its replicas one up / down, within min_workers..max_workers (``control/planner_k8s.py``)."""

    deployments: dict[str, str] = Field(description="worker role (prefill, decode, both) -> the Deployment that "
                                        "runs its workers (in deploy/k8s: both: vllm)")
    namespace: str | None = Field(None, description="the Deployments' namespace (default: this pod's, from its "
                                  "service account)")
    api_url: str | None = Field(None, description="the API server (default in a pod: https://$KUBERNETES_SERVICE_"
                                "HOST:$KUBERNETES_SERVICE_PORT)")
    token_file: str = Field(f"{_SA}/token", description="bearer token, read at every action (tokens rotate)")
    ca_file: str | None = Field(f"{_SA}/ca.crt", description="CA bundle the API server's certificate is checked "
                                "against (null: the system's)")

    @field_validator("deployments")
    @classmethod
    def _roles(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("name at least one role's Deployment, e.g. {both: vllm}")
        for role, name in v.items():
            if role not in ("prefill", "decode", "both"):
                raise ValueError(f"unknown worker role {role!r} (prefill, decode or both)")
            if not _DNS1123.match(name):
                raise ValueError(f"{name!r} is not a Deployment name (lowercase letters, digits and '-')")
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not _DNS1123.match(v)):
            raise ValueError(f"{v!r} is not a namespace name")
        return v

    @field_validator("api_url")
    @classmethod
    def _api(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("an http:// or https:// URL is needed")
        return v.rstrip("/") if v is not None else v


class PlannerConfig(_Strict):
    """Recommends +1 / -1 / hold per worker role from queue depth, TTFT (queue waits included), hit
    rate and KV water level averaged over ``window_s``; one step at a time, then ``cooldown_s`` of
    watching, and no step while a freshly added worker is still cold. With ``target_utilization``, also
    from the arrival trend and a worker's measured service rate (forecast sizing)."""

    enabled: bool = False
    interval_s: float = Field(5.0, gt=0, description="seconds between the planner's looks at the fleet")
    window_s: float = Field(60.0, gt=0, description="seconds of samples a recommendation is judged on")
    cooldown_s: float = Field(120.0, ge=0, description="no new step this long after a step was decided or the "
                              "role's worker count changed (watch, then decide)")
    min_workers: int = Field(1, ge=1, description="never recommend going below this many workers per role")
    max_workers: int = Field(16, ge=1, description="never recommend going above this many workers per role")
    warm_requests: int = Field(20, ge=1, description="a worker that joined is cold until it served this many "
                               "requests or its hit rate reached its role's")
    max_cold_s: float = Field(600.0, gt=0, description="a worker counts as cold at most this long after it joined")
    up_queue_per_worker: float = Field(2.0, gt=0, description="+1 when the window's waiting requests per worker "
                                       "reach this")
    up_ttft_s: float = Field(2.0, gt=0, description="+1 when the window's mean (or ttft_quantile) time to first "
                             "token (scheduler wait included) reaches this")
    ttft_quantile: float | None = Field(None, gt=0, lt=1, description="read this quantile of the window's time to "
                                        "first token (0.9: its p90, from the workers' TTFT histograms) instead of "
                                        "the mean; up_ttft_s and down_ttft_s then bound it")
    up_kv_usage: float = Field(0.9, gt=0, le=1, description="+1 when the window's mean KV use reaches this")
    down_queue_per_worker: float = Field(0.1, ge=0, description="-1 only while waiting requests per worker stay "
                                         "at or below this")
    down_ttft_s: float = Field(0.5, ge=0, description="-1 only while the mean (or ttft_quantile) time to first "
                               "token stays at or below this")
    down_kv_usage: float = Field(0.5, ge=0, le=1, description="-1 only if the KV use, spread over one worker "
                                 "fewer, stays at or below this")
    target_utilization: float | None = Field(None, gt=0, le=1, description="forecast sizing (off: null): +1 when "
                                             "the arrival rate forecast_lead_s ahead needs more workers at this "
                                             "share of a worker's measured service rate; -1 only if one fewer "
                                             "still suffices")
    forecast_lead_s: float = Field(0.0, ge=0, description="how far ahead the arrival trend is projected (the time "
                                   "a new worker takes to start); needs target_utilization")
    trend_window_s: float = Field(300.0, gt=0, description="seconds of arrivals the trend line is fitted on "
                                  "(kept across steps); needs target_utilization")
    service_rate_per_worker: float | None = Field(None, gt=0, description="requests/s one worker serves at full "
                                                  "load (from a load test), used until the planner measured it; "
                                                  "needs target_utilization")
    command: list[str] | None = Field(None, description="argv run on every step, with the role and the delta "
                                      "(+1 / -1) appended; not through a shell")
    webhook_url: str | None = Field(None, description="POSTed a JSON body {role, delta, reasons, at} on every step")
    kubernetes: KubernetesScale | None = Field(None, description="scale each role's Deployment through the "
                                               "Kubernetes API on every step")
    action_timeout_s: float = Field(10.0, gt=0, description="the command is killed / the webhook given up after this")

    @field_validator(*_KNOBS)
    @classmethod
    def _knobs_need_switch(cls, v: object, info: ValidationInfo) -> object:
        return knob_needs_switch(cls, v, info.field_name, bool(info.data.get("enabled", False)), "planner.enabled")

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("an http:// or https:// URL is needed")
        return v

    @field_validator("command")
    @classmethod
    def _argv(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError("an argv with at least the program is needed (or null)")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> PlannerConfig:
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) is below min_workers ({self.min_workers})")
        if self.down_queue_per_worker >= self.up_queue_per_worker:
            raise ValueError("down_queue_per_worker must be below up_queue_per_worker (else the planner flaps)")
        if self.down_ttft_s >= self.up_ttft_s:
            raise ValueError("down_ttft_s must be below up_ttft_s (else the planner flaps)")
        if self.target_utilization is None:
            for name in ("forecast_lead_s", "trend_window_s", "service_rate_per_worker"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"{name} acts only with target_utilization set; set it or remove {name}")
        elif self.trend_window_s < 2 * self.interval_s:
            raise ValueError(f"trend_window_s ({self.trend_window_s:g}) must cover at least two looks "
                             f"(2 x interval_s = {2 * self.interval_s:g})")
        if self.down_kv_usage >= self.up_kv_usage:
            raise ValueError("down_kv_usage must be below up_kv_usage (else the planner flaps)")
        return self
