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
import threading
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from thunderagent.frontend.chat_render import conversation, developer_as_system, template_tools
from thunderagent.frontend.token_cache import PrefixTokenCache
from thunderagent.frontend.tokenizer import ChatMessage, StreamDecoder

log = logging.getLogger(__name__)


#: rendered chat prompts shorter than this are tokenized whole (the cache pays on long, growing conversations)
PREFIX_CACHE_MIN_CHARS = 4096
#: reuses checked against a whole tokenization before the cache is trusted (the probe at start checks most)
VERIFY_FIRST = 4
#: at most one line cut per this many characters: a next turn tokenizes at most about this much of the text it
#: shares again, and a long prompt keeps a few hundred cuts, not one per line
LINE_CUT_CHARS = 1024
#: the line cut probe's text: lines that start with words, digits, punctuation, quotes and non-ASCII letters, after
#: blank lines, trailing spaces, tabs and a CRLF (the cases where a newline is one piece with its neighbours)
_LINE_PROBE = ("def f(x):\n    return x  \n\n\tindented\nÜber 12345 words.\n.punct\n  two\r\nwindows\n\n\n"
               "three blank\n1 digit\n'quote\n\"dq\" end\n\u00a0nbsp\n-- dash\nlast")
#: what the probe puts after a line cut's first character (a next prompt parts from the kept one there)
_LINE_PROBE_TAILS = ("", "x", " tail", "\n", "\n\n  z", "...!", "'s", "12")


class HfTokenizer:
    def __init__(self, model_dir: str | Path, prefix_cache_bytes: int = 64 << 20) -> None:
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
        self._system_first: bool | None = None  # probed once, when first asked (Messages API requests)
        self._thinking_off: str | None = None
        # ``tokenizers``' own object: its encode_batch releases the GIL, so a request tokenized on a thread of
        # the frontend's tokenize pool (frontend/tokenize_pool.py) leaves the event loop running meanwhile
        self._fast: Any = getattr(self._tok, "_tokenizer", None)
        self._added = frozenset(int(i) for i in getattr(self._tok, "added_tokens_decoder", {}))
        self._lock = threading.Lock()  # (the cache is shared by the pool's threads)
        self._verify_left = VERIFY_FIRST
        self.cache: PrefixTokenCache | None = None
        self._affix: tuple[list[int], list[int]] | None = None  # what encoding with special tokens adds around a text
        self._line_cuts = False  # cut at lines' first tokens too (probed: ``_line_cut_problem``)
        self._line_probes: list[str] = []  # a rendered conversation (``_prefix_split_problem``), probed for lines too
        if prefix_cache_bytes > 0:
            why = self._prefix_split_problem()
            if why is None:
                self.cache = PrefixTokenCache(prefix_cache_bytes)
                self._affix = self._special_affix()
                line_why = self._line_cut_problem()
                self._line_cuts = line_why is None
                if line_why is not None:
                    log.info("tokenizer prefix cache of %s cuts at added tokens only: %s", self.name, line_why)
            else:
                log.info("tokenizer prefix cache off for %s: %s", self.name, why)

    def encode(self, text: str) -> list[int]:
        return self._encode(text, True)

    def encode_many(self, texts: Sequence[str], special: bool = True) -> list[list[int]]:
        """Each text's ids, special tokens added unless ``special`` is False, in one ``encode_batch`` call
        (``tokenizers`` runs a batch on its threads, the GIL released)."""
        if self._fast is not None:
            return [list(e.ids) for e in self._fast.encode_batch(list(texts), add_special_tokens=special)]
        return [self._encode(t, special) for t in texts]

    def encode_prompt(self, text: str, scope: str | None = None) -> list[int]:
        """A completion request's text prompt, as :meth:`encode` gives it (special tokens added); a long one through
        the prefix cache of ``scope`` (an RL rollout's growing prompt, a rendered chat sent as text)."""
        if self._affix is None or self.cache is None or len(text) < PREFIX_CACHE_MIN_CHARS:
            return self.encode(text)
        head, tail = self._affix
        return [*head, *self._encode_chat(text, scope), *tail]

    def _special_affix(self) -> tuple[list[int], list[int]] | None:
        """The ids encoding with special tokens puts before and after a text's own (a BOS, ...), when they are the
        same for every probe text (a post-processor that adds them around the text), else None."""
        found = set()
        for text in ("x", "Hello world", " two  words\n", "end"):
            whole, bare = self._encode(text, True), self._encode(text, False)
            at = next((i for i in range(len(whole) - len(bare) + 1) if whole[i : i + len(bare)] == bare), None)
            if at is None or not bare:
                return None
            found.add((tuple(whole[:at]), tuple(whole[at + len(bare) :])))
        if len(found) != 1:
            return None
        head, tail = found.pop()
        return list(head), list(tail)

    def _encode(self, text: str, special: bool) -> list[int]:
        """``text``'s ids, the tokenizer's special tokens added when ``special`` (a chat template writes its own)."""
        if self._fast is not None:
            return list(self._fast.encode_batch([text], add_special_tokens=special)[0].ids)
        return list(self._tok.encode(text, add_special_tokens=special))

    def _encode_cuts(self, text: str, char0: int, token0: int, line_every: int = LINE_CUT_CHARS,
                     lines: bool | None = None) -> tuple[list[int], list[int], list[int], list[int]]:
        """``text``'s ids and its cuts, as character and token positions offset by ``char0`` / ``token0``, with their
        needs (``frontend/token_cache.py``): where a token that follows an added token starts (need: that
        position), and with ``lines`` (default: when the probe passed) a line's first token, at most one per
        ``line_every`` characters (need: one character more)."""
        enc = self._fast.encode_batch([text], add_special_tokens=False)[0]
        ids: list[int] = enc.ids
        added, last = self._added, len(ids) - 1
        cuts: list[tuple[int, int, int]] = []
        for i in [i for i, t in enumerate(ids) if t in added and i < last]:
            span = enc.token_to_chars(i + 1)
            if span is not None:
                cuts.append((span[0], i + 1, span[0]))
        if self._line_cuts if lines is None else lines:
            cuts += [(c, k, c + 1) for c, k in _line_starts(text, enc, line_every)]
            cuts.sort()
        return (ids, [char0 + c for c, _, _ in cuts], [token0 + k for _, k, _ in cuts],
                [char0 + n for _, _, n in cuts])

    def _encode_chat(self, text: str, scope: str | None) -> list[int]:
        """A rendered chat prompt's ids (no special tokens added: the template wrote them). A long one reuses the ids
        of a recent prompt of its ``scope`` (its cache salt) it extends, up to their last shared added token
        (``frontend/token_cache.py``)."""
        cache = self.cache
        if cache is None or len(text) < PREFIX_CACHE_MIN_CHARS:
            return self._encode(text, False)
        with self._lock:
            reuse = cache.lookup(text, scope)
        if reuse is None:
            ids, cut_chars, cut_tokens, cut_needs = self._encode_cuts(text, 0, 0)
            out = array("I", ids)
        else:
            more, more_chars, more_tokens, more_needs = self._encode_cuts(text[reuse.chars :], reuse.chars,
                                                                          len(reuse.ids))
            out = reuse.ids + array("I", more)
            cut_chars, cut_tokens = reuse.cut_chars + more_chars, reuse.cut_tokens + more_tokens
            cut_needs = reuse.cut_needs + more_needs
        ids = out.tolist()
        if reuse is not None and self._verify_left > 0:
            self._verify_left -= 1
            whole = self._encode(text, False)
            if whole != ids:
                log.warning("tokenizer prefix cache off for %s: a prompt tokenized from a cached prefix differed "
                            "from its whole tokenization", self.name)
                self.cache = None
                return whole
        with self._lock:
            cache.store(text, out, cut_chars, cut_tokens, scope, cut_needs, reuse)
        return ids

    def _prefix_split_problem(self) -> str | None:
        """None when the pieces after an added token tokenize alone as they do in the whole text (checked on
        probe texts around the tokenizer's special tokens and on a rendered conversation), else why not."""
        if self._fast is None or not hasattr(self._fast, "encode_batch"):
            return "not a fast (tokenizers) tokenizer"
        specials = [t for t in self._tok.all_special_tokens if t] or [
            str(a.content) for a in getattr(self._tok, "added_tokens_decoder", {}).values()]
        if not specials:
            return "it has no added tokens to cut at"
        pieces = ["Hello world", " leading space", "\nnewline first", "  two spaces\tand a tab", "Ünïcödé ok?",
                  "end"]
        probes = ["".join(p + specials[k % len(specials)] for k, p in enumerate(pieces)) + "tail"]
        try:
            probes.append(self._render([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": " Hi,  there!\n"},
                                        {"role": "assistant", "content": "Hello: 1 2 3."},
                                        {"role": "user", "content": "\tand you?"}], {}))
        except Exception as exc:  # (a template that will not render this conversation: the first probe counts)
            log.debug("the prefix-cache probe's conversation did not render (%r)", exc)
        self._line_probes = probes[1:]  # (the rendered conversation, for the line cut probe)
        checked = 0
        for text in probes:
            whole, cut_chars, cut_tokens, _ = self._encode_cuts(text, 0, 0, lines=False)
            for c, k in zip(cut_chars, cut_tokens, strict=True):
                if whole[:k] + self._encode(text[c:], False) != whole:
                    return f"the text after an added token tokenizes differently alone (at character {c})"
                checked += 1
        return None if checked else "no probe text had a cut"

    def _line_cut_problem(self) -> str | None:
        """None when a line's first token is a cut (``_line_starts``) for this tokenizer, else why not. On probe
        texts, with several texts after each line's first character (what a next prompt may add): the
        pre-tokenizer must start a piece there (so no merge joins the line to the newline before it, whatever
        follows), and the text tokenized whole must give the probe's ids before the cut plus its own rest
        tokenized alone. Holds for the byte-level BPE tokenizers' split patterns (GPT-2's, Llama 3's, Qwen's,
        DeepSeek's: a newline is never one piece with a character that is not whitespace after it)."""
        pre = getattr(self._fast, "pre_tokenizer", None)
        if pre is None:
            return "no pre-tokenizer: a merge may join a line to the newline before it"
        checked = 0
        for text in (_LINE_PROBE, *self._line_probes):
            enc = self._fast.encode_batch([text], add_special_tokens=False)[0]
            whole: list[int] = enc.ids
            for c, k in _line_starts(text, enc, 1):  # (every line cut of the probe)
                for tail in _LINE_PROBE_TAILS:
                    grown = text[: c + 1] + tail
                    if c not in {span[0] for _, span in pre.pre_tokenize_str(grown)}:
                        return f"its pre-tokenizer does not start a piece at a line's start (character {c})"
                    if whole[:k] + self._encode(grown[c:], False) != self._encode(grown, False):
                        return f"a line tokenizes differently alone (character {c} followed by {tail!r})"
                checked += 1
        return None if checked else "no probe line had a cut"

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        conv = [{"role": m.role, "content": m.content} for m in messages]
        text = self._tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert isinstance(text, str), "apply_chat_template(tokenize=False) returns text"
        return text

    def apply_chat_template(self, messages: Sequence[ChatMessage], scope: str | None = None) -> list[int]:
        return self._encode_chat(self.render_chat(messages), scope)

    def apply_openai_chat(self, doc: Mapping[str, Any], keep_call_order: bool = False,
                          scope: str | None = None) -> list[int]:
        """A relayed chat request rendered as vLLM renders it (``frontend/chat_render.py``): the model's
        template with ``tools`` and the template arguments (:func:`template_kwargs`). A request's own
        ``chat_template`` is never rendered here (the server judges whether it trusts one); a template
        that fails on the request falls back to its text. ``keep_call_order``: messages vLLM builds itself
        (a Responses request's) keep their tool calls' key order."""
        conv = developer_as_system(conversation(doc.get("messages") or (), keep_call_order), self._tok.chat_template)
        try:
            text = self._render(conv, doc)
        except Exception as exc:  # the server will say what is wrong; routing needs only some prefix
            log.debug("chat template failed on a relayed request (%r): hashing its text alone", exc)
            try:
                text = self.render_chat([ChatMessage(str(m["role"]), m["content"]) for m in conv])
            except Exception:  # a template that refuses even that (a role it does not know)
                text = "\n".join(m["content"] for m in conv)
        return self._encode_chat(text, scope)

    def _render(self, conv: list[dict[str, Any]], doc: Mapping[str, Any]) -> str:
        text = self._tok.apply_chat_template(conv, tools=template_tools(doc.get("tools")), tokenize=False,
                                             **template_kwargs(doc))
        assert isinstance(text, str), "apply_chat_template(tokenize=False) returns text"
        return text

    @property
    def system_first(self) -> bool:
        """Whether the template needs every system message first: vLLM's probe (it renders ``[system, user,
        system, user]`` in a sandbox; a template that raises, or none, needs them merged), so that the
        Messages API's inline system messages are placed as the server places them."""
        if self._system_first is None:
            self._system_first = _needs_system_first(self._tok.chat_template)
        return self._system_first

    def thinking_off_effort(self) -> str:
        """The ``reasoning_effort`` vLLM's Messages API gives ``thinking: disabled``: ``none``, or ``low`` when the
        template refuses ``none`` or renders it as one of the efforts (it ignores it)."""
        if self._thinking_off is None:
            def probe(effort: str) -> list[int] | None:
                try:
                    text = self._render([{"role": "user", "content": "Hi"}], {"reasoning_effort": effort})
                except Exception:
                    return None
                return list(self._tok.encode(text, add_special_tokens=False))

            off = probe("none")
            same = off is None or any(probe(e) == off for e in ("low", "medium", "high", "xhigh", "max"))
            self._thinking_off = "low" if same else "none"
        return self._thinking_off

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def decoder(self) -> StreamDecoder:
        return _HfStreamDecoder(self)


def _line_starts(text: str, enc: Any, every: int) -> list[tuple[int, int]]:
    """Lines' first tokens in ``text`` (``enc``: its encoding), as (character, token) positions: a token that
    starts right after a newline, on a character that is not whitespace (a newline followed by spaces or more
    newlines is one piece with them), never at the text's end: at most one per ``every`` characters, and the
    text's last three (a next turn that extends the text then tokenizes its last line again, not ``every``
    characters; three, because a chat template closes a message with a line or two that the next turn
    replaces). The characters are found with ``str.find`` and only the chosen ones are mapped to tokens: a
    100k-token prompt costs a few hundred lookups, not one per token."""

    def at(c: int) -> int | None:  # the token starting at character c, if one does and c starts a line
        if c >= len(text) or text[c].isspace():
            return None
        k = enc.char_to_token(c)
        return k if k is not None and k > 0 and enc.token_to_chars(k)[0] == c else None

    out: list[tuple[int, int]] = []
    pos = max(0, every - 1)
    while (nl := text.find("\n", pos)) >= 0:
        k = at(nl + 1)
        if k is not None:
            out.append((nl + 1, k))
        pos = nl + (every if k is not None else 1)
    have = {c for c, _ in out}
    last: list[tuple[int, int]] = []
    end, found = len(text) - 1, 0
    for _ in range(8):  # the last few line starts (a template's closing lines follow the text a next turn extends)
        nl = text.rfind("\n", 0, end)
        if nl < 0:
            break
        if nl + 1 in have:
            found += 1
        elif (k := at(nl + 1)) is not None:
            last.append((nl + 1, k))
            found += 1
        if found == 3:
            break
        end = nl
    return sorted(out + last) if last else out


def template_kwargs(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The template's arguments for a chat request, merged as vLLM 0.32 merges them (``build_chat_params``):
    ``chat_template_kwargs``, overridden by the request's ``add_generation_prompt`` (default true),
    ``continue_final_message``, ``documents`` and ``reasoning_effort`` when set, and ``enable_thinking``
    derived from ``reasoning_effort`` unless the kwargs set it."""
    extra = doc.get("chat_template_kwargs")
    kwargs: dict[str, Any] = dict(extra) if isinstance(extra, dict) else {}
    own = {"add_generation_prompt": doc.get("add_generation_prompt", True),
           "continue_final_message": doc.get("continue_final_message", False),
           "documents": doc.get("documents"), "reasoning_effort": doc.get("reasoning_effort")}
    effort = own["reasoning_effort"]
    if effort is not None and "enable_thinking" not in kwargs:
        own["enable_thinking"] = effort != "none"
    kwargs.update((k, v) for k, v in own.items() if v is not None and v != "auto")
    return kwargs


def _needs_system_first(template: object) -> bool:
    if isinstance(template, dict):  # named templates: the default and the tool-use one
        return any(_needs_system_first(template.get(k)) for k in ("default", "tool_use") if k in template)
    if not isinstance(template, str) or not template:
        return True
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    try:
        env.from_string(template).render(messages=[{"role": r, "content": "t"} for r in ("system", "user") * 2],
                                          add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


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
