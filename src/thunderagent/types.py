"""Plain typed data exchanged between the planes.

Everything here is a slots dataclass: cheap to build on the hot path, no dict passed around loosely.
Times are seconds on the clock of whoever drives the core (wall clock in the server, virtual clock
in the simulator); the core never reads a clock itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

# re-exported: the routing decision's data (compiled, in its own module)
from thunderagent.decision import CandidateScore, Decision, HotPrefixNote, PdPlan  # noqa: F401


# ---------------------------------------------------------------------------------------------
# KV events (execution plane -> KvIndex)
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class BlockStored:
    """Blocks became cached on a worker. ``block_hashes`` are *our* chained hashes, in chain order;
    ``parent_hash`` is the hash of the block before the first one (None at the start of a sequence)."""

    worker_id: str
    seq: int
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None
    #: check hashes of the same blocks (``kv.hashing.block_hash_pairs``), from a source that hashed
    #: the tokens itself; None: unverified (see ``kv.check``)
    check_hashes: tuple[int, ...] | None = None


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks were evicted from a worker's cache."""

    worker_id: str
    seq: int
    block_hashes: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """A worker dropped its whole cache (reset, restart)."""

    worker_id: str
    seq: int


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


# ---------------------------------------------------------------------------------------------
# Workers (execution plane -> registry)
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class WorkerInfo:
    """A worker's static facts, as it registers (in process or over the bus)."""

    worker_id: str
    role: str
    block_size: int
    max_num_batched_tokens: int
    queue_depth_threshold: int
    kv_total_blocks: int
    #: sequences its engine runs at once (max_num_seqs / max_batch_size; 0: not said)
    max_num_seqs: int = 0
    #: longest sequence (prompt + max_tokens) it can hold, and longest prompt it can take (0: not
    #: said). A mixed fleet routes a request only to workers that hold it (``WorkerState.holds``).
    max_seq_tokens: int = 0
    max_prompt_tokens: int = 0
    #: names its server serves (routing sends a request naming one only to workers listing it): a vLLM / SGLang
    #: server's LoRA adapters (its ``/v1/models`` entries with a ``parent``), an ``engine: openai`` server's every model
    adapters: tuple[str, ...] = ()
    #: the server it shares with other workers (one data-parallel rank of a vLLM server: its url), so an operator's
    #: call on the servers reaches that server once; empty: a server of its own
    server: str = ""


# ---------------------------------------------------------------------------------------------
# Load (execution plane -> router / registry)
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class LoadReport:
    """A worker's load as its engine sees it at ``time``."""

    worker_id: str
    time: float
    running: int  # requests admitted (prefilling or decoding)
    waiting: int  # requests queued, not admitted yet
    queued_prefill_tokens: int  # prompt tokens still to prefill (waiting + partial), less expected cache hits
    decode_tokens: int  # sum of sequence lengths of decoding requests (their KV footprint)
    kv_active_blocks: int  # blocks referenced by running requests
    kv_cached_blocks: int  # blocks holding a hash (active or free-but-cached)
    kv_total_blocks: int
    #: the last KV event seq the worker published (on heartbeats of in-process workers; -1: not
    #: said). An index behind it lost the stream's tail: no later event would reveal that gap.
    kv_seq: int = -1

    @property
    def kv_usage(self) -> float:
        return self.kv_active_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


# ---------------------------------------------------------------------------------------------
# Engine requests and outputs (control plane <-> execution plane)
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class EngineRequest:
    """One generation request as an engine receives it.

    ``block_hashes`` are the chained hashes of the prompt's full blocks, computed once by the
    frontend (``kv.hashing``) and reused here so the engine never hashes the prompt again;
    ``hash_seed`` lets the engine continue the chain over generated tokens.
    """

    request_id: str
    # a list, or an ``array('I')`` (the simulator's synthetic prompts): the compiled engine checks reads
    # against this annotation, so it names what flows (``native.py``)
    prompt_tokens: Sequence[int]
    block_hashes: list[int]
    hash_seed: int
    max_tokens: int
    ignore_eos: bool = False  # traces ask for exactly max_tokens tokens
    priority: int = 0
    arrival: float = 0.0  # set by the engine from ``now`` at add_request
    # Real engines key their own prefix cache on these (``hash_seed`` already carries them for ours).
    cache_salt: str | None = None
    lora_name: str | None = None
    sampling: Sampling | None = None  # real engines sample; the simulated one ignores it
    # A migrated request (``control.migration``): the prompt ends with this many tokens an earlier
    # attempt generated. Real engines need nothing more (greedy decoding continues from the ids);
    # the simulated one continues the original completion at that index.
    resumed: int = 0
    #: the prompt blocks' check hashes (``routing.double_hash`` on; None when off)
    check_hashes: list[int] | None = None
    # Prefill/decode disaggregation (``transfer/``). ``remote_decode``: a prefill-only job: compute the
    # prompt's KV, produce one token, end with ``TokenOutput.kv_transfer`` and keep the blocks for the
    # decode worker to pull. ``kv_from``: the decode side: take the prompt's KV from that transfer
    # instead of computing it (an engine that cannot falls back to computing it).
    remote_decode: bool = False
    kv_from: KvTransfer | None = None
    #: the client's own request, relayed unchanged to an OpenAI-compatible server (``engine: openai``)
    passthrough: Passthrough | None = None
    #: client headers sent on to the engine server (trace context, request id: ``frontend/trace_context.py``)
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True, frozen=True)
class Passthrough:
    """A client's HTTP request as it arrived: ``body`` is POSTed byte for byte to the server's
    ``path`` (``method`` GET: a stored response read or the tokenizer's info, no body; a body that is not
    JSON, the audio paths' forms, has its ``Content-Type`` among the request's headers); its answer comes back in
    :attr:`TokenOutput.raw` (``execution/openai_relay.py``)."""

    path: str  # "/v1/chat/completions", "/v1/completions", MESSAGES_PATH, RESPONSES_PATH, a SERVER_PATHS one...
    body: bytes
    stream: bool
    method: str = "POST"


#: Anthropic's Messages API and OpenAI's Responses API: relayed paths besides the completions
MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
#: vLLM's paths that generate nothing (pooling, scoring, its tokenizer): relayed to a server that serves the model,
#: their JSON answer passed back as it came (``frontend/server_api.py``)
SERVER_PATHS = ("/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize")
#: vLLM's ``GET /tokenizer_info`` (a server started with ``--enable-tokenizer-info-endpoint``): relayed like those
TOKENIZER_INFO_PATH = "/tokenizer_info"
#: vLLM's speech-to-text paths: a multipart form (the audio file and fields), relayed as it came but for its
#: ``model`` field (``frontend/audio_api.py``, ``execution/form_body.py``)
AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
#: a stored response's id as vLLM makes them (``resp_`` + hex); the relayed paths that name one: its read
#: (``GET /v1/responses/{id}``) and its cancel (``POST /v1/responses/{id}/cancel``)
RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: (a streamed read, ``?stream=true[&starting_after=N]``, replays a background response's events: vLLM's query, as
#: the frontend writes it)
STORED_RESPONSE_PATH = re.compile(
    rf"{RESPONSES_PATH}/{RESPONSE_ID.pattern}(?:/cancel|\?stream=true(?:&starting_after=[0-9]{{1,10}})?)?")


@dataclass(slots=True, frozen=True)
class Sampling:
    """Sampling parameters a client asked for, forwarded to engines that sample for real."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass(slots=True, frozen=True)
class PromptLimit:
    """The longest prompt the fleet takes: a longer one is refused up front (HTTP 400), with ``why``
    completing "exceeds the N tokens ..." (the limit's source and the setting behind it)."""

    tokens: int
    why: str
    #: the largest body a relayed request may have (None: no such bound; over NATS its prompt is not sent, its body is)
    body_bytes: int | None = None


class FinishReason(StrEnum):
    """Why a request ended. A ``StrEnum``: it compares equal to, and serialises as, OpenAI's strings."""

    STOP = "stop"  # end of sequence or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled: client gone, stop string matched, worker shutting down
    ERROR = "error"  # failed after it started, or refused as invalid: not retried elsewhere
    UNAVAILABLE = "unavailable"  # the worker could not take it (nothing generated): routed again


@dataclass(slots=True)
class TokenOutput:
    """Tokens a request produced in one engine pass (usually one), stamped with the pass end."""

    request_id: str
    token_ids: list[int]
    time: float
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (max over admissions)
    finished: bool = False
    finish_reason: FinishReason | None = None
    text: str | None = None  # engines that return text (real engines over HTTP) set it; else decoded from ids
    #: on the finished output of a ``remote_decode`` request: where the decode worker pulls the KV from
    kv_transfer: KvTransfer | None = None
    #: a passthrough request's answer bytes, relayed as the server sent them: SSE events (streamed), the
    #: JSON body (not streamed), or the server's error body on an ``ERROR`` finish (its HTTP status in
    #: ``raw_status``)
    raw: bytes | None = None
    raw_status: int = 200
    #: on the first output of a ``kv_from`` request whose worker pulled the KV bytes itself (simulated
    #: workers): how the pull went, or why it failed (then the output is a refusal: the flow falls back)
    kv_pull: KvPull | None = None


@dataclass(slots=True, frozen=True)
class KvPull:
    """A decode worker's pull of a transfer's KV bytes (``execution/kv_bytes.py``), measured by it:
    ``seconds`` is the pull alone (connect to last byte verified), not the prefill before it."""

    cause: str  # "ok", or why it failed (kv_timeout, kv_interrupted, kv_checksum, kv_unreachable, target_full)
    nbytes: int  # payload bytes received (and verified, when ok)
    blocks: int  # blocks whose checksum was verified
    seconds: float


@dataclass(slots=True, frozen=True)
class KvTransfer:
    """A prefill worker's KV, ready for a decode worker to pull (prefill -> transfer -> decode).

    ``engine_params`` is the engine's own transfer object, passed through unchanged as JSON text
    (vLLM: the ``kv_transfer_params`` its prefill response returns, which its decode request must
    carry); simulated engines move ``block_hashes``, and their workers' byte transport puts its
    address here (``execution/kv_bytes_worker.py``)."""

    source_worker: str
    num_tokens: int  # prompt tokens whose KV the source computed (full blocks only are moved)
    block_hashes: tuple[int, ...] = ()
    engine_params: str | None = None


# ---------------------------------------------------------------------------------------------
# Routing (control plane)
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RouteRequest:
    """What the router needs to know about a request: computed once per request."""

    request_id: str
    num_tokens: int
    block_hashes: list[int]
    priority: int = 0
    check_hashes: list[int] | None = None  # the double-hash guard's (None: guard off)
    #: requests the scheduler holds behind this one, per routable worker (its holding queue's
    #: backlog, which waits for the fleet without showing in any engine's ``waiting``)
    held: int = 0
    #: tokens it may generate: a worker that cannot hold ``num_tokens + max_tokens`` is passed over
    max_tokens: int = 0


@dataclass(slots=True)
class WorkerState:
    """A routable worker as the router sees it: its static facts and its last pushed load report
    (handles fold their own in-flight accounting into the report: load counts from dispatch)."""

    worker_id: str
    block_size: int
    max_num_batched_tokens: int
    queue_depth_threshold: int
    load: LoadReport
    role: str = "both"  # prefill | decode | both: prefill workers only run remote prefill jobs
    #: sequences its engine runs at once (0: not said): the scheduler dispatches only into free slots
    max_num_seqs: int = 0
    #: as in :class:`WorkerInfo` (0: no limit known)
    max_seq_tokens: int = 0
    max_prompt_tokens: int = 0
    #: names its server serves (LoRA adapters; an ``engine: openai`` server's models): a request naming one goes
    #: only to workers listing it
    adapters: frozenset[str] = frozenset()

    def holds(self, prompt: int, total: int) -> bool:
        """Can this worker take a ``prompt``-token request that may grow to ``total`` tokens? A
        smaller worker of a mixed fleet would end it unserved (vLLM refuses past its max_model_len)."""
        seq, most = self.max_seq_tokens, self.max_prompt_tokens
        return (not seq or total <= seq) and (not most or prompt <= most)
