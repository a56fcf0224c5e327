"""Typed configuration, loaded from YAML.

The shape follows the seed deployment config: ``control_plane``, ``execution_group.nodes``,
``routing``, ``metrics``. Each component receives only its own part (``RoutingConfig`` for the
router, ``NodeConfig`` for an engine, ...). Unknown keys are errors: a typo in a deployment file must
not silently fall back to a default.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from thunderagent.config._base import ConfigError, _Strict
from thunderagent.config.auth import check_key, check_tenant
from thunderagent.config.nats import NatsAuthConfig, NatsConfig, NatsTlsConfig
from thunderagent.config.observe import DecisionLogConfig, TracingConfig
from thunderagent.config.outlier import OutlierConfig
from thunderagent.config.planner import PlannerConfig
from thunderagent.config.routing import CostWeights, HotPrefixConfig, Policy, RoutingConfig
from thunderagent.config.tenants import TenantLimit, check_tenant_limits, program_caps
from thunderagent.config.tokenizer import TokenizerConfig
from thunderagent.config.scheduler import (GroupingConfig, IdleResume, PacingAccounting, PacingConfig, ResumeOrder,
                                          ResumePlacement, SchedulerConfig)
from thunderagent.config.transfer import DisaggConfig, KvTransferConfig, MigrationConfig, check_sim_fields

__all__ = [
    "Config", "ConfigError", "ControlPlaneConfig", "CostWeights", "HotPrefixConfig", "DecisionLogConfig",
    "TracingConfig", "DisaggConfig",
    "EndpointConfig",
    "ExecutionGroupConfig", "GroupingConfig", "KvTransferConfig", "MetricsConfig", "NatsAuthConfig", "NatsConfig",
    "MigrationConfig", "NatsTlsConfig", "NodeConfig", "OutlierConfig", "PlannerConfig",
    "PacingAccounting", "PacingConfig", "Policy", "ResumePlacement", "Role", "RoutingConfig", "SchedulerConfig",
    "SimulationConfig", "TenantLimit", "TimingConfig", "check_servers", "load_config", "parse_config", "program_caps",
    "ResumeOrder", "IdleResume",
]


class ControlPlaneConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    heartbeat_interval: float = Field(1.0, gt=0, description="seconds between worker heartbeats")
    heartbeat_misses: int = Field(3, ge=1, description="missed heartbeats before a worker leaves routing")
    health_check_enabled: bool = True
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="largest accepted request body")
    default_max_tokens: int = Field(1024, ge=1, description="max_tokens when a request gives none")
    # Hostile-client limits of the HTTP server (frontend/server.py, frontend/limits.py).
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body not fully received this long after its headers gets 408 and the "
        "connection is closed (slow bodies, a Content-Length larger than the body)",
    )
    idle_timeout_s: float = Field(
        60.0, gt=0, description="a connection that has not sent a complete request head this long after it opened "
        "or after its last response is closed (idle keep-alive and slow headers share this timer)",
    )
    max_header_bytes: int = Field(
        8190, ge=1024, le=1024 * 1024, description="longest request line and longest single header line (431 above)",
    )
    max_headers: int = Field(100, ge=16, le=10_000, description="most header lines in a request (431 above)")
    max_connections: int = Field(
        1024, ge=1, description="open client connections at most; past it a new connection gets 503 and is closed "
        "(keep it under the process's open-file limit, ulimit -n)",
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="a request not finished this long after it arrived (time held in the scheduler "
        "included) is aborted on its worker and answered 504 (a stream already begun ends with an error event); "
        "None: no limit",
    )
    shutdown_timeout_s: float = Field(
        25.0, ge=0, description="on SIGTERM or SIGINT the listener closes and the requests in flight (held ones "
        "included) get this long to finish before the rest are cut; keep it under the orchestrator's grace period "
        "(Kubernetes: terminationGracePeriodSeconds, 30 by default)",
    )
    admin_api: bool = Field(
        False, description="the operator's /v1/admin/workers endpoints (cordon, uncordon, add, remove workers). With "
        "API keys on they need an admin key; with keys off anyone who reaches the port may use them, so turn this on "
        "only where that is an operator (false: they answer 403)",
    )
    admin_state_file: str | None = Field(
        None, description="`thunderagent serve`: the operator's changes to the fleet (workers added and removed, "
        "cordons) kept in this JSON file, rewritten on each change and applied at the next start (None: a restart "
        "starts the configured fleet). Needs admin_api",
    )
    error_log_interval_s: float = Field(
        60.0, gt=0, description="an error cause is logged once per this many seconds, with a count of the "
        "repeats suppressed in between",
    )
    # API keys (frontend/auth.py). Any tenant key source turns keys on; see README "Tenants and API keys".
    api_keys: dict[str, str] = Field(
        default_factory=dict, description="key -> tenant, inline (tests and development only: keep secrets out "
        "of config files, use api_keys_file or api_keys_env)",
    )
    api_keys_file: str | None = Field(None, description="file of `KEY TENANT` lines or a YAML mapping KEY: TENANT")
    api_keys_env: str | None = Field(None, description="environment variable holding the same text as api_keys_file")
    admin_keys: list[str] = Field(
        default_factory=list, description="keys of the admin endpoints (/metrics, /v1/planner, /health detail, "
        "every tenant's programs), inline (tests and development only)",
    )
    admin_keys_file: str | None = Field(None, description="file of admin keys, one per line")
    admin_keys_env: str | None = Field(None, description="environment variable holding admin keys, one per line")
    tenant_limits: dict[str, TenantLimit] = Field(
        default_factory=dict, description="tenant -> its request limits (requests_per_s, burst, tokens_per_min, "
        "token_burst, max_in_flight, max_programs), shared by the frontends of a NATS deployment (max_programs: "
        "per frontend, each holds its own program table); the entry \"*\" applies to every tenant not named. "
        "Needs API keys on",
    )
    decision_log: DecisionLogConfig = Field(
        DecisionLogConfig(), description="JSON-lines log of routing decisions (README: `thunderagent explain`)",
    )
    tracing: TracingConfig = Field(
        TracingConfig(), description="OpenTelemetry spans of each request, exported over OTLP/HTTP (README: "
        "\"Tracing\")",
    )
    outlier: OutlierConfig = Field(
        OutlierConfig(), description="slow-worker ejection and circuit breaking (control/breaker.py)",
    )
    tokenizer: TokenizerConfig = Field(
        TokenizerConfig(), description="long prompts tokenized off the event loop, conversations' token ids reused",
    )

    @field_validator("api_keys")
    @classmethod
    def _tenant_keys(cls, v: dict[str, str]) -> dict[str, str]:
        for key, tenant in v.items():
            check_key(key)
            check_tenant(tenant)
        return v

    @field_validator("tenant_limits")
    @classmethod
    def _tenant_limits(cls, v: dict[str, TenantLimit]) -> dict[str, TenantLimit]:
        return check_tenant_limits(v)

    @field_validator("admin_keys")
    @classmethod
    def _admin_keys(cls, v: list[str]) -> list[str]:
        for key in v:
            check_key(key)
        return v

    @model_validator(mode="after")
    def _admin_needs_keys(self) -> ControlPlaneConfig:
        if self.keys_on:
            return self
        for name in ("admin_keys", "admin_keys_file", "admin_keys_env", "tenant_limits"):
            if getattr(self, name):
                raise ValueError(f"{name} acts only with API keys on (api_keys, api_keys_file or api_keys_env): "
                                 "without them every endpoint is open")
        return self

    @model_validator(mode="after")
    def _state_needs_admin(self) -> ControlPlaneConfig:
        if self.admin_state_file is not None and not self.admin_api:
            raise ValueError("admin_state_file keeps what the admin API changed: it needs admin_api: true")
        if self.admin_state_file is not None and not self.admin_state_file.strip():
            raise ValueError("admin_state_file: a file path, or leave it out")
        return self

    @property
    def keys_on(self) -> bool:
        """Whether requests need an API key."""
        return bool(self.api_keys) or self.api_keys_file is not None or self.api_keys_env is not None


class Role(str, Enum):
    prefill = "prefill"
    decode = "decode"
    both = "both"


class TimingConfig(_Strict):
    """Pass-time model of the simulated engine. ``polynomial`` is Dynamo mocker's default."""

    model: Literal["polynomial"] = "polynomial"
    prefill_coeffs: tuple[float, float, float] = (4.209989e-07, 1.518344e-02, 16.50142)
    decode_coeffs: tuple[float, float, float] = (-25.74, 54.01, 5.74)
    decode_floor_ms: float = 1.0
    speedup: float = Field(default=1.0, gt=0, description="divides every pass time (engine speed)")
    decode_speedup: float = Field(default=1.0, gt=0, description="divides decode time only")


class EndpointConfig(_Strict):
    """A real engine server: its OpenAI HTTP endpoint and its KV-event sockets."""

    url: str = Field(description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8101")
    kv_events: str | None = Field(None, description="ZMQ PUB endpoint of KV events, e.g. tcp://127.0.0.1:5571")
    kv_replay: str | None = Field(None, description="ZMQ ROUTER endpoint for replaying missed events")
    # The secret itself is read by the process that talks to the server, when its worker is built (a worker
    # process over NATS reads its own environment: a pod's Secret), never stored in the config
    api_key_env: str | None = Field(None, min_length=1, description="environment variable holding the key the "
                                    "server demands (vLLM / SGLang --api-key, llama.cpp --api-key): sent as "
                                    "Authorization: Bearer on every call to this server")
    api_key_file: str | None = Field(None, min_length=1, description="file holding that key (its first line)")
    data_parallel_rank: int | None = Field(None, ge=0, description="one data-parallel rank of a vLLM server run "
                                           "with --data-parallel-size: a worker of its own (its own KV cache), sent "
                                           "every request with X-data-parallel-rank, its load read from the metrics "
                                           "labelled engine=RANK; kv_events / kv_replay: the rank's own sockets "
                                           "(vLLM offsets their ports by the rank)")

    @model_validator(mode="after")
    def _schemes(self) -> EndpointConfig:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("api_key_env and api_key_file name the same key: set one")
        for name in ("kv_events", "kv_replay"):
            v = getattr(self, name)
            if v is not None and not v.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be a tcp:// or ipc:// endpoint, got {v!r}")
        return self


class NodeConfig(_Strict):
    """One group of identical workers."""

    role: Role = Role.both
    count: int = Field(1, ge=1)
    #: openai: any OpenAI-compatible server, no KV events (requests relayed unchanged: execution/openai.py)
    engine: Literal["simulated", "vllm", "sglang", "openai"] = "simulated"
    endpoints: list[EndpointConfig] = Field(
        default_factory=list, description="real engines only: one entry per server (count follows)"
    )
    max_batch_size: int = Field(256, ge=1, description="max running sequences (max_num_seqs)")
    max_num_batched_tokens: int = Field(8192, ge=1)
    enable_chunked_prefill: bool = True
    kv_blocks: int = Field(16384, ge=1)
    block_size: int = Field(64, ge=1)
    queue_depth_threshold: int = Field(64, ge=1, description="waiting requests at which a worker counts as busy")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM only: the servers' --scheduling-policy. priority: requests carry vLLM's `priority` "
        "(our priority negated: vLLM serves lower values first); fcfs: none is sent (older vLLM refuses a non-zero "
        "one, 0.32 ignores it), "
        "so priorities act only in ThunderAgent's holding queue",
    )
    relay: Literal["off", "unmodelled", "all"] | None = Field(
        None, description="vllm/sglang: which requests go to the server's own OpenAI endpoint with the client's body "
        "(routed on ThunderAgent's rendering of the prompt, the answer relayed as the server sends it) instead of as "
        "token ids. unmodelled: those asking for what ThunderAgent does not model (tools, tool calls, "
        "response_format, logprobs, penalties, n, images, the engine's own fields); all: every request (the server's "
        "tool-call and reasoning parsers on every answer; no mid-stream migration); off: such requests are a 400 "
        "naming the field. Default: unmodelled for vllm/sglang (off in a fleet with simulated workers or a prefill "
        "group); openai is always all, simulated always off",
    )
    kv_cache_transfer: KvTransferConfig = KvTransferConfig()
    timing: TimingConfig = TimingConfig()

    @field_validator("scheduling_policy")
    @classmethod
    def _vllm_policy(cls, v: str, info: ValidationInfo) -> str:
        engine = info.data.get("engine")
        if v != "fcfs" and engine != "vllm":  # fcfs, the default, is what a dumped config carries
            raise ValueError(f"vLLM's --scheduling-policy; engine {engine} does not take it (simulated engines "
                             "always order by priority; SGLang's priority is not forwarded)")
        return v

    def shared_server(self, k: int) -> str:
        """The url of the ``k``-th endpoint's server when it is one data-parallel rank of it (other workers drive the
        same server); empty otherwise (a simulated engine's ``k`` names no endpoint)."""
        e = self.endpoints[k] if 0 <= k < len(self.endpoints) else None
        return e.url.rstrip("/") if e is not None and e.data_parallel_rank is not None else ""

    def sequence_limits(self) -> tuple[int, int]:
        """(longest sequence, longest prompt) a simulated worker takes; (0, 0), unknown, for a real engine."""
        sim = self.engine == "simulated"
        return (self.kv_blocks * self.block_size if sim else 0,
                self.max_num_batched_tokens if sim and not self.enable_chunked_prefill else 0)

    @model_validator(mode="after")
    def _relay(self) -> NodeConfig:
        if self.relay not in (None, "off") and self.engine == "simulated":
            raise ValueError(f"relay: {self.relay}: a simulated engine has no OpenAI endpoint to relay to")
        if self.relay not in (None, "all") and self.engine == "openai":
            raise ValueError(f"relay: {self.relay}: engine openai relays every request (it has no token path)")
        return self

    @model_validator(mode="after")
    def _endpoints_match_engine(self) -> NodeConfig:
        if self.engine == "simulated":
            if self.endpoints:
                raise ValueError("endpoints are for real engines (engine: vllm|sglang), not simulated ones")
            return self
        if not self.endpoints:
            raise ValueError(f"engine {self.engine} needs endpoints: one {{url, kv_events}} per server")
        if self.engine == "openai" and any(e.kv_events or e.kv_replay for e in self.endpoints):
            raise ValueError("engine openai publishes no KV events: drop endpoints[].kv_events / kv_replay (routing "
                             "uses the router's own predictions), or use engine vllm|sglang for a server with events")
        if "count" in self.model_fields_set and self.count != len(self.endpoints):
            raise ValueError(f"count ({self.count}) differs from the number of endpoints ({len(self.endpoints)})")
        if self.engine == "sglang" and any(e.data_parallel_rank is not None for e in self.endpoints):
            raise ValueError("endpoints[].data_parallel_rank: vLLM's (SGLang's data-parallel ranks are not addressed "
                             "by ThunderAgent: list the server once)")
        object.__setattr__(self, "count", len(self.endpoints))
        return self


def check_roles(nodes: list[NodeConfig], disagg_set: bool) -> None:
    """Roles act: a prefill pool needs a pool that decodes and the transfer plane; transfer knobs or a
    disaggregation section without a prefill pool would not act."""
    prefill = [k for k, n in enumerate(nodes) if n.role is Role.prefill]
    for k, n in enumerate(nodes):
        if n.kv_cache_transfer.enabled and n.role is not Role.prefill:
            raise ValueError(f"execution_group.nodes.{k}.kv_cache_transfer.enabled: the transfer plane is configured "
                             f"on the role: prefill group (this one is role {n.role.value})")
        if n.role is Role.prefill and not n.kv_cache_transfer.enabled:
            raise ValueError(f"execution_group.nodes.{k}.kv_cache_transfer.enabled must be true on a role: prefill "
                             "group: its KV moves to the decode workers")
        check_sim_fields(f"execution_group.nodes.{k}.kv_cache_transfer", n.engine, n.kv_cache_transfer)
    if prefill and all(n.role is Role.prefill for n in nodes):
        raise ValueError("execution_group.nodes: role prefill workers need a role decode or both group to decode "
                         "their requests")
    if disagg_set and not prefill:
        raise ValueError("routing.disaggregation acts only with a role: prefill node group; add one or remove it")
    planes = {nodes[k].kv_cache_transfer for k in prefill}
    if len(planes) > 1:
        raise ValueError("execution_group.nodes.*.kv_cache_transfer: the prefill groups configure one fleet-wide "
                         "transfer plane and must agree")


def resolve_relay(nodes: list[NodeConfig]) -> None:
    """``relay`` for the whole fleet: a relayed request may land on any worker, so vLLM / SGLang groups relay only
    when every group can and none prefills for another (a relayed body has no prefill/decode split), and all in one
    mode."""
    blocked = next((f"engine {n.engine}" for n in nodes if n.engine == "simulated"), None) or next(
        ("a role: prefill group" for n in nodes if n.role is Role.prefill), None)
    for k, n in enumerate(nodes):
        if n.relay not in (None, "off") and blocked is not None and n.engine != "openai":
            raise ValueError(f"execution_group.nodes.{k}.relay: a relayed request may go to any worker, and this fleet "
                             f"has {blocked}, which cannot serve one; leave it unset (off here)")
        if n.relay is None:
            default = "all" if n.engine == "openai" else "unmodelled" if blocked is None and n.engine != "simulated" \
                else "off"
            object.__setattr__(n, "relay", default)
    modes = {n.relay for n in nodes}
    if len(modes) > 1 and "off" not in modes:
        raise ValueError(f"execution_group.nodes.*.relay: the groups of one fleet relay alike (the frontend decides "
                         f"per request before routing), got {sorted(modes)}")


class ExecutionGroupConfig(_Strict):
    nodes: list[NodeConfig] = Field(default_factory=lambda: [NodeConfig(count=4)])

    @model_validator(mode="after")
    def _one_block_size(self) -> ExecutionGroupConfig:
        if not self.nodes:
            raise ValueError("execution_group.nodes must list at least one node group")
        sizes = {n.block_size for n in self.nodes}
        if len(sizes) > 1:
            raise ValueError(f"all nodes must share one block_size for a common KV index, got {sorted(sizes)}")
        check_servers([(f"execution_group.nodes.{g}.endpoints.{k}", e) for g, n in enumerate(self.nodes)
                       for k, e in enumerate(n.endpoints)])
        return self


def check_servers(endpoints: list[tuple[str, EndpointConfig]]) -> None:
    """A server is listed once, or once per data-parallel rank (``data_parallel_rank`` on each of its entries,
    all different): twice, its requests would be counted as two workers' and its cache indexed twice."""
    seen: dict[tuple[str, int | None], str] = {}
    ranked: dict[str, bool] = {}
    for where, e in endpoints:
        url = e.url.rstrip("/")
        if ranked.setdefault(url, e.data_parallel_rank is not None) != (e.data_parallel_rank is not None):
            raise ValueError(f"{where}: {url} is listed with and without data_parallel_rank: give every entry of a "
                             "data-parallel server its rank")
        key = (url, e.data_parallel_rank)
        if key in seen:
            rank = "" if e.data_parallel_rank is None else f" rank {e.data_parallel_rank}"
            raise ValueError(f"{where}: {url}{rank} is already {seen[key]} (a server is listed once, or once per "
                             "data_parallel_rank)")
        seen[key] = where


class MetricsConfig(_Strict):
    enabled: bool = True
    path: str = "/metrics"
    window_s: float = Field(60.0, gt=0, description="sliding window of the rate gauges (cache hit, reuse, "
                            "recompute rates)")
    max_route_keys: int = Field(32, ge=1, description="route keys (tenants, with API keys on) labelled one by one "
                                "in the per-key TTFT/ITL histograms and the per-tenant program evictions; later "
                                "ones share the label _other")


class SimulationConfig(_Strict):
    speedup: float = Field(1.0, gt=0, description="virtual seconds per wall second when serving")


class Config(_Strict):
    control_plane: ControlPlaneConfig = ControlPlaneConfig()
    execution_group: ExecutionGroupConfig = ExecutionGroupConfig()
    routing: RoutingConfig = RoutingConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    metrics: MetricsConfig = MetricsConfig()
    simulation: SimulationConfig = SimulationConfig()
    nats: NatsConfig = NatsConfig()
    planner: PlannerConfig = Field(PlannerConfig(), description="step-wise scaling planner (control/planner.py)")
    model_name: str = "thunderagent-sim"
    model: str | None = Field(
        None, description="local model directory (tokenizer + chat template) for real engines; none = byte tokenizer"
    )

    @model_validator(mode="after")
    def _model_for_real_engines(self) -> Config:
        kinds = {n.engine for n in self.execution_group.nodes}
        if "openai" in kinds and len(kinds) > 1:
            raise ValueError(f"execution_group.nodes: engine openai cannot share a fleet with {sorted(kinds - {'openai'})}"
                             " (its answers are relayed as the server sent them, the others' are formatted here)")
        # engine openai tokenizes with `model` when it is set, else with the byte-level stand-in
        real = sorted(kinds - {"simulated", "openai"})
        if real and self.model is None:
            raise ValueError(
                f"engine {real[0]} needs `model`: the local model directory the engine serves (its tokenizer "
                "and chat template tokenize prompts here, so our block hashes match the engine's cache)"
            )
        tok = self.control_plane.tokenizer
        if self.model is None and tok.prefix_cache_mb != TokenizerConfig.model_fields["prefix_cache_mb"].default:
            raise ValueError("control_plane.tokenizer.prefix_cache_mb acts only with `model` (a model's tokenizer); "
                             "the byte-level stand-in tokenizes without a cache")
        if self.routing.preempt_enabled and all(n.engine != "simulated" for n in self.execution_group.nodes):
            raise ValueError(
                "routing.preempt_enabled acts in simulated engines and this config has none; for vLLM set the node's "
                "scheduling_policy: priority (vLLM preempts by priority itself)"
            )
        # (defaults accepted: a dumped config, defaults filled in, must load again)
        check_roles(self.execution_group.nodes, self.routing.disaggregation != DisaggConfig())
        if (mc := self.routing.migration).link.enabled:  # its copies move simulated workers' bytes, or their own
            for n in self.execution_group.nodes:
                check_sim_fields("routing.migration.link", n.engine, mc.link)
        resolve_relay(self.execution_group.nodes)
        return self


def _format_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"{source}: field '{loc}': {err['msg']}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "<config>") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from exc


def load_config(path: str | Path) -> Config:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    return parse_config(data, str(p))
