"""One hop through ThunderAgent: a client's request relayed unchanged to an OpenAI-compatible server.

A request with :attr:`~thunderagent.types.EngineRequest.passthrough` is ``POST``-ed byte for byte to
the server's path (``/v1/chat/completions``, ``/v1/completions``, Anthropic's ``/v1/messages`` or the
Responses API's ``/v1/responses``: each read by its own reader); the answer comes back in
:attr:`TokenOutput.raw <thunderagent.types.TokenOutput.raw>` as the server sent it, so fields
ThunderAgent does not model (tools, logprobs, response formats...) still work end to end:

- **streamed**: one output per server-sent event, its bytes unchanged; the event is read only for
  what the router needs (a token produced, the finish reason, ``usage``); ``data: [DONE]`` is the
  finished output. Servers stream text, not ids: each chunk with content counts one token (id
  ``-1``; ``usage.completion_tokens`` at the end tops the count up), and a request whose stream
  breaks cannot be continued elsewhere (``control.migration`` refuses streams without ids): it ends
  ``ERROR`` and the client gets an error event;
- **not streamed**: the whole JSON body in one finished output;
- **refused** (non-200): ``UNAVAILABLE`` for a 5xx (routed again to another server), ``ERROR`` for a
  4xx, with the server's body and status in ``raw`` / ``raw_status`` for the frontend to pass on.

The in-flight accounting is the :class:`~thunderagent.execution.engine_requests.RequestStreamer`'s,
with one difference: a relayed request counts as running from the moment it is sent (the server's
queue is invisible from outside, and a non-streamed answer's first byte is its last), see
:meth:`OpenAIWorker.load <thunderagent.execution.openai.OpenAIWorker.load>`. A request the server did
not take (refused connection, reset, 5xx) ends ``UNAVAILABLE`` and is routed again.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from thunderagent.execution.http_transport import TransportConnectionError, TransportError
from thunderagent.execution.relay_body import engine_body, form_body
from thunderagent.types import (
    AUDIO_PATHS,
    MESSAGES_PATH,
    RESPONSES_PATH,
    SERVER_PATHS,
    STORED_RESPONSE_PATH,
    TOKENIZER_INFO_PATH,
    FinishReason,
    Passthrough,
    TokenOutput,
)

if TYPE_CHECKING:
    from thunderagent.execution.engine_requests import Inflight, RequestStreamer

log = logging.getLogger(__name__)

_REASONS = frozenset(r.value for r in FinishReason)
_DONE = b"[DONE]"
_NO_IDS: list[int] = []  # shared: outputs without tokens never mutate their list (Fleet.outputs reads it)
_ONE = [-1]  # shared too: one produced token of unknown id (read only, like _NO_IDS)


# Typed, lenient decoders: only the fields the router reads; anything else in a chunk is skipped
# unparsed (msgspec ignores unknown fields of a Struct), which keeps a relayed event cheap.
class _Delta(msgspec.Struct):
    content: Any = None
    reasoning_content: Any = None
    tool_calls: Any = None


class _Choice(msgspec.Struct):
    text: Any = None
    delta: _Delta | None = None
    message: Any = None
    finish_reason: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_chunk = msgspec.json.Decoder(_Chunk)


def _has_token(c: _Choice) -> bool:
    d = c.delta
    if d is not None:
        return bool(d.content or d.reasoning_content or d.tool_calls)
    return bool(c.text)


class _Read:
    """What a relayed answer's events told so far (one per request)."""

    __slots__ = ("cached", "end", "error", "reason", "reported", "tokens")

    def __init__(self) -> None:
        self.reason: FinishReason | None = None
        self.cached = 0  # prompt tokens the server found in its cache
        self.reported: int | None = None  # completion tokens, as the server's usage says
        self.tokens = 0  # produced in the event being read (streams) or in all (whole answers)
        self.end = False  # the stream's last event
        self.error: Any = None  # the server reported a failure in the stream


class _Reader(Protocol):
    def event(self, data: bytes, st: _Read) -> None: ...
    def whole(self, body: bytes, st: _Read) -> None: ...


class _OpenAIReader:
    """OpenAI's chat / text completions: ``data:`` chunks with ``choices``, ended by ``data: [DONE]``."""

    @staticmethod
    def event(data: bytes, st: _Read) -> None:
        if data == _DONE:
            st.end = True
            return
        chunk = _chunk.decode(data)
        if chunk.error is not None:
            st.error = chunk.error
            return
        for c in chunk.choices or ():
            if _has_token(c):
                st.tokens += 1
            if c.finish_reason is not None:
                st.reason = FinishReason(c.finish_reason) if c.finish_reason in _REASONS else FinishReason.STOP
        if chunk.usage is not None:
            st.reported = chunk.usage.completion_tokens
            st.cached = _cached(chunk.usage)

    @staticmethod
    def whole(body: bytes, st: _Read) -> None:
        try:
            chunk = _chunk.decode(body)
        except msgspec.DecodeError:
            return  # not ours to judge: the client gets the server's bytes
        usage = chunk.usage
        st.reported = (usage.completion_tokens or 0) if usage is not None else 0
        st.cached = _cached(usage)
        if chunk.choices and chunk.choices[0].finish_reason in _REASONS:
            st.reason = FinishReason(chunk.choices[0].finish_reason)


# Anthropic's Messages API (``/v1/messages``): typed, lenient, as above.
class _AnthropicDelta(msgspec.Struct):
    text: Any = None
    thinking: Any = None
    partial_json: Any = None
    stop_reason: str | None = None


class _AnthropicUsage(msgspec.Struct):
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class _AnthropicMessage(msgspec.Struct):
    stop_reason: str | None = None
    usage: _AnthropicUsage | None = None


class _AnthropicEvent(msgspec.Struct):
    type: str = ""
    delta: _AnthropicDelta | None = None
    usage: _AnthropicUsage | None = None
    message: _AnthropicMessage | None = None
    error: Any = None


_anthropic_event = msgspec.json.Decoder(_AnthropicEvent)
_anthropic_message = msgspec.json.Decoder(_AnthropicMessage)


def _anthropic_reason(stop_reason: str | None) -> FinishReason:
    """``max_tokens`` is a length end; ``end_turn``, ``stop_sequence`` and ``tool_use`` are stops."""
    return FinishReason.LENGTH if stop_reason == "max_tokens" else FinishReason.STOP


def _anthropic_usage(usage: _AnthropicUsage | None, st: _Read) -> None:
    if usage is not None:
        if usage.output_tokens is not None:
            st.reported = usage.output_tokens
        if usage.cache_read_input_tokens is not None:
            st.cached = usage.cache_read_input_tokens


class _AnthropicReader:
    """Events ``message_start``, ``content_block_*`` (text, thinking and tool-input deltas: one token each),
    ``message_delta`` (the stop reason, usage), ``message_stop`` (the end), ``error``."""

    @staticmethod
    def event(data: bytes, st: _Read) -> None:
        ev = _anthropic_event.decode(data)
        kind = ev.type
        if kind == "content_block_delta":
            d = ev.delta
            if d is not None and (d.text or d.thinking or d.partial_json):
                st.tokens += 1
        elif kind == "message_delta":
            if ev.delta is not None and ev.delta.stop_reason is not None:
                st.reason = _anthropic_reason(ev.delta.stop_reason)
            _anthropic_usage(ev.usage, st)
        elif kind == "message_start":
            _anthropic_usage(ev.message.usage if ev.message is not None else None, st)
        elif kind == "message_stop":
            st.end = True
            st.reason = st.reason or FinishReason.STOP
        elif kind == "error":
            st.error = ev.error or "error event"

    @staticmethod
    def whole(body: bytes, st: _Read) -> None:
        try:
            msg = _anthropic_message.decode(body)
        except msgspec.DecodeError:
            return
        st.reported = 0
        _anthropic_usage(msg.usage, st)
        st.reason = _anthropic_reason(msg.stop_reason)


# OpenAI's Responses API (``/v1/responses``): typed, lenient, as above.
class _ResponsesDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _ResponsesUsage(msgspec.Struct):
    output_tokens: int | None = None
    input_tokens_details: _ResponsesDetails | None = None


class _Incomplete(msgspec.Struct):
    reason: str | None = None


class _Response(msgspec.Struct):
    status: str | None = None
    incomplete_details: _Incomplete | None = None
    usage: _ResponsesUsage | None = None


class _ResponsesEvent(msgspec.Struct):
    type: str = ""
    delta: Any = None
    response: _Response | None = None


_responses_event = msgspec.json.Decoder(_ResponsesEvent)
_response = msgspec.json.Decoder(_Response)
#: the events that carry produced text, reasoning or tool-call arguments (one token each)
_DELTAS = frozenset({"response.output_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_summary_text.delta", "response.function_call_arguments.delta",
                     "response.custom_tool_call_input.delta", "response.refusal.delta"})
_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _response_end(resp: _Response | None, st: _Read) -> None:
    if resp is None:
        st.reason = FinishReason.STOP
        return
    incomplete = resp.incomplete_details
    st.reason = FinishReason.LENGTH if incomplete is not None and incomplete.reason == "max_output_tokens" \
        else FinishReason.STOP
    usage = resp.usage
    if usage is not None:
        st.reported = usage.output_tokens
        details = usage.input_tokens_details
        st.cached = (details.cached_tokens or 0) if details is not None else 0


class _ResponsesReader:
    """Events ``response.*``: the deltas (one token each), ``response.completed`` / ``incomplete`` (the end, its
    usage; ``max_output_tokens`` is a length end), ``response.failed`` and ``error`` (failures)."""

    @staticmethod
    def event(data: bytes, st: _Read) -> None:
        ev = _responses_event.decode(data)
        kind = ev.type
        if kind in _DELTAS:
            if ev.delta:
                st.tokens += 1
        elif kind in _ENDS:
            if kind == "response.failed":
                st.error = "response.failed"
                return
            _response_end(ev.response, st)
            st.end = True
        elif kind == "error":
            st.error = data

    @staticmethod
    def whole(body: bytes, st: _Read) -> None:
        try:
            resp = _response.decode(body)
        except msgspec.DecodeError:
            return
        st.reported = 0
        _response_end(resp, st)


class _PlainReader:
    """An answer that generates nothing (embeddings, scores, tokenization, a stored response read): one JSON
    body, no tokens; an event stream is not relayed on these paths (the frontend refuses ``stream``)."""

    @staticmethod
    def event(data: bytes, st: _Read) -> None:  # (never called: these are sent unstreamed, read whole)
        st.end = True
        st.reason = FinishReason.STOP

    @staticmethod
    def whole(body: bytes, st: _Read) -> None:
        st.reported = 0
        st.reason = FinishReason.STOP


_PLAIN = _PlainReader()
#: how each relayed path's answer reads; a path not here is refused (only these are served)
_READERS: dict[str, _Reader] = {"/v1/chat/completions": _OpenAIReader(), "/v1/completions": _OpenAIReader(),
                                MESSAGES_PATH: _AnthropicReader(), RESPONSES_PATH: _ResponsesReader(),
                                **dict.fromkeys(SERVER_PATHS, _PLAIN)}


def _reader(pt: Passthrough) -> _Reader | None:
    """The reader of a relayed request's answer; None for a request no server is sent: a path not served, a GET of
    anything but a stored response or the tokenizer's info, a POST to a stored response but its cancel, either with
    a body; a stream only as the streamed read of one (its events replayed: the Responses API's reader) or a
    transcription's (OpenAI's chunks)."""
    if pt.path == TOKENIZER_INFO_PATH:
        return _PLAIN if pt.method == "GET" and not pt.body and not pt.stream else None
    if pt.path in AUDIO_PATHS:
        return None if pt.method != "POST" else _READERS["/v1/completions"] if pt.stream else _PLAIN
    if pt.method == "GET" or STORED_RESPONSE_PATH.fullmatch(pt.path):
        ok = STORED_RESPONSE_PATH.fullmatch(pt.path) and pt.path.endswith("/cancel") == (pt.method == "POST")
        if not ok or pt.body or pt.stream != ("?stream=true" in pt.path):
            return None
        return _READERS[RESPONSES_PATH] if pt.stream else _PLAIN
    return _READERS.get(pt.path) if pt.method == "POST" else None


class Relay:
    """The passthrough side of one server's :class:`RequestStreamer` (its ``relay``). ``rewrite``: a vLLM /
    SGLang server's, whose body gets the server's model name and ThunderAgent's fields as the token path
    sends them (``execution/relay_body.py``); an ``engine: openai`` server gets the client's bytes."""

    def __init__(self, streamer: RequestStreamer, *, rewrite: bool = False) -> None:
        self._s = streamer
        self._rewrite = rewrite

    async def __call__(self, r: Inflight) -> None:
        s = self._s
        pt = r.req.passthrough
        assert pt is not None, "only passthrough requests are relayed"
        # No queue of the server's is visible from outside (a non-streamed answer's first byte is its
        # last): a request sent counts as running at once; OpenAIWorker.load caps that at the node's
        # max_batch_size and adds what the server's /metrics say waits there.
        read = _reader(pt)
        if read is None:  # a frontend's mistake (or a forged request over the bus): nothing else is served
            self._finish(r, _NO_IDS, FinishReason.ERROR, 0, b'{"error": {"message": "not a relayed path"}}', 400)
            return
        s._progress(r, 0)
        try:
            body = pt.body
            if self._rewrite and pt.path in AUDIO_PATHS:  # a form: only its model named the server's way
                body = form_body(body, r.req, await s._served_model())
            elif self._rewrite and body:  # (the Messages API has no priority field; a stored response's has no body)
                body = engine_body(body, r.req, await s._served_model(),
                                   send_priority=s.send_priority and pt.path != MESSAGES_PATH)
            url = s.url + pt.path
            async with (s._transport.stream_get(url) if pt.method == "GET"
                        else s._transport.stream_post(url, body, r.req.headers)) as resp:
                if resp.status != 200:
                    body = (await resp.text()).encode()
                    log.warning("%s refused request %s: HTTP %d %s", s.worker_id, r.req.request_id, resp.status,
                                body[:300])
                    reason = FinishReason.UNAVAILABLE if resp.status >= 500 else FinishReason.ERROR
                    self._finish(r, _NO_IDS, reason, 0, body, resp.status)
                    return
                r.queue.accepted = True
                if pt.stream:
                    await self._stream(resp.chunks(), r, read)
                else:
                    await self._whole(resp.chunks(), r, read)
        except (TransportError, TimeoutError) as exc:
            if r.queue.accepted:
                raise  # lost after the server took it: the streamer ends it ERROR
            # not taken (refused, reset, unreachable): UNAVAILABLE, the fleet routes it again
            if isinstance(exc, TransportConnectionError) and not isinstance(exc, TimeoutError):
                s._on_lost(f"request {r.req.request_id} failed: {exc!r}")
            else:
                log.warning("%s: request %s failed: %r", s.worker_id, r.req.request_id, exc)
            self._finish(r, _NO_IDS, FinishReason.UNAVAILABLE, 0, None)

    def _finish(self, r: Inflight, ids: list[int], reason: FinishReason, cached: int, raw: bytes | None,
                status: int = 200) -> None:
        s = self._s
        r.queue.put_output(TokenOutput(r.req.request_id, ids, s._loop_time(), len(r.req.prompt_tokens), cached,
                                       True, reason, "", raw=raw, raw_status=status), s._clock())

    async def _whole(self, chunks: AsyncIterable[bytes], r: Inflight, read: _Reader) -> None:
        body = b"".join([c async for c in chunks])
        st = _Read()
        read.whole(body, st)
        self._s._progress(r, 0)
        self._finish(r, [-1] * (st.reported or 0), st.reason or FinishReason.STOP, st.cached, body)

    async def _stream(self, chunks: AsyncIterable[bytes], r: Inflight, read: _Reader) -> None:
        """Relay the server's events; all complete events of one network read go out as one output
        (fewer queue hops and socket writes when a server writes faster than we relay)."""
        s = self._s
        rid, n_prompt, clock, queue = r.req.request_id, len(r.req.prompt_tokens), s._clock, r.queue
        st = _Read()  # st.tokens: of the event being read
        event = read.event  # (bound once: called per event)
        counted = 0
        ready = 0  # tokens of the complete events not relayed yet
        buf = b""
        scan = 0  # buf is parsed up to here (complete lines)
        async for piece in chunks:
            buf = buf + piece if buf else piece
            cut = 0  # end of the last complete event in buf
            last = buf.rfind(b"\n")
            if last < scan:
                continue
            # the complete lines, split at once (one C call, not a find per line); scan follows them
            for line in buf[scan:last].split(b"\n"):
                scan += len(line) + 1
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    event(data, st)
                    if st.error is not None:
                        log.warning("%s: request %s failed in the server: %s", s.worker_id, rid, st.error)
                        self._finish(r, _NO_IDS, FinishReason.ERROR, 0, data, 500)
                        return
                    if st.end:  # the event's blank line is not waited for: the socket may stay open
                        self._done(r, st.reason, st.cached,
                                   ready + max(st.tokens, (st.reported or 0) - counted - ready), buf[:scan] + b"\n")
                        return
                elif not line.strip():  # a blank line ends an event (comments, "event:", "id:" ride along)
                    cut = scan
                    ready += st.tokens
                    st.tokens = 0
            if cut:
                s._progress(r, ready)
                counted += ready
                ids = _NO_IDS if not ready else _ONE if ready == 1 else [-1] * ready
                queue.put_output(TokenOutput(rid, ids, s._loop_time(), n_prompt, 0, text="", raw=buf[:cut]), clock())
                buf, scan, ready = buf[cut:], scan - cut, 0
        if st.reason is not None:  # a server that ends its stream without [DONE] (older llama.cpp)
            self._done(r, st.reason, st.cached, max(st.tokens, (st.reported or 0) - counted), buf)
            return
        log.warning("%s: stream of request %s ended without a finish reason", s.worker_id, rid)
        s._end(r, FinishReason.ERROR if r.started else FinishReason.UNAVAILABLE)

    def _done(self, r: Inflight, reason: FinishReason | None, cached: int, top_up: int, raw: bytes) -> None:
        self._s._progress(r, top_up)
        self._finish(r, [-1] * top_up, reason or FinishReason.STOP, cached, raw)


def _cached(usage: _Usage | None) -> int:
    if usage is None or usage.prompt_tokens_details is None:
        return 0
    return usage.prompt_tokens_details.cached_tokens or 0
