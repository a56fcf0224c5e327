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
    # While the engine's text is used: the ids of the last step that emitted text (the engine
    # detokenizer's window) and those after it, whose text it holds back (an incomplete character).
    # Should its text stop mid-stream (a migrated request: ``control.migration.settle``), the decoder
    # goes on from there, so no character is lost or repeated at the cut.
    engine_text = False
    window: list[int] = []
    held: list[int] = []
    try:
        async for out in outputs:
            cached = max(cached, out.cached_tokens)
            completion += len(out.token_ids)
            if out.text is not None:
                engine_text = True
                held += out.token_ids
                if out.text:
                    window, held = held, []
                raw = out.text
            else:
                raw = ""
                if window or held:
                    decoder.feed(window)
                    raw = decoder.feed(held)  # "" unless the engine held back more than needed
                    window, held = [], []
                raw += decoder.feed(out.token_ids)
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
