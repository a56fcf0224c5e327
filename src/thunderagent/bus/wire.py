"""Messages between frontends and workers over the NATS bus: subjects, typed structs, codecs.

Pure (no I/O, no clock). Every message is a ``msgspec.Struct`` encoded as a msgpack *array*
(``array_like``: no field names on the wire, no per-message dict). Hash and token lists travel as
packed little-endian integer bytes (``bus.packing``). The KV event batches and cache dumps live in
``bus.wire_kv`` (re-exported here), the operator's calls (``<p>.rpc.<id>.reset_cache|adapter``) in ``bus.wire_admin``.

Subjects (``<p>`` is the deployment prefix, ``ta`` by default; ``<id>`` a worker id)::

    <p>.worker.<id>.hello      worker -> frontends   Heartbeat, on start and on every discover
    <p>.worker.<id>.hb         worker -> frontends   Heartbeat: lease renewal + load report
    <p>.worker.<id>.kv         worker -> frontends   KvBatch: KV events with per-worker seq
    <p>.worker.<id>.kv.s       worker -> its owner   the same, with nats.index: sharded (one frontend indexes it)
    <p>.worker.<id>.bye        worker -> frontends   Bye: clean shutdown: leave routing, drain
    <p>.worker.<id>.unavailable  worker -> frontends Unavailable: out of routing until the next heartbeat
    <p>.rpc.<id>.generate      frontend -> worker    GenerateRequest; outputs go to its reply subject
    <p>.rpc.<id>.abort         frontend -> worker    Abort
    <p>.rpc.<id>.dump          frontend -> worker    (empty) request; DumpChunk replies
    <p>.rpc.<id>.ping          frontend -> worker    (empty) request; Pong reply: "which instance are you?"
    <p>.rpc.<id>.cordon        frontend -> worker    b"1" / b"0": cordon or uncordon; a heartbeat, then a Pong reply
    <p>.discover               frontend -> workers   (empty): every worker answers with a hello
    <p>.frontend.<frontend>.hb frontend -> workers, frontends  FrontendBeat, every heartbeat_interval: the
                               lease of its requests (workers); which frontend acts for the planner (frontends)
    <p>.frontend.<frontend>.planner  frontend -> frontends  PlannerCounters, every planner.interval_s: what
                               it routed to each worker (the planner judges the fleet's, not one frontend's)
    <p>.frontend.<frontend>.match    frontend -> frontend   MatchAsk request, MatchAnswer reply (sharded
                               index: how much of a prompt the workers that frontend indexes hold)
    <p>.frontend.abort_held    frontend -> frontends HeldAbort (``bus.wire_admin``): /abort_requests, held requests
    <p>.frontend.<frontend>.demand   frontend -> frontends  MigrationDemand (``bus.wire_migration``): cache migration
    <p>.programs.release       frontend -> frontends ProgramRelease: a client released an agent program
    <p>.programs.reply.<frontend>.<token>  frontend -> frontend  (any payload): "I held it and released it"
    <p>.tenants.usage          frontend -> frontends TenantUsage: tenants' use since the last report (shared limits)
    <p>.reply.<id>.<frontend>.<rid>        worker -> frontend   TokenBatch stream of one request
    <p>.reply.<id>.<frontend>.call.<token> worker -> frontend   replies to a dump or ping

Identity is the subject. Everything a worker publishes is under a subject naming it
(``<p>.worker.<id>.>``, ``<p>.reply.<id>.>``), so a NATS server that lets each worker's user publish
only there (README: "Security") makes identity unforgeable; a frontend ignores a message whose
payload names another worker than its subject, a stream message from another worker than the one
serving the request, and a new instance of a worker whose current instance still answers a ping. A
worker answers only to reply subjects under its own name.

A frontend subscribes to ``<p>.worker.>`` with ONE subscription, so a worker's hello, heartbeats,
events and bye are handled in publication order (NATS keeps one publisher's order per subscriber;
nats-py runs each subscription's callbacks in order). A worker likewise takes all of its RPCs on one
subscription, so an abort is never handled before the generate it cancels.
"""

from __future__ import annotations

import re

import msgspec

from thunderagent.bus.packing import pack_u32, pack_u64, unpack_u32, unpack_u64  # noqa: F401  (re-exported)
from thunderagent.bus.wire_kv import (  # noqa: F401  (re-exported: the wire's KV-index messages)
    DUMP_CHUNK_HASHES,
    Dump,
    DumpChunk,
    KvBatch,
    WireCleared,
    WireEvent,
    WireRemoved,
    WireStored,
    decode_dump_chunk,
    decode_kv,
    dump_chunks,
    events_from_wire,
    events_to_wire,
    join_dump,
)

from thunderagent.types import (EngineRequest, FinishReason, KvPull, KvTransfer, LoadReport, Passthrough, Sampling,
                                TokenOutput, WorkerInfo)

#: bumped on any incompatible change; a frontend ignores workers speaking another version
WIRE_VERSION = 5  # 2: GenerateRequest carries arrival and sampling; 3: replies under <p>.reply.<id>, ping;
# 4: requests and outputs carry prefill/decode transfer fields; 5: stored events and dumps carry check hashes
#: a worker sends an empty TokenBatch for a request that produced nothing for this long ...
KEEPALIVE_S = 2.0
#: ... so a frontend that hears nothing about a request for this long knows it is lost
STALL_TIMEOUT_S = 4 * KEEPALIVE_S
#: bytes of a GenerateRequest besides its prompt and hashes: ids, numbers, and room for the
#: client's cache_salt, lora_name and trace headers (longer ones are caught when the request is encoded)
_REQUEST_OVERHEAD = 4096

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def check_token(value: str, what: str) -> str:
    """A worker id or prefix must be one NATS subject token."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must be letters, digits, '_' or '-' (it is a NATS subject token)")
    return value


class Subjects:
    """Subject names of one deployment (``prefix`` keeps deployments on one server apart)."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str = "ta") -> None:
        self.prefix = check_token(prefix, "subject prefix")

    def worker(self, worker_id: str, kind: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.{kind}"

    def all_workers(self) -> str:
        return f"{self.prefix}.worker.>"

    def rpc(self, worker_id: str, kind: str) -> str:
        return f"{self.prefix}.rpc.{worker_id}.{kind}"

    def rpcs(self, worker_id: str) -> str:
        return f"{self.prefix}.rpc.{worker_id}.*"

    def discover(self) -> str:
        return f"{self.prefix}.discover"

    def frontend_beat(self, frontend_id: str) -> str:
        return f"{self.prefix}.frontend.{frontend_id}.hb"

    def frontend_beats(self) -> str:
        return f"{self.prefix}.frontend.*.hb"

    def planner_counters(self, frontend_id: str) -> str:
        """Where a frontend shares what it routed to each worker (frontends only: workers hear ``*.hb``)."""
        return f"{self.prefix}.frontend.{frontend_id}.planner"

    def all_planner_counters(self) -> str:
        return f"{self.prefix}.frontend.*.planner"

    def match(self, frontend_id: str) -> str:
        """Where a frontend answers lookups into the part of a sharded index it holds."""
        return f"{self.prefix}.frontend.{frontend_id}.match"

    def match_reply(self, frontend_id: str, token: str) -> str:  # (and a HeldAbort's reply)
        return f"{self.prefix}.frontend.{frontend_id}.reply.{token}"

    def held_abort(self) -> str:
        """Where a frontend asked for ``/abort_requests`` asks the others to end their held requests too."""
        return f"{self.prefix}.frontend.abort_held"

    def program_release(self) -> str:
        """Where a frontend tells the others that a client released a program (each holds its own table)."""
        return f"{self.prefix}.programs.release"

    def tenant_usage(self) -> str:
        """Where each frontend reports its tenants' use, so per-tenant limits hold across the frontends."""
        return f"{self.prefix}.tenants.usage"

    def program_reply(self, frontend_id: str, token: str) -> str:
        return f"{self.prefix}.programs.reply.{frontend_id}.{token}"

    def reply(self, worker_id: str, frontend_id: str, request_id: str) -> str:
        """Where ``worker_id`` streams the outputs of one request of ``frontend_id``."""
        return f"{self.prefix}.reply.{worker_id}.{frontend_id}.{request_id}"

    def replies(self, frontend_id: str) -> str:
        """Every request stream to ``frontend_id``, from any worker (not the call replies)."""
        return f"{self.prefix}.reply.*.{frontend_id}.*"

    def call_reply(self, worker_id: str, frontend_id: str, token: str) -> str:
        """Where ``worker_id`` answers one dump or ping of ``frontend_id``."""
        return f"{self.prefix}.reply.{worker_id}.{frontend_id}.call.{token}"

    def reply_prefix(self, worker_id: str) -> str:
        """Every reply subject of ``worker_id`` starts with this: it answers nowhere else."""
        return f"{self.prefix}.reply.{worker_id}."

    def parse_reply(self, subject: str) -> tuple[str, str] | None:
        """``<p>.reply.<id>.<frontend>.<rid>`` -> (id, rid); None for anything else."""
        parts = subject.split(".")
        if len(parts) != 5 or parts[0] != self.prefix or parts[1] != "reply":
            return None
        return parts[2], parts[4]

    def reply_frontend(self, subject: str) -> str | None:
        """The frontend a reply subject (stream or call) goes to."""
        parts = subject.split(".")
        if len(parts) < 5 or parts[0] != self.prefix or parts[1] != "reply":
            return None
        return parts[3]

    def parse_worker(self, subject: str) -> tuple[str, str] | None:
        """``<p>.worker.<id>.<kind>`` (or ``<p>.worker.<id>.kv.s``: ``kv``) -> (id, kind); None for anything else."""
        parts = subject.split(".")
        if len(parts) == 5 and parts[3:] == ["kv", "s"]:
            parts = parts[:4]
        if len(parts) != 4 or parts[0] != self.prefix or parts[1] != "worker":
            return None
        return parts[2], parts[3]

    def worker_kv(self, worker_id: str, sharded: bool) -> str:
        """Where a worker publishes its KV events: ``<p>.worker.<id>.kv``, or (sharded index) ``<p>.worker.<id>.kv.s``,
        which the frontends' ``<p>.worker.*.*`` does not match (each frontend subscribes to the workers it indexes)."""
        return f"{self.prefix}.worker.{worker_id}.kv.s" if sharded else f"{self.prefix}.worker.{worker_id}.kv"

    def worker_control(self) -> str:
        """Every worker's hello, heartbeats, bye and unavailable, not its sharded KV events."""
        return f"{self.prefix}.worker.*.*"


# -- discovery and load -----------------------------------------------------------------------
class WireInfo(msgspec.Struct, array_like=True, frozen=True):
    worker_id: str
    role: str
    engine: str
    block_size: int
    max_num_batched_tokens: int
    queue_depth_threshold: int
    kv_total_blocks: int
    max_num_seqs: int = 0  # trailing with a default: an older worker's message still decodes
    max_seq_tokens: int = 0
    max_prompt_tokens: int = 0
    adapters: list[str] = []  # the LoRA adapters its server serves by name
    server: str = ""  # the server it shares with other workers (a data-parallel rank's url)


class WireLoad(msgspec.Struct, array_like=True, frozen=True):
    time: float
    running: int
    waiting: int
    queued_prefill_tokens: int
    decode_tokens: int
    kv_active_blocks: int
    kv_cached_blocks: int
    kv_total_blocks: int


class Heartbeat(msgspec.Struct, array_like=True, frozen=True):
    """Hello and heartbeat alike: a frontend that missed the hello registers the worker from any heartbeat. ``instance``
    changes on every worker process start (same id, new cache, seq from 0); ``last_seq`` is the last KV event seq
    published before it, so a lost tail of events is noticed even when no further event comes."""

    version: int
    instance: str
    info: WireInfo
    load: WireLoad
    last_seq: int
    cordoned: bool = False  # an operator took it out of routing (``<p>.rpc.<id>.cordon``); every frontend leaves it out
    asleep: bool = False  # its server was put to sleep through a frontend (``call /sleep``): routed to last
    paused: bool = False  # its server's generation was paused through a frontend (``pause``): routed to last
    #: its server's own KV pulls so far (vLLM's NIXL metrics: bytes, seconds, transfers); None: it reports none
    kv_pulls: tuple[float, float, float] | None = None
    #: its server's computed prompt tokens and prefill seconds so far (vLLM's metrics); None: it reports none
    prefill: tuple[float, float] | None = None


class Bye(msgspec.Struct, array_like=True, frozen=True):
    instance: str


class Pong(msgspec.Struct, array_like=True, frozen=True):
    """A worker's answer to a ping: the instance it runs. A frontend that hears a new instance of a
    worker pings it; an answer from the instance it knows proves that one alive, and the new claim
    is ignored (forged, or two processes share the id)."""

    instance: str


class ProgramRelease(msgspec.Struct, array_like=True, frozen=True):
    """A client released agent program ``key`` (the program table's key: ``tenant/id`` with API keys on)
    through frontend ``origin``; every other frontend holding it releases it too, and answers the
    message's reply subject if it did."""

    origin: str
    key: str


class TenantUse(msgspec.Struct, array_like=True, frozen=True):
    tenant: str
    requests: int  # admitted since the last report
    tokens: int  # taken since the last report (prompts and completions, less prompts given back)
    in_flight: int  # now
    programs: int = 0  # its agent programs with a request in flight, now (max_programs; absent from older frontends)


class TenantUsage(msgspec.Struct, array_like=True, frozen=True):
    """Frontend ``origin``'s tenants' use since its last report (``control_plane.tenant_limits`` hold
    across the frontends: each takes the others' use from its own buckets)."""

    origin: str
    uses: list[TenantUse]


class FrontendBeat(msgspec.Struct, array_like=True, frozen=True):
    """A frontend's heartbeat. Workers read only its subject (the lease of its requests); frontends read
    the body to agree on which of them acts for the scaling planner (``control/leadership.py``)."""

    started_at: float  # its wall clock at start: the oldest frontend whose planner can act leads
    planner_acts: bool  # its planner is on, with a command, a webhook or a Deployment to scale
    copies: bool = False  # it runs cache migration (``routing.migration``): the oldest such frontend plans the copies


class WorkerCounters(msgspec.Struct, array_like=True, frozen=True):
    """One frontend's cumulative counts for one worker since it started (the planner's ``WorkerSample``
    counters): requests routed, of them to a holder of part of their prompt, first tokens and their TTFT."""

    worker_id: str
    routed: int
    hits: int
    ttft_count: int
    ttft_sum: float
    ttft_buckets: list[tuple[float, int]] = []  # (upper bound s, cumulative count); only with planner.ttft_quantile


class PlannerCounters(msgspec.Struct, array_like=True, frozen=True):
    """Frontend ``origin``'s counters per worker, for the other frontends' planners."""

    origin: str
    workers: list[WorkerCounters]


class MatchAsk(msgspec.Struct, array_like=True, frozen=True):
    """Sharded index: how many leading blocks of this prompt does each worker you index hold?"""

    hashes: bytes  # packed u64
    checks: bytes | None = None  # packed u64: the double-hash guard's, same order


class MatchAnswer(msgspec.Struct, array_like=True, frozen=True):
    origin: str  # the answering frontend
    matches: list[tuple[str, int]]  # (worker, leading blocks held), workers it indexes only, 0s left out


class Unavailable(msgspec.Struct, array_like=True, frozen=True):
    """The worker cannot serve now (its engine unreachable, a block-size mismatch...)."""

    instance: str
    reason: str


def info_to_wire(info: WorkerInfo, engine: str) -> WireInfo:
    return WireInfo(info.worker_id, info.role, engine, info.block_size, info.max_num_batched_tokens,
                    info.queue_depth_threshold, info.kv_total_blocks, info.max_num_seqs, info.max_seq_tokens,
                    info.max_prompt_tokens, list(info.adapters), info.server)


def info_from_wire(w: WireInfo) -> WorkerInfo:
    seq = w.max_seq_tokens
    if not seq and w.engine == "simulated":  # a worker from before the field: its KV pool is its limit
        seq = w.kv_total_blocks * w.block_size
    return WorkerInfo(w.worker_id, w.role, w.block_size, w.max_num_batched_tokens, w.queue_depth_threshold,
                      w.kv_total_blocks, w.max_num_seqs, seq, w.max_prompt_tokens, tuple(w.adapters), w.server)


def load_to_wire(r: LoadReport) -> WireLoad:
    return WireLoad(r.time, r.running, r.waiting, r.queued_prefill_tokens, r.decode_tokens, r.kv_active_blocks,
                    r.kv_cached_blocks, r.kv_total_blocks)


def load_from_wire(w: WireLoad, worker_id: str) -> LoadReport:
    return LoadReport(worker_id, w.time, w.running, w.waiting, w.queued_prefill_tokens, w.decode_tokens,
                      w.kv_active_blocks, w.kv_cached_blocks, w.kv_total_blocks)


# ---------------------------------------------------------------------------------------------
# requests and outputs
# ---------------------------------------------------------------------------------------------
class WireSampling(msgspec.Struct, array_like=True, frozen=True):
    temperature: float | None
    top_p: float | None
    seed: int | None


class WireKvTransfer(msgspec.Struct, array_like=True, frozen=True):
    source_worker: str
    num_tokens: int
    block_hashes: bytes  # packed u64
    engine_params: str | None


def _kv_to_wire(t: KvTransfer | None) -> WireKvTransfer | None:
    return None if t is None else WireKvTransfer(t.source_worker, t.num_tokens, pack_u64(t.block_hashes),
                                                 t.engine_params)


def _kv_from_wire(w: WireKvTransfer | None) -> KvTransfer | None:
    return None if w is None else KvTransfer(w.source_worker, w.num_tokens, tuple(unpack_u64(w.block_hashes)),
                                             w.engine_params)


class GenerateRequest(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    prompt: bytes  # packed u32 token ids
    block_hashes: bytes  # packed u64: computed once by the frontend, not again by the worker
    hash_seed: int
    max_tokens: int
    ignore_eos: bool
    priority: int
    arrival: float
    cache_salt: str | None  # real engines key their own prefix cache on these
    lora_name: str | None
    sampling: WireSampling | None  # what the client set; real engines sample with it
    resumed: int = 0  # a migrated request: generated tokens at the end of the prompt
    check_hashes: bytes | None = None  # packed u64: the double-hash guard's (kv.check), None when off
    remote_decode: bool = False  # a prefill-only job (prefill/decode disaggregation)
    kv_from: WireKvTransfer | None = None  # the decode side: where the prompt's KV is pulled from
    passthrough: tuple[str, bytes, bool, str] | None = None  # relayed unchanged: path, body, stream, method
    headers: tuple[tuple[str, str], ...] = ()  # client headers sent on to the engine server (trace context)
    prompt_len: int = 0  # a relayed request's prompt tokens (its prompt and hashes are not sent: request_to_wire)


class Abort(msgspec.Struct, array_like=True, frozen=True):
    request_id: str


class WireToken(msgspec.Struct, array_like=True, frozen=True):
    token_ids: list[int]
    time: float
    prompt_tokens: int
    cached_tokens: int
    finished: bool
    finish_reason: str | None
    text: str | None
    kv_transfer: WireKvTransfer | None = None
    raw: bytes | None = None  # engine openai: the server's answer bytes, relayed
    raw_status: int = 200
    kv_pull: KvPull | None = None  # a decode worker's pull of the KV bytes (simulated workers; a map)


class TokenBatch(msgspec.Struct, array_like=True, frozen=True):
    """One message of a request's output stream. ``n`` counts the stream's messages from 0 (the
    worker's acceptance, no outputs); a frontend that sees ``n`` skip knows outputs were lost.
    Empty batches after the first are keepalives. ``error`` is set when the worker refused the
    request (then ``outputs`` holds one finished output)."""

    n: int
    outputs: list[WireToken]
    error: str | None = None


def request_to_wire(req: EngineRequest) -> GenerateRequest:
    """Every field of :class:`EngineRequest` crosses (a test enumerates them), but a relayed request's prompt: its
    server gets the client's body, so its worker needs the prompt's length alone (accounting) and no hashes; they
    would take as many bytes as the body again (4 a token, 16 a block) and halve what one message carries."""
    s, p = req.sampling, req.passthrough
    sampling = None if s is None else WireSampling(s.temperature, s.top_p, s.seed)
    return GenerateRequest(req.request_id, b"" if p else pack_u32(req.prompt_tokens),
                           b"" if p else pack_u64(req.block_hashes), req.hash_seed,
                           req.max_tokens, req.ignore_eos, req.priority, req.arrival, req.cache_salt, req.lora_name,
                           sampling, req.resumed,
                           None if req.check_hashes is None or p else pack_u64(req.check_hashes),
                           req.remote_decode, _kv_to_wire(req.kv_from),
                           None if p is None else (p.path, p.body, p.stream, p.method),
                           req.headers, len(req.prompt_tokens) if p else 0)


def request_from_wire(g: GenerateRequest) -> EngineRequest:
    s = g.sampling
    relayed = g.passthrough is not None  # (its prompt: a length; range() stands for it without a list)
    return EngineRequest(g.request_id, range(g.prompt_len) if relayed else unpack_u32(g.prompt),
                         unpack_u64(g.block_hashes), g.hash_seed, g.max_tokens,
                         ignore_eos=g.ignore_eos, priority=g.priority, arrival=g.arrival, cache_salt=g.cache_salt,
                         lora_name=g.lora_name, sampling=None if s is None else Sampling(s.temperature, s.top_p, s.seed),
                         resumed=g.resumed,
                         check_hashes=None if g.check_hashes is None else unpack_u64(g.check_hashes),
                         remote_decode=g.remote_decode, kv_from=_kv_from_wire(g.kv_from),
                         passthrough=None if g.passthrough is None else Passthrough(*g.passthrough),
                         headers=g.headers)


def output_to_wire(o: TokenOutput) -> WireToken:
    return WireToken(o.token_ids, o.time, o.prompt_tokens, o.cached_tokens, o.finished, o.finish_reason, o.text,
                     _kv_to_wire(o.kv_transfer), o.raw, o.raw_status, o.kv_pull)


def output_from_wire(request_id: str, w: WireToken) -> TokenOutput:
    reason = None if w.finish_reason is None else FinishReason(w.finish_reason)
    return TokenOutput(request_id, w.token_ids, w.time, w.prompt_tokens, w.cached_tokens, w.finished, reason, w.text,
                       _kv_from_wire(w.kv_transfer), w.raw, w.raw_status, w.kv_pull)


def message_limits(max_payload: int, block_size: int) -> tuple[int, int]:
    """What one GenerateRequest message carries: the longest prompt (4 bytes a token, 16 a full block: its hash and
    the double-hash guard's), and the largest relayed body (its prompt is not sent: :func:`request_to_wire`)."""
    budget = max(0, max_payload - _REQUEST_OVERHEAD)
    blocks, rest = divmod(budget, 4 * block_size + 16)
    return blocks * block_size + min(rest // 4, block_size - 1), budget


# -- codecs (one encoder; one decoder per type, reused) ---------------------------------------
_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

decode_heartbeat = msgspec.msgpack.Decoder(Heartbeat).decode
decode_bye = msgspec.msgpack.Decoder(Bye).decode
decode_pong = msgspec.msgpack.Decoder(Pong).decode
decode_program_release = msgspec.msgpack.Decoder(ProgramRelease).decode
decode_tenant_usage = msgspec.msgpack.Decoder(TenantUsage).decode
decode_frontend_beat = msgspec.msgpack.Decoder(FrontendBeat).decode
decode_planner_counters = msgspec.msgpack.Decoder(PlannerCounters).decode
decode_match_ask = msgspec.msgpack.Decoder(MatchAsk).decode
decode_match_answer = msgspec.msgpack.Decoder(MatchAnswer).decode
decode_unavailable = msgspec.msgpack.Decoder(Unavailable).decode
decode_generate = msgspec.msgpack.Decoder(GenerateRequest).decode
decode_abort = msgspec.msgpack.Decoder(Abort).decode
decode_tokens = msgspec.msgpack.Decoder(TokenBatch).decode
