"""Which fields a vLLM / SGLang server takes in a relayed request (``relay``).

A request that asks for something ThunderAgent does not model (tools, a tool-call history,
``response_format``, logprobs, penalties, ``n``, images, an engine's own sampling fields...) goes to
the server's own OpenAI endpoint with the client's body (``frontend/relay.py``). The servers accept
unknown fields and ignore them with a log line (vLLM's request models allow extras), so a misspelt
field would act nowhere; a field is relayed only when ThunderAgent models it or the engine takes it,
and anything else is still a 400 that names it. Fields that steer the fleet itself are ThunderAgent's
alone: the KV-transfer parameters of disaggregation and the engine's request id are refused.

The vLLM lists are the request models' fields of vLLM 0.32 (``ChatCompletionRequest``,
``CompletionRequest``); SGLang's are the OpenAI fields plus the sampling extras of its documentation
(not checked against a real SGLang server here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from thunderagent.config import NodeConfig
from thunderagent.execution.relay_body import FLEET_FIELDS
from thunderagent.frontend.protocol import (
    NEUTRAL,
    NEUTRAL_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
)

FORBIDDEN = FLEET_FIELDS  # (the worker drops them from a relayed body too)

_VLLM_COMMON = frozenset({
    "add_special_tokens", "allowed_token_ids", "bad_words", "echo", "frequency_penalty", "ignore_eos",
    "include_stop_str_in_output", "length_penalty", "logit_bias", "logprob_token_ids", "logprobs", "min_p",
    "min_tokens", "mm_payload", "n", "presence_penalty", "prompt_logprobs", "repetition_detection",
    "repetition_penalty", "response_format", "return_mm_kwargs", "return_token_ids", "return_token_offsets",
    "return_tokens_as_token_ids", "session_id", "skip_special_tokens", "spaces_between_special_tokens",
    "stop_token_ids", "stream_interval", "structured_outputs", "thinking_token_budget", "top_k",
    "truncate_prompt_tokens", "truncation_side", "use_beam_search", "vllm_xargs", "watermarking",
})
_VLLM_CHAT = _VLLM_COMMON | {
    "add_generation_prompt", "chat_template", "chat_template_kwargs", "continue_final_message", "documents",
    "include_reasoning", "media_io_kwargs", "mm_processor_kwargs", "parallel_tool_calls", "reasoning_effort",
    "return_prompt_text", "tool_choice", "tools", "top_logprobs",
}
_VLLM_COMPLETION = _VLLM_COMMON | {"prompt_embeds", "suffix"}

_SGLANG_COMMON = frozenset({
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "n", "response_format", "top_k", "min_p",
    "min_tokens", "repetition_penalty", "stop_token_ids", "no_stop_trim", "ignore_eos", "skip_special_tokens",
    "regex", "ebnf", "json_schema", "lora_path",
})
_SGLANG_CHAT = _SGLANG_COMMON | {
    "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "continue_final_message",
    "separate_reasoning", "stream_reasoning", "reasoning_effort",
}
_SGLANG_COMPLETION = _SGLANG_COMMON | {"echo", "suffix"}

#: engine -> (chat fields, completion fields) it takes beyond what ThunderAgent models
ENGINE_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "vllm": (_VLLM_CHAT, _VLLM_COMPLETION),
    "sglang": (_SGLANG_CHAT, _SGLANG_COMPLETION),
}
#: keys of a chat message the servers read (OpenAI's, and the reasoning text clients echo back)
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal",
                          "reasoning_content", "reasoning"})


def _modelled(kind: type, neutral: dict[str, tuple[object, ...]]) -> frozenset[str]:
    """The request struct's fields that ThunderAgent implements (not the ones accepted only when off)."""
    return frozenset(kind.__struct_fields__) - set(neutral)  # type: ignore[attr-defined]


_MODELLED_CHAT = _modelled(ChatCompletionRequest, NEUTRAL)
_MODELLED_COMPLETION = _modelled(CompletionRequest, NEUTRAL_COMPLETION)


def refuse(key: str, why: str) -> NoReturn:
    """The 400 for a request field ``key``: the fleet's own (disaggregation, request ids), or unknown (``why``)."""
    if key in FORBIDDEN:
        raise RequestError(f"`{key}` is set by ThunderAgent (disaggregation, request ids), not by clients",
                           param=key, code="unsupported_parameter")
    raise RequestError(f"unsupported field `{key}`: {why}; remove it from the request", param=key,
                       code="unsupported_parameter")


def fleet_relay(nodes: Sequence[NodeConfig]) -> RelayFields | None:
    """The fields a fleet of vLLM / SGLang servers relays, when all its groups relay (``relay`` resolved in
    ``config.resolve_relay``); None for a fleet that relays nothing, or an ``engine: openai`` one (which relays
    everything, unchecked)."""
    if not nodes or any(n.relay == "off" or n.engine == "openai" for n in nodes):
        return None
    return RelayFields(n.engine for n in nodes)


class RelayFields:
    """The fields a relayed request may carry on a fleet of ``engines`` (the ones every engine takes)."""

    def __init__(self, engines: Iterable[str]) -> None:
        self.engines = sorted(set(engines))
        chat: frozenset[str] | None = None
        completion: frozenset[str] | None = None
        for e in self.engines:
            c, p = ENGINE_FIELDS[e]
            chat = c if chat is None else chat & c
            completion = p if completion is None else completion & p
        if chat is None or completion is None:
            raise ValueError("no engine to relay to")
        self.chat = (_MODELLED_CHAT | chat) - FORBIDDEN
        self.completion = (_MODELLED_COMPLETION | completion) - FORBIDDEN

    def check(self, doc: dict[str, Any], chat: bool) -> None:
        """A 400 naming the first field the servers would not act on (or that is the fleet's own)."""
        allowed = self.chat if chat else self.completion
        neutral = NEUTRAL if chat else NEUTRAL_COMPLETION
        for key, value in doc.items():
            if key in allowed:
                continue
            if key in neutral and key not in FORBIDDEN and any(
                    value is a or (type(value) is type(a) and value == a) for a in neutral[key]):
                continue  # asks for nothing: harmless whoever reads it
            refuse(key, f"neither ThunderAgent nor engine {'/'.join(self.engines)} implements it")
        if not chat:
            return
        messages = doc.get("messages")
        for i, m in enumerate(messages if isinstance(messages, list) else ()):
            if not isinstance(m, dict):
                continue  # the lenient decoder names the bad message
            for key in m:
                if key not in MESSAGE_KEYS:
                    raise RequestError(f"unsupported field `messages[{i}].{key}`: remove it from the message",
                                       param=f"messages[{i}].{key}", code="unsupported_parameter")
