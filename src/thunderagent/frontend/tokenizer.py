"""Tokenizers and chat templates seen by the frontend.

The frontend tokenizes and applies the chat template *before* hashing, so the block hashes the router
matches describe exactly the tokens the engine will cache. The simulated default is a byte-level
tokenizer (ids 0..255 are UTF-8 bytes, 256 is EOS) with a plain-text chat template; real engines
bring their model's own tokenizer (a later adapter implements the same protocol).
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from thunderagent.frontend.chat_render import canonical, conversation


@dataclass(slots=True, frozen=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_many(self, texts: Sequence[str], special: bool = True) -> list[list[int]]:
        """:meth:`encode` of each text (a batch of inputs: one call, which a fast tokenizer runs in parallel);
        ``special`` False: without the special tokens the tokenizer adds (a BOS...)."""
        ...

    def encode_prompt(self, text: str, scope: str | None = None) -> list[int]:
        """A completion request's text prompt: :meth:`encode`'s ids (``scope``: as for chats)."""
        ...

    def apply_chat_template(self, messages: Sequence[ChatMessage], scope: str | None = None) -> list[int]:
        """``scope``: the request's cache salt (a tokenizer that reuses recent prompts' ids reuses its scope's only)."""
        ...

    def apply_openai_chat(self, doc: Mapping[str, Any], keep_call_order: bool = False,
                          scope: str | None = None) -> list[int]:
        """The token ids a server renders for a relayed chat request (decoded JSON, with ``tools`` and
        tool calls: ``frontend/chat_render.py``), for hashing only."""
        ...

    @property
    def system_first(self) -> bool:
        """The chat template needs every system message first (inline ones are merged: the Messages API)."""
        ...

    def thinking_off_effort(self) -> str:
        """The ``reasoning_effort`` a Messages API request's ``thinking: disabled`` renders with."""
        ...

    def decoder(self) -> StreamDecoder: ...


class StreamDecoder(Protocol):
    def feed(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class _ByteStreamDecoder:
    """Incremental UTF-8 decoding: a multi-byte character split across two engine passes is held
    back until complete instead of being emitted as U+FFFD."""

    __slots__ = ("_dec",)

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Sequence[int]) -> str:
        return self._dec.decode(bytes(t for t in token_ids if t < 256))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    """Byte-level tokenizer with a prefix-stable chat template.

    The template renders every message as ``<|role|>\\n{content}<|end|>\\n`` and ends with
    ``<|assistant|>\\n``. Prefix stability matters for caching: the prompt of turn *k* is a strict
    prefix of the prompt of turn *k+1* (which appends the assistant's reply and the next user turn),
    so the blocks cached at turn *k* are hits at turn *k+1*.
    """

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: Sequence[str], special: bool = True) -> list[list[int]]:
        return [self.encode(t) for t in texts]  # (no special tokens to add)

    def encode_prompt(self, text: str, scope: str | None = None) -> list[int]:
        return self.encode(text)

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        parts = [f"<|{m.role}|>\n{m.content}<|end|>\n" for m in messages]
        parts.append("<|assistant|>\n")
        return "".join(parts)

    def apply_chat_template(self, messages: Sequence[ChatMessage], scope: str | None = None) -> list[int]:
        return self.encode(self.render_chat(messages))

    def apply_openai_chat(self, doc: Mapping[str, Any], keep_call_order: bool = False,
                          scope: str | None = None) -> list[int]:
        """The same template, with the request's tools first and each message's tool calls after its text
        (a stand-in: without a model nothing renders them for real; deterministic, so repeats hash alike)."""
        msgs = [ChatMessage(m["role"] if isinstance(m["role"], str) else "?",
                            m["content"] + (canonical(m["tool_calls"]) if "tool_calls" in m else ""))
                for m in conversation(doc.get("messages") or ())]
        tools = doc.get("tools")
        if tools:
            msgs.insert(0, ChatMessage("tools", canonical(tools)))
        return self.apply_chat_template(msgs)

    @property
    def system_first(self) -> bool:
        return False  # the stand-in template renders system messages anywhere

    def thinking_off_effort(self) -> str:
        return "none"  # the stand-in renders no effort

    def decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder()
