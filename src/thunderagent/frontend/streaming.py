"""A request's outputs as text: detokenized, with stop strings applied (the frontend's side)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from thunderagent.frontend.stops import StopMatcher
from thunderagent.frontend.tokenizer import StreamDecoder
from thunderagent.types import FinishReason, TokenOutput


@dataclass(slots=True)
class TextChunk:
    text: str
    finish_reason: FinishReason | None
    completion_tokens: int
    cached_tokens: int


async def stream_text(
    outputs: AsyncIterator[TokenOutput], decoder: StreamDecoder, stops: list[str]
) -> AsyncIterator[TextChunk]:
    """Text chunks of ``outputs`` (the fleet's stream of one request), the last one with its finish
    reason. A matched stop string ends the stream with ``stop``; closing ``outputs`` early aborts the
    request (the fleet does that), so this generator closes it in every case."""
    matcher = StopMatcher(stops)
    completion = 0
    cached = 0
    # While the engine's text is used: every completion id so far and how many characters of text
    # the engine sent for them. Should its text stop mid-stream (a migrated request:
    # ``control.migration.settle``), the decoder decodes the completion again from its first id
    # (once, at the cut) and the first ``skip`` characters it yields, the engine's, are dropped: what
    # the engine held back (an incomplete character) comes out, nothing is lost or repeated. Only the
    # whole completion is a safe start: one engine chunk can carry several tokens, its text ending
    # before its last token's bytes (held back) or starting inside a character, so no chunk boundary
    # is known to be a character boundary (priming with the last chunk repeated its text: seen on vLLM
    # under load, in about one cut in three when replayed offline with chunks of 1-5 tokens).
    engine_text = False
    replay: list[int] | None = []  # None once the frontend decodes
    skip = 0
    try:
        async for out in outputs:
            cached = max(cached, out.cached_tokens)
            completion += len(out.token_ids)
            if out.text is not None and replay is not None:
                engine_text = True
                replay += out.token_ids
                skip += len(out.text)
                raw = out.text
            else:
                if replay:
                    raw = decoder.feed(replay + out.token_ids)
                else:
                    raw = decoder.feed(out.token_ids)
                replay = None
                if skip:
                    n = min(skip, len(raw))
                    raw, skip = raw[n:], skip - n
            text = matcher.feed(raw)
            if matcher.stopped:
                yield TextChunk(text, FinishReason.STOP, completion, cached)
                return
            if out.finished:
                # an engine's detokenizer drops an incomplete character at the end (vLLM): so does a
                # stream whose text came from the engine, even after a migration
                if not engine_text:
                    text += matcher.feed(decoder.flush())
                if matcher.stopped:
                    yield TextChunk(text, FinishReason.STOP, completion, cached)
                    return
                text += matcher.flush()
                yield TextChunk(text, out.finish_reason or FinishReason.STOP, completion, cached)
                return
            if text:
                yield TextChunk(text, None, completion, cached)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
