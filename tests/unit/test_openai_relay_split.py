"""The relay's SSE reader (``execution/openai_relay.py``): however the server's bytes are cut into
network reads, the client gets the same bytes, only whole events per output, and the same count."""

from __future__ import annotations

import asyncio
import random
import types
from collections.abc import AsyncIterator

from thunderagent.execution.openai_relay import _PLAIN, _READERS, Relay, _Read, _reader
from thunderagent.types import SERVER_PATHS, FinishReason, Passthrough, TokenOutput

EVENTS = [
    b": keep-alive comment\r\n\r\n",
    b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\r\n\r\n',
    b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"index":0,"text":"c","finish_reason":"length"}]}\n\n',
    b'data: {"choices":[],"usage":{"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":3}}}\n\n',
    b"data: [DONE]\n\n",
]
BODY = b"".join(EVENTS)


class _Streamer:
    worker_id = "w0"

    def __init__(self) -> None:
        self.progress: list[int] = []

    def _clock(self) -> float:
        return 0.0

    def _loop_time(self) -> float:
        return 0.0

    def _progress(self, r: object, n: int) -> None:
        self.progress.append(n)


def _relay(pieces: list[bytes], path: str = "/v1/chat/completions") -> tuple[list[TokenOutput], list[int]]:
    outs: list[TokenOutput] = []
    queue = types.SimpleNamespace(put_output=lambda out, now: outs.append(out))
    r = types.SimpleNamespace(req=types.SimpleNamespace(request_id="r1", prompt_tokens=[1, 2, 3]), queue=queue,
                              started=True)
    streamer = _Streamer()

    async def reads() -> AsyncIterator[bytes]:
        for p in pieces:
            yield p

    asyncio.run(Relay(streamer)._stream(reads(), r, _READERS[path]))  # type: ignore[arg-type]
    return outs, streamer.progress


def test_one_read_is_one_finished_output_with_every_byte() -> None:
    outs, progress = _relay([BODY])
    assert [o.finished for o in outs] == [True]
    assert outs[0].raw == BODY and outs[0].finish_reason == FinishReason.LENGTH and outs[0].cached_tokens == 3
    assert sum(progress) == 4  # 3 chunks with text, topped up to usage.completion_tokens (4)


def test_any_cuts_give_the_same_bytes_whole_events_and_count() -> None:
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(BODY)), rng.randint(1, 12)))
        pieces = [BODY[a:b] for a, b in zip([0, *cuts], [*cuts, len(BODY)])]
        outs, progress = _relay(pieces)
        assert b"".join(o.raw or b"" for o in outs) == BODY, cuts
        assert all(o.raw is not None and o.raw.endswith((b"\n\n", b"\r\n\r\n")) for o in outs), cuts  # whole events
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].finish_reason == FinishReason.LENGTH and outs[-1].cached_tokens == 3
        assert sum(progress) == 4


# Anthropic's Messages API (/v1/messages): named events, ended by message_stop (no [DONE])
A_EVENTS = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":'
    b'{"input_tokens":5,"output_tokens":0,"cache_read_input_tokens":32}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"text"}}\n\n',
    b'event: ping\ndata: {"type":"ping"}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"a"}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":""}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
    b'"delta":{"type":"input_json_delta","partial_json":"{}"}}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
    b'"usage":{"output_tokens":3,"cache_read_input_tokens":48}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]
A_BODY = b"".join(A_EVENTS)


def test_anthropic_streams_read_alike_under_any_cuts() -> None:
    rng = random.Random(11)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(A_BODY)), rng.randint(0, 10)))
        pieces = [A_BODY[a:b] for a, b in zip([0, *cuts], [*cuts, len(A_BODY)])]
        outs, progress = _relay(pieces, "/v1/messages")
        assert b"".join(o.raw or b"" for o in outs) == A_BODY, cuts
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].finish_reason == FinishReason.LENGTH and outs[-1].cached_tokens == 48
        assert sum(progress) == 3  # two deltas with content, topped up to usage.output_tokens


def test_an_anthropic_error_event_fails_the_request() -> None:
    body = A_EVENTS[0] + b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"x"}}\n\n'
    outs, _ = _relay([body], "/v1/messages")
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.ERROR


def test_a_whole_anthropic_message_is_read_for_its_end_and_usage() -> None:
    from thunderagent.execution.openai_relay import _Read

    st = _Read()
    _READERS["/v1/messages"].whole(b'{"type":"message","stop_reason":"tool_use","usage":{"input_tokens":1,'
                                   b'"output_tokens":7,"cache_read_input_tokens":16}}', st)
    assert (st.reason, st.reported, st.cached) == (FinishReason.STOP, 7, 16)
    st = _Read()
    _READERS["/v1/messages"].whole(b"not json", st)  # the client gets the bytes; nothing counted
    assert (st.reason, st.reported) == (None, None)


def test_only_the_served_paths_and_methods_are_relayed() -> None:
    """A worker relays what a frontend may send, nothing else (a forged request over the bus included): vLLM's
    paths that generate nothing as POSTs, a stored response's read as a GET and its cancel as a POST, both without
    a body, its id one path segment."""
    for path in SERVER_PATHS:
        assert _reader(Passthrough(path, b"{}", False)) is _PLAIN
        assert _reader(Passthrough(path, b"", False, "GET")) is None
    assert _reader(Passthrough("/v1/responses/resp_1", b"", False, "GET")) is _PLAIN
    assert _reader(Passthrough("/v1/responses/resp_1/cancel", b"", False)) is _PLAIN
    # a background response's events replayed: a streamed read, read as the Responses API's stream
    for streamed in ("/v1/responses/resp_1?stream=true", "/v1/responses/resp_1?stream=true&starting_after=12"):
        assert _reader(Passthrough(streamed, b"", True, "GET")) is _READERS["/v1/responses"]
    for refused in (Passthrough("/v1/responses/resp_1", b"", False),  # (a POST there is not vLLM's)
                    Passthrough("/v1/responses/resp_1?stream=true", b"", False, "GET"),  # streamed, not read so
                    Passthrough("/v1/responses/resp_1?stream=true", b"", True),  # a POST
                    Passthrough("/v1/responses/resp_1?starting_after=1", b"", True, "GET"),
                    Passthrough("/v1/responses/resp_1?stream=true&x=1", b"", True, "GET"),
                    Passthrough("/v1/responses/resp_1/cancel?stream=true", b"", True, "GET"),
                    Passthrough("/v1/responses/resp_1/cancel", b"", False, "GET"),
                    Passthrough("/v1/responses/resp_1", b"{}", False, "GET"),  # a body on a read
                    Passthrough("/v1/responses/resp_1", b"", True, "GET"),  # a stream
                    Passthrough("/v1/responses/../sleep", b"", False, "GET"),
                    Passthrough("/v1/responses/a/b", b"", False, "GET"),
                    Passthrough("/v1/responses", b"", False, "GET"),
                    Passthrough("/metrics", b"", False, "GET"),
                    Passthrough("/sleep", b"{}", False),
                    Passthrough("/v1/chat/completions", b"{}", False, "DELETE")):
        assert _reader(refused) is None, refused
    assert _reader(Passthrough("/v1/chat/completions", b"{}", True)) is _READERS["/v1/chat/completions"]


def test_an_answer_that_generates_nothing_ends_with_no_tokens() -> None:
    st = _Read()
    _PLAIN.whole(b'{"object": "list", "data": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}', st)
    assert (st.reported, st.reason, st.cached) == (0, FinishReason.STOP, 0)
