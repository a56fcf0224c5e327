"""The answer to a request that vLLM's ``/abort_requests`` ended while ThunderAgent held it (no worker had started
it: ``control/generation.abort_held``).

vLLM ends a request it aborts while the request waits in its own queue with a normal answer: nothing generated,
``finish_reason: "abort"`` (its output processor's final output), which an RL rollout client reads as "resend after
the weight update". A held request is in the same place, one queue earlier, so chat and completion requests (on the
token path or relayed) get that answer, JSON or streamed as asked, in the shape this frontend gives every answer.
The other relayed APIs (Messages, Responses, pooling, speech) end with a 503 ``request_aborted`` in their own error
shape (the error middleware's): their servers' abort answers differ per API and are not modelled here.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

_enc = msgspec.json.Encoder()
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
#: the relayed paths answered with ``finish_reason: abort`` (the others: an error)
ABORT_ANSWERED = {"/v1/chat/completions": True, "/v1/completions": False}  # path -> chat?


def aborted_answer(chat: bool, stream: bool, model: str, request_id: str, prompt_tokens: int,
                   usage_chunk: bool, headers: dict[str, str] | None = None) -> web.Response:
    """A chat (``chat``) or completion answer with no output and ``finish_reason: abort``; streamed as events
    (the role, the finish, the usage when ``usage_chunk``, ``[DONE]``) when ``stream``."""
    cid = ("chatcmpl-" if chat else "cmpl-") + request_id
    created = int(time.time())
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    if not stream:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "abort", "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": ""}} if chat else {"text": ""})
        body = {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": usage}
        return web.Response(body=_enc.encode(body), content_type="application/json", headers=headers)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + _enc.encode({"id": cid, "object": obj, "created": created, "model": model,
                                        "choices": choices, **extra}) + b"\n\n"

    events = []
    if chat:
        events.append(event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}]))
        events.append(event([{"index": 0, "delta": {}, "finish_reason": "abort", "logprobs": None}]))
    else:
        events.append(event([{"index": 0, "text": "", "finish_reason": "abort", "logprobs": None}]))
    if usage_chunk:
        events.append(event([], usage=usage))
    events.append(b"data: [DONE]\n\n")
    return web.Response(body=b"".join(events), headers={**_SSE_HEADERS, **(headers or {})})
