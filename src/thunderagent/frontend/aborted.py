"""The answer to a request that vLLM's ``/abort_requests`` ended while ThunderAgent held it (no worker had started
it: ``control/generation.abort_held``).

vLLM ends a request it aborts while the request waits in its own queue with a normal answer: nothing generated,
``finish_reason: "abort"`` (its output processor's final output), which an RL rollout client reads as "resend after
the weight update"; streamed, no chunk carries that reason (vLLM drops chunks without tokens). A held request is in
the same place, one queue earlier, so chat and completion requests (on the token path or relayed) get that answer,
JSON or streamed as asked, so that a client reads the same whichever queue held its request (checked against a real
server: ``tests/engines/test_real_vllm_admin.py``).
Anthropic's Messages API gets what vLLM's conversion of that chat answer gives (``entrypoints/anthropic/serving.py``):
one empty text block and no ``stop_reason`` (vLLM maps ``abort`` to none), streamed as ``message_start``, a
``message_delta`` with ``end_turn`` (the stream carries no finish reason) and the usage, ``message_stop``. The
other relayed APIs (Responses, pooling, speech) end with a 503 ``request_aborted`` in their own error shape (the
error middleware's): vLLM's Responses API reports such a request ``completed`` with empty output (its status is a
work in progress there), which a client cannot tell from a real answer, and its pooling paths have no abort answer.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from thunderagent.types import MESSAGES_PATH

_enc = msgspec.json.Encoder()
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
#: the relayed OpenAI paths answered with ``finish_reason: abort`` (path -> chat?)
_ABORT_ANSWERED = {"/v1/chat/completions": True, "/v1/completions": False}


def relayed_aborted_answer(path: str, stream: bool, model: str, request_id: str, prompt_tokens: int,
                           usage_chunk: bool, headers: dict[str, str] | None = None) -> web.Response | None:
    """The answer to a relayed request held when ``/abort_requests`` ended it, by its API's ``path``: vLLM's
    (:func:`aborted_answer`, :func:`messages_aborted_answer`), or None for an API without one (its 503)."""
    if path == MESSAGES_PATH:
        return messages_aborted_answer(stream, model, request_id, prompt_tokens, headers)
    if path not in _ABORT_ANSWERED:
        return None
    return aborted_answer(_ABORT_ANSWERED[path], stream, model, request_id, prompt_tokens, usage_chunk, headers)


def aborted_answer(chat: bool, stream: bool, model: str, request_id: str, prompt_tokens: int,
                   usage_chunk: bool, headers: dict[str, str] | None = None, relayed: bool = True) -> web.Response:
    """A chat (``chat``) or completion answer with no output and ``finish_reason: abort``; streamed (``stream``),
    vLLM's events for it: the role (chat), the usage when ``usage_chunk``, ``[DONE]``; on the token path (not
    ``relayed``), where this frontend writes the answers, its stream of a request the server aborted: with a chunk
    that says ``abort``."""
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

    # streamed, vLLM sends no chunk for an output without tokens, the aborted one's too ("don't return empty
    # chunks"): a chat stream is its role chunk, a completion stream nothing, then the usage if asked
    events = []
    if chat:
        events.append(event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}]))
    if not relayed:
        events.append(event([{"index": 0, "delta": {}, "finish_reason": "abort", "logprobs": None} if chat else
                             {"index": 0, "text": "", "finish_reason": "abort", "logprobs": None}]))
    if usage_chunk:
        events.append(event([], usage=usage))
    events.append(b"data: [DONE]\n\n")
    return web.Response(body=b"".join(events), headers={**_SSE_HEADERS, **(headers or {})})


def messages_aborted_answer(stream: bool, model: str, request_id: str, prompt_tokens: int,
                            headers: dict[str, str] | None = None) -> web.Response:
    """Anthropic's Messages API's answer to a request aborted before its first token, as vLLM gives it (checked
    against a real server: ``tests/engines/test_real_vllm_admin.py``): the id of its chat request, one empty text
    block, no stop reason (``exclude_none``: absent), usage with no cache read or written (vLLM states those with
    its ``--enable-prompt-tokens-details``, Anthropic's API always); streamed, ``message_start``, a
    ``message_delta`` and ``message_stop``."""
    mid = "chatcmpl-" + request_id
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0}
    if not stream:
        body = {"id": mid, "type": "message", "role": "assistant", "content": [{"type": "text", "text": ""}],
                "model": model, "usage": usage}
        return web.Response(body=_enc.encode(body), content_type="application/json", headers=headers)

    def event(name: str, data: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + _enc.encode(data) + b"\n\n"

    # (streamed, vLLM's first event has the first chunk's usage, no cache fields; its stream of an aborted request
    # carries no finish reason, which its Messages conversion reads as a natural end: "end_turn")
    start = {"id": mid, "type": "message", "role": "assistant", "content": [], "model": model, "stop_reason": None,
             "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    events = (event("message_start", {"type": "message_start", "message": start}),
              event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                                         "stop_sequence": None}, "usage": usage}),
              event("message_stop", {"type": "message_stop"}))
    return web.Response(body=b"".join(events), headers={**_SSE_HEADERS, **(headers or {})})
