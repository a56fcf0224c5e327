"""The relay's SSE reader (``execution/openai_relay.py``): however the server's bytes are cut into
network reads, the client gets the same bytes, only whole events per output, and the same count."""

from __future__ import annotations

import asyncio
import random
import types
from collections.abc import AsyncIterator

from thunderagent.execution.openai_relay import _READERS, Relay
from thunderagent.types import FinishReason, TokenOutput

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
