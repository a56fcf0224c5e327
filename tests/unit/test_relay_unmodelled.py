"""What a vLLM / SGLang fleet relays instead of refusing (``relay``): which requests, which of
their fields, the body the server gets, and how ThunderAgent renders a relayed chat to hash it."""

from __future__ import annotations

import itertools
import json

import msgspec
import pytest

from thunderagent.config import ConfigError, parse_config
from thunderagent.execution.relay_body import engine_body
from thunderagent.frontend.chat_render import conversation, part_text, template_tools
from thunderagent.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    Unmodelled,
    decode_request,
    message_text,
)
from thunderagent.frontend.protocol import Message as ProtoMessage
from thunderagent.frontend.relay_fields import RelayFields
from thunderagent.frontend.tokenizer import ByteTokenizer, ChatMessage
from thunderagent.types import EngineRequest

USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


@pytest.mark.parametrize("fields", [{"tools": [{"type": "function"}]}, {"logprobs": True}, {"n": 2},
                                    {"response_format": {"type": "json_object"}}, {"top_k": 5},
                                    {"messages": [{"role": "tool", "tool_call_id": "c", "content": "x"}]}])
def test_what_the_token_path_does_not_model_is_unmodelled(fields: dict) -> None:
    with pytest.raises(Unmodelled):
        decode_request(_chat(**fields), ChatCompletionRequest)


def test_malformed_requests_stay_plain_400s() -> None:
    for body in (b"{", _chat(max_tokens=0), _chat(temperature="hot")):
        with pytest.raises(RequestError) as err:
            decode_request(body, ChatCompletionRequest)
        assert not isinstance(err.value, Unmodelled)
    req = decode_request(_chat(tools=[], logprobs=False), ChatCompletionRequest)  # neutral: the token path
    assert isinstance(req, ChatCompletionRequest)
    part = ProtoMessage("user", [{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(Unmodelled) as err2:
        message_text(part, 3)
    assert err2.value.param == "messages[3].content[0]"


def test_fields_relayed_are_those_the_engine_takes() -> None:
    vllm = RelayFields(["vllm"])
    vllm.check({"model": "m", "messages": USER, "tools": [], "top_k": 3, "chat_template_kwargs": {},
                "program_id": "p", "priority": 2, "best_of": 1}, chat=True)  # best_of 1: asks for nothing
    for key, value in (("toppk", 3), ("best_of", 2), ("kv_transfer_params", {}), ("request_id", "x"),
                       ("ec_transfer_params", {})):
        with pytest.raises(RequestError) as err:
            vllm.check({"model": "m", "messages": USER, key: value}, chat=True)
        assert err.value.param == key and err.value.code == "unsupported_parameter"
    with pytest.raises(RequestError) as err:
        vllm.check({"model": "m", "messages": [{"role": "user", "content": "x", "mood": "ok"}]}, chat=True)
    assert err.value.param == "messages[0].mood"
    vllm.check({"model": "m", "prompt": "x", "echo": True, "suffix": "s", "prompt_logprobs": 1}, chat=False)
    with pytest.raises(RequestError):
        vllm.check({"model": "m", "prompt": "x", "chat_template": "t"}, chat=False)  # a chat field
    both = RelayFields(e for e in ("vllm", "sglang", "vllm"))  # a mixed fleet: only what every engine takes
    assert both.engines == ["sglang", "vllm"]
    assert "regex" in RelayFields(["sglang"]).chat and "regex" not in both.chat
    assert "top_k" in both.chat and "structured_outputs" not in both.chat


def _req(**kw: object) -> EngineRequest:
    return EngineRequest("r1", [1, 2, 3], [], 0, 16, **kw)  # type: ignore[arg-type]


def test_engine_body_keeps_the_clients_fields_and_rewrites_ours() -> None:
    body = json.dumps({"model": "thunderagent-sim", "messages": USER, "tools": [{"type": "function"}],
                       "program_id": "p", "explain": True, "priority": 3, "cache_salt": "client",
                       "lora_name": "ad", "kv_transfer_params": {"x": 1},
                       "extra_body": {"program_id": "p", "top_k": 2}, "user": "u"}).encode()
    out = msgspec.json.decode(engine_body(body, _req(priority=3, cache_salt="tenant:client"), "served",
                                          send_priority=False))
    assert out == {"model": "served", "messages": USER, "tools": [{"type": "function"}], "user": "u",
                   "extra_body": {"top_k": 2}, "cache_salt": "tenant:client"}
    assert list(out)[:3] == ["model", "messages", "tools"]  # the client's order kept
    out = msgspec.json.decode(engine_body(body, _req(priority=3, lora_name="ad"), "served", send_priority=True))
    assert out["model"] == "ad" and out["priority"] == -3 and "cache_salt" not in out
    out = msgspec.json.decode(engine_body(json.dumps({"model": "x", "prompt": "p", "extra_body": {"program_id": "q"}})
                                          .encode(), _req(), "served", send_priority=True))
    assert out == {"model": "served", "prompt": "p"}  # priority 0 is the engine's default: not sent


def test_conversation_is_what_vllm_hands_the_template() -> None:
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text",
                                                                                             "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot", "reasoning_content": "think", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"k\": [1, 2]}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"id": "3", "type": "function", "function": {"name": "h", "arguments": ""}}]},
        {"role": "assistant", "content": "done", "tool_calls": []},
        {"role": "tool", "tool_call_id": "1", "content": "r"},
    ]
    assert conversation(msgs) == [
        {"role": "system", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot", "reasoning": "think", "reasoning_content": "think",
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"k": [1, 2]}}},
                        {"id": "2", "type": "function", "function": {"name": "g", "arguments": {}}},
                        {"id": "3", "type": "function", "function": {"name": "h", "arguments": {}}}]},
        {"role": "assistant", "content": "done"},
        {"role": "tool", "content": "r", "tool_call_id": "1"},
    ]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == "{\"k\": [1, 2]}"  # the body is not touched
    call = conversation([{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}, "id": "9"}]}])[0]["tool_calls"][0]
    assert json.dumps(call) == '{"id": "9", "function": {"arguments": {}, "name": "f"}, "type": "function"}'  # vLLM's


def test_tools_as_vllms_request_model_hands_them_over() -> None:
    tools = [{"function": {"name": "f", "extra": 1}},
             {"type": "function", "defer_loading": True,
              "function": {"parameters": {"a": 1}, "name": "g", "description": "d", "strict": False}},
             "junk"]
    assert json.dumps(template_tools(tools)) == json.dumps([
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "g", "description": "d", "parameters": {"a": 1}, "strict": False,
                                          "defer_loading": True}, "defer_loading": True}])
    assert template_tools([]) is None and template_tools(None) is None
    assert part_text(None) == "" and part_text(7) == ""
    # what vLLM reads as text: text, input_text / output_text (the Responses API's), refusal, thinking, bare strings
    assert part_text([{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, "c",
                      {"type": "output_text", "text": "d"}, {"type": "refusal", "refusal": "e"},
                      {"type": "thinking", "thinking": "f"}, {"type": "image_url", "image_url": {"url": "x"}},
                      {"type": "text", "text": None}, {"text": "no type"}]) == "a\nb\nc\nd\ne\nf"


def test_byte_tokenizer_renders_tools_and_calls_deterministically() -> None:
    tok = ByteTokenizer()
    plain = tok.apply_openai_chat({"messages": USER})
    assert plain == tok.apply_chat_template([ChatMessage("user", "hi")])  # no tools: the template as before
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    with_tools = tok.apply_openai_chat({"messages": USER, "tools": tools})
    assert with_tools[-len(plain):] == plain and len(with_tools) > len(plain)  # the tools come first
    reordered = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    assert tok.apply_openai_chat({"messages": USER, "tools": reordered}) == with_tools
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    grown = tok.apply_openai_chat({"messages": [*USER, call, *USER], "tools": tools})
    assert grown[:len(with_tools) - len("<|assistant|>\n")] == with_tools[:-len("<|assistant|>\n")]


_PORTS = itertools.count(1)


def _node(**kw: object) -> dict:
    """A vLLM group of one server (a server of its own: one listed twice is refused)."""
    return {"engine": "vllm", "endpoints": [{"url": f"http://127.0.0.1:{next(_PORTS)}"}], **kw}


def test_relay_defaults_and_refusals() -> None:
    def nodes(*groups: dict) -> list:
        return parse_config({"model": "/m", "execution_group": {"nodes": list(groups)}}, "t").execution_group.nodes

    assert [n.relay for n in nodes(_node(), _node(engine="sglang"))] == ["unmodelled", "unmodelled"]
    assert nodes(_node(relay="off"))[0].relay == "off"
    assert [n.relay for n in nodes(_node(relay="all"), _node(relay="all"))] == ["all", "all"]
    assert [n.relay for n in nodes(_node(), {"engine": "simulated"})] == ["off", "off"]
    assert [n.relay for n in nodes(_node(relay="off"), _node())] == ["off", "unmodelled"]  # one group refuses: 400s
    assert parse_config({}, "t").execution_group.nodes[0].relay == "off"
    assert nodes({"engine": "openai", "endpoints": [{"url": "http://x"}]})[0].relay == "all"
    for groups, words in (([{"engine": "simulated", "relay": "unmodelled"}], "no OpenAI endpoint"),
                          ([{"engine": "openai", "endpoints": [{"url": "http://x"}], "relay": "off"}],
                           "relays every request"),
                          ([_node(relay="all"), {"engine": "simulated"}], "nodes.0.relay"),
                          ([_node(relay="all"), _node()], "relay alike"),
                          ([_node(relay="sometimes")], "relay")):
        with pytest.raises(ConfigError, match=words):
            nodes(*groups)
    cfg = parse_config({"model": "/m", "execution_group": {"nodes": [_node()]}}, "t")
    assert parse_config(cfg.model_dump(), "again").execution_group.nodes[0].relay == "unmodelled"  # dumped, reloads


def test_completion_request_neutral_fields_unmodelled() -> None:
    with pytest.raises(Unmodelled):
        decode_request(json.dumps({"model": "m", "prompt": "x", "echo": True}).encode(), CompletionRequest)


def test_serve_relay_flag_sets_every_group() -> None:
    from thunderagent.overrides import build_config

    cfg = build_config(None, model="/m", worker_endpoints=["http://127.0.0.1:1=tcp://127.0.0.1:2"], relay="all")
    assert [n.relay for n in cfg.execution_group.nodes] == ["all"]
    cfg = build_config(None, model="/m", worker_endpoints=["http://127.0.0.1:1=tcp://127.0.0.1:2"])
    assert [n.relay for n in cfg.execution_group.nodes] == ["unmodelled"]
    with pytest.raises(ConfigError, match="relay"):
        build_config(None, relay="all")  # simulated workers cannot relay
    with pytest.raises(ConfigError, match="relay"):
        build_config(None, model="/m", worker_endpoints=["http://127.0.0.1:1"], relay="maybe")
