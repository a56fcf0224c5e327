"""OpenAI's Responses API (``POST /v1/responses``, what Codex and the Agents SDK speak) as vLLM renders it.

vLLM serves ``/v1/responses`` by building chat messages from the request and rendering them with the model's
template. ThunderAgent relays the client's body to the server the router picks (``frontend/responses_api.py``)
and, to route it on the blocks that server will cache, builds the same messages the way vLLM 0.32 does for
a model without Harmony (``vllm/entrypoints/openai/responses/utils.py``) before rendering them
(``Tokenizer.apply_openai_chat``):

- ``instructions`` is the first system message; a string ``input`` one user message;
- of a list ``input``: messages (``{role, content}``, content parts ``input_text`` / ``output_text`` read as
  text) as they are; an assistant ``message`` item's first text part as the assistant's content; a
  ``function_call`` item as a tool call (``call_id``, ``name``, ``arguments``), merged into the assistant
  message before it; a ``reasoning`` item's first content text (else its first summary text) as that
  message's reasoning; a ``function_call_output`` item as a ``tool`` message;
- function ``tools`` as chat function tools (other tool kinds are not rendered);
- ``reasoning.effort`` as the template's ``reasoning_effort``; a last message or reasoning item with status
  ``in_progress`` / ``incomplete`` is continued (``continue_final_message``) instead of answered.

A mismatch costs cache hits, never correctness: the server renders what it serves. ``previous_response_id``
continues a conversation the server stored: it goes to the worker that answered that response (its history
is there, not here). So does a ``background`` response's read (``frontend/responses_api.py``).
"""

from __future__ import annotations

from typing import Any

from thunderagent.frontend.protocol import RequestError
from thunderagent.frontend.relay_fields import refuse

#: vLLM 0.32's ResponsesRequest fields, the Responses API's fields it ignores, ThunderAgent's own
FIELDS = frozenset({
    "background", "cache_salt", "chat_template_kwargs", "enable_response_messages", "frequency_penalty",
    "ignore_eos", "include", "include_reasoning", "include_stop_str_in_output", "input", "instructions",
    "logit_bias", "max_output_tokens", "max_tool_calls", "media_io_kwargs", "metadata", "min_p", "mm_payload",
    "mm_processor_kwargs", "model", "parallel_tool_calls", "presence_penalty", "previous_response_id",
    "priority", "prompt", "prompt_cache_key", "reasoning", "repetition_penalty", "return_mm_kwargs", "seed",
    "service_tier", "session_id", "skip_special_tokens", "stop", "stop_token_ids", "store", "stream",
    "structured_outputs", "temperature", "text", "tool_choice", "tools", "top_k", "top_logprobs", "top_p",
    "truncation", "user", "vllm_xargs", "watermarking",
    "conversation", "context_management", "prompt_cache_retention", "safety_identifier", "stream_options",
    "program_id", "explain",
})
_REFUSED = {
    "previous_input_messages": "ThunderAgent does not route `previous_input_messages`: send the history in `input`",
}


def check_fields(doc: dict[str, Any]) -> None:
    """A 400 naming the first field no server acts on, one of the fleet's own, or one ThunderAgent cannot route."""
    for key, value in doc.items():
        if key in _REFUSED and value:
            raise RequestError(_REFUSED[key], param=key, code="unsupported_parameter")
        if key not in FIELDS:
            refuse(key, "not a field of the Responses API")


def _type(item: dict[str, Any]) -> Any:
    return item.get("type", "message" if "role" in item else None)


def _first_text(parts: object) -> str | None:
    if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
        return parts[0]["text"]
    return None


def _item(item: object, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message an input item makes, or None when it merged into ``prev`` (the last message so far)."""
    if not isinstance(item, dict):
        return None  # the server refuses it
    kind = _type(item)
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if kind == "function_call":
        call = {"id": item.get("call_id"), "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                "type": "function"}
        if assistant is not None and isinstance(assistant.get("tool_calls", []), list):
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        text = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content)
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    return item if "role" in item else None


def _continues(items: object) -> bool:
    """A last message or reasoning item still in progress is continued, not answered (vLLM's rule)."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in ("in_progress",
                                                                                              "incomplete")


def to_chat(doc: dict[str, Any]) -> dict[str, Any]:
    """The chat request (decoded JSON) a server renders for this Responses request."""
    messages: list[dict[str, Any]] = []
    if isinstance(doc.get("instructions"), str) and doc["instructions"]:
        messages.append({"role": "system", "content": doc["instructions"]})
    inp = doc.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        own: list[dict[str, Any]] = []
        for item in inp:
            msg = _item(item, own[-1] if own else None)
            if msg is not None:
                own.append(msg)
        messages += own
    continues = _continues(inp)
    chat: dict[str, Any] = {"messages": messages, "add_generation_prompt": not continues,
                            "continue_final_message": continues}
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
             for t in doc.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
    if tools:
        chat["tools"] = tools
    if isinstance(doc.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = doc["chat_template_kwargs"]
    reasoning = doc.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat
