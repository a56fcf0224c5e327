"""Anthropic's Messages API converted as vLLM 0.32 converts it before rendering (``frontend/anthropic.py``), its
field check and error shapes, and the chat template's arguments merged as vLLM merges them."""

from __future__ import annotations

import json

import pytest

from thunderagent.frontend.anthropic import check_fields, error_doc, to_chat
from thunderagent.frontend.hf_tokenizer import _needs_system_first, template_kwargs
from thunderagent.frontend.protocol import RequestError

BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=8d1e2;"}


def test_system_blocks_join_without_separator_and_drop_the_billing_header() -> None:
    doc = {"system": [BILLING, {"type": "text", "text": "You are an agent."}, {"type": "text", "text": ""},
                      {"type": "text", "text": " Be brief."}],
           "messages": [{"role": "user", "content": "hi"}]}
    assert to_chat(doc, system_first=False, effort_off="none") == {"messages": [
        {"role": "system", "content": "You are an agent. Be brief."}, {"role": "user", "content": "hi"}]}
    # a string system prompt is kept as it is, even one that starts like the header (vLLM strips blocks only)
    doc["system"] = "x-anthropic-billing-header: kept"
    assert to_chat(doc, system_first=False, effort_off="none")["messages"][0]["content"] == doc["system"]


def test_inline_system_messages_stay_in_place_or_merge_into_the_first_when_the_template_needs_it() -> None:
    doc = {"system": "Top.", "messages": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder."}, BILLING]},
        {"role": "system", "content": "x-anthropic-billing-header: dropped"},
        {"role": "user", "content": "b"}]}
    assert to_chat(doc, system_first=False, effort_off="none")["messages"] == [
        {"role": "system", "content": "Top."}, {"role": "user", "content": "a"},
        {"role": "system", "content": "Reminder."}, {"role": "user", "content": "b"}]
    assert to_chat(doc, system_first=True, effort_off="none")["messages"] == [
        {"role": "system", "content": "Top.Reminder."}, {"role": "user", "content": "a"},
        {"role": "user", "content": "b"}]


def test_tool_use_and_results_become_tool_calls_and_tool_messages_in_vllm_order() -> None:
    doc = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Fix it."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Read ", "signature": "s"}, {"type": "thinking", "thinking": "first."},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.py"}},
            {"type": "tool_use", "id": "toolu_2", "name": "read", "input": None}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x = 1"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True, "content": [
                {"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
                {"type": "tool_reference", "tool_name": "grep"}]},
            {"type": "text", "text": "Now fix it."}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
        {"role": "assistant", "content": [{"type": "tool_result", "content": [{"a": 1}]}]}]}
    assert to_chat(doc, system_first=False, effort_off="none")["messages"] == [
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "reasoning": "Read first.", "content": "Reading.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "x = 1"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "line 1\nline 2"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": [{"type": "tool_reference", "name": "grep"}]},
        {"role": "user", "content": "Now fix it."},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},  # the user message itself had nothing left
        {"role": "assistant", "content": "Tool result: [{'a': 1}]"}]  # (Python's str of the list, as vLLM)


def test_a_message_of_only_tool_calls_has_no_content_key() -> None:
    doc = {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}
    assert to_chat(doc, system_first=False, effort_off="none")["messages"] == [
        {"role": "assistant",
         "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_tools_as_function_tools_after_additions_and_removals() -> None:
    schema = {"properties": {"p": {"type": "string"}}}
    doc = {"tools": [{"name": "a", "description": "A", "input_schema": schema, "defer_loading": True},
                     {"name": "b", "input_schema": {"type": "object"}, "strict": True}],
           "messages": [{"role": "system", "content": [
               {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}},
               {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "b"}},
               {"type": "tool_addition", "tool": {"type": "tool_definition",
                                                  "definition": {"name": "c", "input_schema": {}}}}]},
               {"role": "user", "content": "go"}]}
    chat = to_chat(doc, system_first=False, effort_off="none")
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "a", "description": "A", "parameters": {**schema, "type": "object"},
                                          "strict": None, "defer_loading": None}},
        {"type": "function", "function": {"name": "c", "description": None, "parameters": {"type": "object"},
                                          "strict": None, "defer_loading": None}}]
    assert list(chat["tools"][0]["function"]["parameters"]) == ["properties", "type"]  # "type" added last
    assert chat["messages"] == [{"role": "user", "content": "go"}]  # (no text: the system message is not emitted)
    assert "tools" not in to_chat({"messages": []}, system_first=False, effort_off="none")


def test_effort_and_thinking_switch_the_templates_reasoning_effort() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": 1}}
    assert to_chat({**base, "output_config": {"effort": "high"}}, system_first=False, effort_off="low") == {
        **base, "reasoning_effort": "high"}
    assert to_chat({**base, "output_config": {"effort": "high"}, "thinking": {"type": "disabled"}},
                   system_first=False, effort_off="low")["reasoning_effort"] == "low"  # disabled wins
    assert "reasoning_effort" not in to_chat({**base, "thinking": {"type": "enabled", "budget_tokens": 2048}},
                                             system_first=False, effort_off="none")


def test_template_kwargs_merge_as_vllm_does() -> None:
    assert template_kwargs({}) == {"add_generation_prompt": True, "continue_final_message": False}
    got = template_kwargs({"chat_template_kwargs": {"add_generation_prompt": False, "custom": 1, "documents": ["d"]},
                           "reasoning_effort": "none", "documents": None})
    # the request's own fields override the kwargs; unset ones leave them; enable_thinking follows the effort
    assert got == {"add_generation_prompt": True, "custom": 1, "documents": ["d"], "continue_final_message": False,
                   "reasoning_effort": "none", "enable_thinking": False}
    assert template_kwargs({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}})[
        "enable_thinking"] is False  # the client's say wins
    assert "reasoning_effort" not in template_kwargs({"reasoning_effort": "auto"})


def test_system_first_probe_follows_vllm() -> None:
    permissive = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    qwen_like = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                 "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                 "{{ m['content'] }}{% endfor %}")
    assert _needs_system_first(permissive) is False
    assert _needs_system_first(qwen_like) is True  # raises (here: an undefined function), as in vLLM's sandbox
    assert _needs_system_first(None) is True and _needs_system_first("") is True
    assert _needs_system_first({"default": permissive, "tool_use": qwen_like}) is True


def test_fields_and_errors() -> None:
    check_fields({"model": "m", "max_tokens": 1, "messages": [], "metadata": {"user_id": "u"},
                  "context_management": {}, "mcp_servers": [], "vllm_xargs": {}, "program_id": "p"})
    with pytest.raises(RequestError) as bad:
        check_fields({"model": "m", "max_token": 1})
    assert bad.value.param == "max_token" and "`max_token`" in bad.value.message
    with pytest.raises(RequestError, match="set by ThunderAgent"):
        check_fields({"kv_transfer_params": {}})
    assert error_doc(429, "slow down") == {"type": "error",
                                           "error": {"type": "rate_limit_error", "message": "slow down"}}
    assert [error_doc(s, "")["error"]["type"] for s in (400, 401, 403, 404, 413, 422, 500, 502, 503)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "request_too_large",
        "invalid_request_error", "api_error", "api_error", "overloaded_error"]
    json.dumps(error_doc(400, "x"))


def test_claude_code_session_ids_from_metadata() -> None:
    from thunderagent.frontend.messages_api import claude_session

    assert claude_session(json.dumps({"device_id": "x", "session_id": "6f1c2a9e-4b7d"})) == "6f1c2a9e-4b7d"
    assert claude_session("user_" + "a" * 64 + "_account__session_435395a4-cecb-4661-b9ec-c38edb6ec9c5") == \
        "435395a4-cecb-4661-b9ec-c38edb6ec9c5"
    assert [claude_session(u) for u in (None, "", "user-42", "{not json", '{"session_id": 7}', "[1]")] == [None] * 6
