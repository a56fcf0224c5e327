"""Anthropic's Messages API (``POST /v1/messages``, what Claude Code speaks) as the servers render it.

vLLM (and SGLang, llama.cpp) serve ``/v1/messages`` themselves by converting the request into an OpenAI
chat request and rendering that with the model's chat template. ThunderAgent relays the client's body
to the server the router picks (``frontend/messages_api.py``) and, to route it on the blocks the server
will cache, converts it the way vLLM 0.32 does (``vllm/entrypoints/anthropic/serving.py``) and renders
the result with the same template (``Tokenizer.apply_openai_chat``):

- the top-level ``system`` (a string, or its text blocks concatenated without separator) becomes the
  first system message; a text block starting with ``x-anthropic-billing-header`` (Claude Code's
  per-request attribution, which would defeat the prefix cache) is dropped. When the template requires
  system-first ordering (it fails on a ``[system, user, system, user]`` conversation, e.g. Qwen's), the
  system messages inside ``messages`` are merged into that first one, else they stay in place;
- a message's text blocks (non-empty) are its content (one text block: a string); ``thinking`` blocks
  become ``reasoning``; ``tool_use`` blocks become ``tool_calls`` (arguments: the JSON of ``input``); a
  user's ``tool_result`` block becomes a ``tool`` message placed before the user message (text parts
  joined by newlines; its images a user message after it); an assistant's a text part ``Tool result:
  ...``; a user message left without content is dropped;
- ``tools`` (after the ``tool_addition`` / ``tool_removal`` blocks of system messages) become function
  tools with ``input_schema`` as ``parameters`` (``"type": "object"`` added when missing);
- ``output_config.effort`` is the template's ``reasoning_effort``; ``thinking: {"type": "disabled"}``
  sets it to ``none``, or ``low`` for a template that ignores or refuses ``none`` (vLLM's probe, repeated
  by the tokenizer); ``chat_template_kwargs`` pass through.

A mismatch costs cache hits, never correctness: the server renders the prompt it serves. Requests are
checked only for what routing reads (``model``, ``max_tokens``, ``messages``, ``stream``); their fields
must be the Messages API's or vLLM's extensions of it (a misspelt field, which the servers would ignore,
is a 400 naming it). Errors on these paths take Anthropic's shape (:func:`error_doc`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from thunderagent.frontend.relay_fields import refuse
from thunderagent.types import MESSAGES_PATH

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ANTHROPIC_PATHS = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})

#: the Messages API's request fields (the servers ignore the ones they do not implement: container,
#: context_management, mcp_servers, metadata, service_tier, output_format), vLLM's extensions, ThunderAgent's
FIELDS = frozenset({
    "model", "messages", "max_tokens", "metadata", "output_config", "thinking", "stop_sequences", "stream",
    "system", "temperature", "tool_choice", "tools", "top_k", "top_p",
    "container", "context_management", "mcp_servers", "service_tier", "output_format",
    "cache_salt", "chat_template_kwargs", "mm_payload", "return_mm_kwargs", "vllm_xargs", "watermarking",
    "program_id", "priority", "explain",
})
_BILLING = "x-anthropic-billing-header"
#: HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_doc(status: int, message: str) -> dict[str, Any]:
    """An Anthropic error body (``{"type": "error", "error": {"type", "message"}}``)."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def check_fields(doc: dict[str, Any]) -> None:
    """A 400 naming the first field that is neither the Messages API's, vLLM's nor ThunderAgent's."""
    for key in doc:
        if key not in FIELDS:
            refuse(key, "not a field of the Messages API")


def _text(block: object) -> str | None:
    if isinstance(block, dict) and block.get("type") == "text":
        text = block.get("text")
        if isinstance(text, str) and text and not text.startswith(_BILLING):
            return text
    return None


def _system_text(content: object) -> str | None:
    """A system message's text without the billing header (None: nothing left)."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING) else content
    parts = [t for b in (content if isinstance(content, list) else ()) if (t := _text(b)) is not None]
    return "".join(parts) or None


def _image_url(source: object) -> str:
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """A user's ``tool_result``: a ``tool`` message (then its images, then its tool references)."""
    content = block.get("content")
    texts: list[str] = []
    images: list[str] = []
    refs: list[dict[str, Any]] = []
    if isinstance(content, list):
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(str(item.get("text", "")))
            elif kind == "image" and (url := _image_url(item.get("source", {}))):
                images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                refs.append({"type": "tool_reference", "name": name})
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id,
                "content": content if isinstance(content, str) else "\n".join(texts)})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})


def _blocks(role: str, blocks: list[Any], msg: dict[str, Any], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for b in blocks:
        if not isinstance(b, dict):
            continue  # the server refuses it
        kind = b.get("type")
        if kind == "text" and b.get("text"):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and b.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b["source"])}})
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            calls.append({"id": b.get("id") or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result":
            if role == "user":
                _tool_result(b, out)
            else:
                parts.append({"type": "text", "text": f"Tool result: {b['content'] if b.get('content') else ''}"})
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        msg["content"] = parts[0]["text"]
    elif parts:
        msg["content"] = parts


def _messages(doc: dict[str, Any], system_first: bool) -> list[dict[str, Any]]:
    messages = [m for m in doc.get("messages") or () if isinstance(m, dict)]
    system = doc.get("system")
    head = [system] if isinstance(system, str) and system else [
        t for b in (system if isinstance(system, list) else ()) if (t := _text(b)) is not None]
    if system_first:
        head += [t for m in messages if m.get("role") == "system" and (t := _system_text(m.get("content")))]
    out: list[dict[str, Any]] = [{"role": "system", "content": "".join(head)}] if head else []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role == "system":
            if not system_first and (text := _system_text(content)):
                out.append({"role": "system", "content": text})
            continue
        msg: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            msg["content"] = content
        elif isinstance(content, list):
            _blocks(str(role), content, msg, out)
        if not (role == "user" and "content" not in msg):
            out.append(msg)
    return out


def _tools(doc: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools in effect at the end of the conversation, as function tools."""
    tools = doc.get("tools")
    changes = [b for m in doc.get("messages") or () if isinstance(m, dict) and isinstance(m.get("content"), list)
               for b in m["content"] if isinstance(b, dict) and b.get("type") in ("tool_addition", "tool_removal")]
    if changes:
        named = {t.get("name"): t for t in tools or () if isinstance(t, dict)}
        removed: set[Any] = set()
        for b in changes:
            change = b.get("tool") if isinstance(b.get("tool"), dict) else {}
            if change.get("type") == "tool_definition" and isinstance(change.get("definition"), dict):
                name = change["definition"].get("name")
                named[name] = change["definition"]
            else:
                name = change.get("name")
                if name not in named:
                    continue  # the server refuses it
                if b["type"] == "tool_addition":
                    named[name] = {**named[name], "defer_loading": None}
            (removed.add if b["type"] == "tool_removal" else removed.discard)(name)
        tools = [t for n, t in named.items() if n not in removed]
    if not isinstance(tools, list):
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict):
            continue
        schema = t.get("input_schema")
        if isinstance(schema, dict) and "type" not in schema:
            schema = {**schema, "type": "object"}  # vLLM's request model adds it (last)
        out.append({"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"), "parameters": schema,
            "strict": t.get("strict"), "defer_loading": t.get("defer_loading")}})
    return out


def to_chat(doc: dict[str, Any], *, system_first: bool, effort_off: str) -> dict[str, Any]:
    """The OpenAI chat request (decoded JSON: ``messages``, ``tools``, ``chat_template_kwargs``,
    ``reasoning_effort``) a server renders for this Messages request. ``system_first``: the template needs
    system-first ordering; ``effort_off``: the effort ``thinking: disabled`` maps to (``none`` / ``low``)."""
    chat: dict[str, Any] = {"messages": _messages(doc, system_first)}
    tools = _tools(doc)
    if tools is not None:
        chat["tools"] = tools
    if isinstance(doc.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = doc["chat_template_kwargs"]
    output, thinking = doc.get("output_config"), doc.get("thinking")
    if isinstance(output, dict) and output.get("effort") is not None:
        chat["reasoning_effort"] = output["effort"]
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        chat["reasoning_effort"] = effort_off
    return chat
