"""OpenAI's Responses API converted as vLLM 0.32 converts it before rendering (``frontend/responses.py``), its
field check, and the Responses event reader of the worker's relay."""

from __future__ import annotations

import pytest

from thunderagent.execution.openai_relay import _READERS, _Read
from thunderagent.frontend.protocol import RequestError
from thunderagent.frontend.responses import check_fields, to_chat
from thunderagent.types import FinishReason


def test_instructions_and_a_string_input() -> None:
    assert to_chat({"instructions": "Be brief.", "input": "hi"}) == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "add_generation_prompt": True, "continue_final_message": False}
    assert to_chat({"instructions": "", "input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_items_become_messages_merging_calls_and_reasoning_into_the_assistant_turn() -> None:
    user = {"role": "user", "content": [{"type": "input_text", "text": "Fix it."}]}
    items = [
        {"role": "developer", "content": "Use tools."}, user,
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
         "content": [{"type": "reasoning_text", "text": "I should read a.py."}]},
        {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
         "content": [{"type": "output_text", "text": "Reading.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"path": "a.py"}'},
        {"type": "function_call", "call_id": "c2", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x = 1"},
        {"type": "function_call_output", "call_id": "c2", "output": "y = 2"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "from the summary"}]},
        {"role": "assistant", "content": "Done."},  # merged: the reasoning's message has no content yet
    ]
    assert to_chat({"input": items})["messages"] == [
        {"role": "developer", "content": "Use tools."}, user,
        {"role": "assistant", "reasoning": "I should read a.py.", "content": "Reading.", "tool_calls": [
            {"id": "c1", "function": {"name": "read", "arguments": '{"path": "a.py"}'}, "type": "function"},
            {"id": "c2", "function": {"name": "read", "arguments": "{}"}, "type": "function"}]},
        {"role": "tool", "content": "x = 1", "tool_call_id": "c1"},
        {"role": "tool", "content": "y = 2", "tool_call_id": "c2"},
        {"role": "assistant", "reasoning": "from the summary", "content": "Done."}]


def test_function_tools_effort_and_a_continued_last_message() -> None:
    doc = {"input": [{"role": "user", "content": "go"},
                     {"type": "message", "role": "assistant", "status": "incomplete",
                      "content": [{"type": "output_text", "text": "Part"}]}],
           "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
                     {"type": "web_search"}],
           "reasoning": {"effort": "low"}, "chat_template_kwargs": {"k": 1}}
    assert to_chat(doc) == {
        "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Part"}],
        "add_generation_prompt": False, "continue_final_message": True,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
        "chat_template_kwargs": {"k": 1}, "reasoning_effort": "low"}


def test_fields() -> None:
    check_fields({"model": "m", "input": "x", "store": False, "reasoning": {}, "top_k": 3, "program_id": "p",
                  "background": False})
    check_fields({"input": "x", "background": True, "store": True})  # relayed: its reads go to its server
    for bad, param in (({"max_token": 1}, "max_token"),
                       ({"request_id": "r"}, "request_id"), ({"previous_input_messages": [{}]},
                                                                "previous_input_messages")):
        with pytest.raises(RequestError) as err:
            check_fields({"input": "x", **bad})
        assert err.value.param == param


EVENTS = [
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1",'
    b'"status":"in_progress","usage":null}}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":""}\n\n',
    b'event: response.function_call_arguments.delta\ndata: {"type":"response.function_call_arguments.delta",'
    b'"delta":"{}"}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1","status":"incomplete",'
    b'"incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":40,"output_tokens":5,'
    b'"input_tokens_details":{"cached_tokens":32}}}}\n\n',
]


def test_the_responses_reader() -> None:
    st = _Read()
    reader = _READERS["/v1/responses"]
    for ev in EVENTS:
        data = ev.split(b"data: ", 1)[1].strip()
        reader.event(data, st)
    assert (st.tokens, st.end, st.reason, st.reported, st.cached) == (2, True, FinishReason.LENGTH, 5, 32)
    st = _Read()
    reader.event(b'{"type":"response.failed","response":{"status":"failed"}}', st)
    assert st.error is not None
    st = _Read()
    reader.whole(b'{"id":"resp_2","object":"response","status":"completed","usage":{"output_tokens":7,'
                 b'"input_tokens_details":{"cached_tokens":16}}}', st)
    assert (st.reason, st.reported, st.cached) == (FinishReason.STOP, 7, 16)


def test_chat_rendering_rules_vllm_applies_to_built_messages() -> None:
    from thunderagent.frontend.chat_render import conversation, developer_as_system

    call = {"id": "c1", "function": {"name": "read", "arguments": '{"p": 1}'}, "type": "function"}
    msgs = [{"role": "assistant", "tool_calls": [call]}]
    # a chat request's calls come out of vLLM's request model (arguments before name); messages it builds
    # itself from a Responses request keep their own order
    assert list(conversation(msgs)[0]["tool_calls"][0]["function"]) == ["arguments", "name"]
    kept = conversation(msgs, keep_call_order=True)[0]["tool_calls"][0]
    assert kept == {"id": "c1", "function": {"name": "read", "arguments": {"p": 1}}, "type": "function"}
    assert list(kept["function"]) == ["name", "arguments"]
    # Claude Code's attribution line leaves system messages (the rest of its part stays)
    billing = "x-anthropic-billing-header: cc_version=2.1; cch=abc;"
    assert conversation([{"role": "system", "content": billing + "\nBe brief."}])[0]["content"] == "Be brief."
    assert conversation([{"role": "system", "content": [{"type": "text", "text": billing},
                                                          {"type": "text", "text": "Be brief."}]}])[0]["content"] == \
        "Be brief."
    assert conversation([{"role": "user", "content": billing}])[0]["content"] == billing  # system messages only
    # developer messages, for a template that never names the role: system ones, merged first
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "developer", "content": "D"}]
    assert developer_as_system(conv, "{{ m.role }}") == [{"role": "system", "content": "S\n\nD"},
                                                         {"role": "user", "content": "u"}]
    assert developer_as_system(conv, "{% if m.role == 'developer' %}{% endif %}") is conv  # a template that knows it
    first = [{"role": "developer", "content": "D"}, {"role": "user", "content": "u"}]
    assert developer_as_system(first, "") == [{"role": "system", "content": "D"}, {"role": "user", "content": "u"}]
