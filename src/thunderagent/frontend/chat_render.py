"""OpenAI chat messages as a chat template reads them, the way vLLM hands them over.

A relayed chat request (``frontend/relay.py``) is rendered by the server, with ``tools`` and a tool-call
history; ThunderAgent renders the same conversation with the same template only to hash it for routing,
so the closer this is to the server's own preparation, the more of the prompt matches the blocks the
server's KV events announced. What vLLM 0.32 does for a template of the "string" content format
(``vllm/renderers/chat_utils.py``), kept here: text parts joined by newlines (other parts are not
text: left out), an assistant's ``tool_calls`` with JSON ``arguments`` parsed into objects (empty or
malformed: ``{}``), empty ``tool_calls`` dropped, ``reasoning`` copied to ``reasoning_content``, a tool
message's ``tool_call_id`` and any message's ``name`` kept. A mismatch costs cache hits, never
correctness: the server renders the prompt it serves.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def part_text(content: object) -> str:
    """A message's text: a string as is, text parts joined by newlines, anything else empty."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(p["text"] for p in content
                     if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))


def _call(call: object) -> object:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call  # the server refuses it; the hash only has to be deterministic
    function = dict(call["function"])
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except ValueError:
            args = {}
    function["arguments"] = args if args else {}
    return {**call, "function": function}


def conversation(messages: Sequence[object]) -> list[dict[str, Any]]:
    """``messages`` of a chat request (decoded JSON) as the template's ``messages``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping):
            continue
        role = m.get("role")
        msg: dict[str, Any] = {"role": role, "content": part_text(m.get("content"))}
        if role == "assistant":
            calls = m.get("tool_calls")
            if isinstance(calls, list) and calls:
                msg["tool_calls"] = [_call(c) for c in calls]
            reasoning = m.get("reasoning", m.get("reasoning_content"))
            if isinstance(reasoning, str):
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def canonical(obj: object) -> str:
    """Stable JSON text of tools / tool calls for the byte-level stand-in template."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
