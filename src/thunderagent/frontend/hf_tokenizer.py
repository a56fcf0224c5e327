"""The model's own tokenizer and chat template, from a local model directory (Hugging Face format).

Real engines cache exactly the token ids we send them, so the frontend tokenizes with the model's
tokenizer and renders the model's chat template itself: the block hashes the router matches are
then the blocks the engine caches. Chat prompts are rendered to text and tokenized without adding
special tokens (the template writes them), completion prompts with them, as vLLM does.

Needs the ``engines`` extra (``transformers``). Loading takes about a second: do it before the
server starts, never in a request handler.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from thunderagent.frontend.chat_render import conversation, template_tools
from thunderagent.frontend.tokenizer import ChatMessage, StreamDecoder

log = logging.getLogger(__name__)


class HfTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist (the `model` setting / --model)")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ValueError(
                "a model directory needs the `engines` extra: pip install -e '.[engines]'"
            ) from exc
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer of {str(path)!r}: {exc}") from exc
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(f"the tokenizer of {str(path)!r} has no eos token")
        if not self._tok.chat_template:
            raise ValueError(f"the tokenizer of {str(path)!r} has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template)")
        self.eos_token_id: int = int(eos)
        self.name = str(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        conv = [{"role": m.role, "content": m.content} for m in messages]
        text = self._tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert isinstance(text, str), "apply_chat_template(tokenize=False) returns text"
        return text

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        return list(self._tok.encode(self.render_chat(messages), add_special_tokens=False))

    def apply_openai_chat(self, doc: Mapping[str, Any]) -> list[int]:
        """A relayed chat request rendered as vLLM renders it (``frontend/chat_render.py``): the model's
        template with ``tools``, ``documents``, ``chat_template_kwargs``, ``add_generation_prompt`` and
        ``continue_final_message``. A request's own ``chat_template`` is never rendered here (the server
        judges whether it trusts one); a template that fails on the request falls back to its text."""
        conv = conversation(doc.get("messages") or ())
        extra = doc.get("chat_template_kwargs")
        kwargs: dict[str, Any] = dict(extra) if isinstance(extra, dict) else {}
        try:
            text = self._tok.apply_chat_template(
                conv, tools=template_tools(doc.get("tools")), documents=doc.get("documents") or None, tokenize=False,
                add_generation_prompt=bool(doc.get("add_generation_prompt", True)),
                continue_final_message=bool(doc.get("continue_final_message", False)), **kwargs)
        except Exception as exc:  # the server will say what is wrong; routing needs only some prefix
            log.debug("chat template failed on a relayed request (%r): hashing its text alone", exc)
            try:
                text = self.render_chat([ChatMessage(str(m["role"]), m["content"]) for m in conv])
            except Exception:  # a template that refuses even that (a role it does not know)
                text = "\n".join(m["content"] for m in conv)
        assert isinstance(text, str), "apply_chat_template(tokenize=False) returns text"
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def decoder(self) -> StreamDecoder:
        return _HfStreamDecoder(self)


class _HfStreamDecoder:
    """Incremental detokenization: text is emitted once it can no longer change.

    A BPE piece can be part of a multi-byte character, and some tokenizers merge text across token
    boundaries, so each step decodes a short window (from ``_prefix`` to the end) and emits what
    grew beyond the previous window's text, holding back a trailing U+FFFD (an incomplete
    character). Work per step is bounded by the window, not the sequence length.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_tok")

    def __init__(self, tok: HfTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this are already emitted

    def feed(self, token_ids: Sequence[int]) -> str:
        # One token at a time, as vLLM's detokenizer (``tokenizers``' DecodeStream) steps: a chunk of
        # several tokens whose last one ends inside a character would otherwise hold back the text of
        # all of them, and at the end of a stream, where the incomplete character is dropped, lose it.
        if len(token_ids) == 1:
            return self._step(token_ids[0])
        return "".join([self._step(t) for t in token_ids])

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(done) :] if len(text) > len(done) else ""
