"""OpenAI chat messages as a chat template reads them, the way vLLM hands them over.

A relayed chat request (``frontend/relay.py``) is rendered by the server, with ``tools`` and a tool-call
history; ThunderAgent renders the same conversation with the same template only to hash it for routing,
so the closer this is to the server's own preparation, the more of the prompt matches the blocks the
server's KV events announced. What vLLM 0.32 does for a template of the "string" content format
(``vllm/renderers/chat_utils.py``), kept here: text parts joined by newlines (``text``, ``input_text``,
``output_text``, ``refusal``, ``thinking``; other parts are not text: left out), an assistant's
``tool_calls`` with JSON ``arguments`` parsed into objects (empty or malformed: ``{}``), empty
``tool_calls`` dropped, ``reasoning`` copied to ``reasoning_content``, a tool message's ``tool_call_id``
and any message's ``name`` kept, Claude Code's ``x-anthropic-billing-header`` line dropped from system
messages, ``developer`` messages made ``system`` ones (all merged first) for a template that does not name
that role; and what its request models make of the JSON before the template sees it: a tool call's keys
in the order ``id``, ``function`` (``arguments``, ``name``), ``type`` (messages vLLM builds itself, from a
Responses request, keep their own order); a tool as ``{type, function: {name, description,
parameters}}`` (absent ones null, unknown keys dropped, ``strict`` / ``defer_loading`` only when set). A
mismatch costs cache hits, never correctness: the server renders the prompt it serves. (A server started with
``--exclude-tools-when-tool-choice-none`` leaves tools out when ``tool_choice`` is ``"none"``; we cannot
see that flag and render them.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


#: content parts vLLM reads as text, and the key holding it (``renderers/chat_utils.py``: TEXT_PART_TYPES)
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}


def part_text(content: object) -> str:
    """A message's text: a string as is; of a list, the text parts (``text``, the Responses API's
    ``input_text`` / ``output_text``, ``refusal``, ``thinking``, bare strings) joined by newlines; anything
    else empty."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out = []
    for p in content:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, dict) and (key := _TEXT_PARTS.get(p.get("type"))) and isinstance(p.get(key), str):
            out.append(p[key])
    return "\n".join(out)


def _call(call: object, keep_order: bool) -> object:
    """A tool call as the template gets it: JSON ``arguments`` parsed (empty or malformed: ``{}``); keys in the
    order vLLM's chat request model gives them (``id``, ``function`` {``arguments``, ``name``}, ``type``), or as
    built (``keep_order``: messages vLLM builds itself, as from a Responses request, keep their own order)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call  # the server refuses it; the hash only has to be deterministic
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except ValueError:
            args = {}
    args = args if isinstance(args, dict) else {}
    if keep_order:
        return {k: ({**v, "arguments": args} if k == "function" else v) for k, v in call.items()}
    function = {"arguments": args}
    if "name" in fn:
        function["name"] = fn["name"]
    out = {k: call[k] for k in ("id",) if k in call}
    out["function"] = function
    if "type" in call:
        out["type"] = call["type"]
    return out


def template_tools(tools: object) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM's request model hands them to the template (``None``: no tools)."""
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            continue  # the server refuses it
        fn = t["function"]
        defer = t.get("defer_loading")
        function: dict[str, Any] = {"name": fn.get("name"), "description": fn.get("description"),
                                    "parameters": fn.get("parameters")}
        if fn.get("strict") is not None:
            function["strict"] = fn["strict"]
        if fn.get("defer_loading", defer) is not None:
            function["defer_loading"] = fn.get("defer_loading", defer)
        tool: dict[str, Any] = {"type": t.get("type", "function"), "function": function}
        if defer is not None:
            tool["defer_loading"] = defer
        out.append(tool)
    return out or None


_BILLING = "x-anthropic-billing-header"


def _without_billing(content: object) -> object:
    """A system message's parts without Claude Code's attribution line (its ``cch`` changes every request:
    vLLM drops it so the prefix stays cacheable; the rest of that part stays)."""
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        return content
    out: list[object] = []
    for p in parts:
        text = p if isinstance(p, str) else p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING)):
            out.append(p)
        elif rest := text.partition("\n")[2]:
            out.append(rest)
    return out


def conversation(messages: Sequence[object], keep_call_order: bool = False) -> list[dict[str, Any]]:
    """``messages`` of a chat request (decoded JSON) as the template's ``messages`` (``keep_call_order``: see
    :func:`_call`)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping):
            continue
        role = m.get("role")
        content = _without_billing(m.get("content")) if role == "system" else m.get("content")
        msg: dict[str, Any] = {"role": role, "content": part_text(content)}
        if role == "assistant":
            calls = m.get("tool_calls")
            if isinstance(calls, list) and calls:
                msg["tool_calls"] = [_call(c, keep_call_order) for c in calls]
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


def developer_as_system(conv: list[dict[str, Any]], template: object) -> list[dict[str, Any]]:
    """vLLM's handling of ``developer`` messages for a template that never names that role: they become
    ``system`` messages, and then every system message is merged into one first message (texts joined by a
    blank line) when one is not first or there are several."""
    if not any(m.get("role") == "developer" for m in conv):
        return conv  # (the common case: the template is not searched)
    named = template if isinstance(template, str) else " ".join(v for v in template.values()
                                                                if isinstance(v, str)) \
        if isinstance(template, dict) else ""
    if '"developer"' in named or "'developer'" in named:
        return conv
    conv = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in conv]
    if [i for i, m in enumerate(conv) if m["role"] == "system"] == [0]:
        return conv  # one system message, first: nothing to merge
    texts = [m["content"] for m in conv if m["role"] == "system" and m["content"]]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in conv if m["role"] != "system")]
