"""The model's own tokenizer and chat template (a locally trained byte-level BPE, no download)."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path

import pytest

from tests.engines.tiny_model import build_tokenizer
from thunderagent.frontend.hf_tokenizer import HfTokenizer
from thunderagent.frontend.tokenizer import ChatMessage


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return HfTokenizer(d)


def test_chat_template_and_eos(tok: HfTokenizer) -> None:
    text = tok.render_chat([ChatMessage("system", "be brief"), ChatMessage("user", "the router")])
    assert text == "<|system|>\nbe brief<|end|>\n<|user|>\nthe router<|end|>\n<|assistant|>\n"
    ids = tok.apply_chat_template([ChatMessage("user", "the router")])
    assert tok.decode(ids) == "\nthe router\n\n"  # specials are skipped when decoding
    assert tok.eos_token_id == 1


def test_chat_prompts_are_prefix_stable(tok: HfTokenizer) -> None:
    """Turn k's prompt is a token prefix of turn k+1's: the engine's cached blocks stay hits."""
    conv = [ChatMessage("system", "you route requests"), ChatMessage("user", "where does this go?")]
    first = tok.apply_chat_template(conv)
    second = tok.apply_chat_template([*conv, ChatMessage("assistant", "to the worker holding it"),
                                      ChatMessage("user", "and then?")])
    assert second[: len(first)] == first


@pytest.mark.parametrize("text", ["plain words of the router", "Ünïcödé ✓ 漢字 🙂 mixed", "a\nb  c\t!"])
def test_incremental_decoding_matches_full_decode(tok: HfTokenizer, text: str) -> None:
    ids = tok.encode(text)
    for step in (1, 2, 3):
        dec = tok.decoder()
        out = "".join(dec.feed(ids[i : i + step]) for i in range(0, len(ids), step)) + dec.flush()
        assert out == tok.decode(ids) == text


def test_bad_model_dirs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        HfTokenizer(tmp_path / "nope")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        HfTokenizer(tmp_path)


def test_text_across_a_cut_equals_vllms(tok: HfTokenizer) -> None:
    """A stream whose engine text stops at a cut (a migration) and is decoded here from then on ends
    with exactly the text vLLM streams for an unbroken run. vLLM 0.32 detokenizes with ``tokenizers``'
    ``DecodeStream`` primed with the prompt, one token at a time; its stream carries chunks of several
    tokens under load. Random ids (special ones included: skipped), every cut, chunks of 1-5 tokens:
    priming the frontend with the last chunk repeated its text in about one cut in three, and a last
    chunk ending inside a character lost the text of the chunk's other tokens."""
    from tokenizers.decoders import DecodeStream

    from thunderagent.frontend.streaming import stream_text
    from thunderagent.types import FinishReason, TokenOutput

    rng = random.Random(5)
    raw = tok._tok._tokenizer
    vocab = raw.get_vocab_size()
    prompt = tok.encode("7: the router sends every request")
    bad = []
    for _ in range(10):
        ids = [rng.randrange(2, vocab) for _ in range(30)]  # 0 and 1 are bos and eos
        vllm = DecodeStream(ids=prompt, skip_special_tokens=True)
        texts = [vllm.step(raw, t) or "" for t in ids]
        for cut in range(1, len(ids)):
            sizes = []
            while sum(sizes) < len(ids):
                sizes.append(min(rng.randint(1, 5), len(ids) - sum(sizes)))
            outs, i = [], 0
            for n in sizes:
                parts = [(i, min(i + n, cut)), (max(i, cut), i + n)] if i < cut < i + n else [(i, i + n)]
                outs += [TokenOutput("r", ids[a:b], 0.0, len(prompt), 0, b == len(ids),
                                     FinishReason.LENGTH if b == len(ids) else None,
                                     text="".join(texts[a:b]) if b <= cut else None) for a, b in parts]
                i += n

            async def it(outs: list[TokenOutput] = outs):  # type: ignore[no-untyped-def]
                for o in outs:
                    yield o

            async def text() -> str:
                return "".join([c.text async for c in stream_text(it(), tok.decoder(), [])])

            if asyncio.run(text()) != "".join(texts):
                bad.append((ids, cut, sizes))
    assert not bad, f"{len(bad)} cuts: text != vLLM's, first: {bad[0]}"


def _growing_chat(turns: int) -> list[dict]:
    """A tool-calling agent's requests, each the previous one plus a reply with a tool call and its result."""
    msgs: list[dict] = [{"role": "system", "content": "the router sends every request " * 150}]
    out = []
    for k in range(turns):
        msgs.append({"role": "user", "content": f"turn {k}: where does the cache hold this? " * 20})
        out.append({"messages": list(msgs), "tools": [{"type": "function", "function": {"name": "grep"}}]})
        msgs.append({"role": "assistant", "content": f"looking {k}", "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": "grep", "arguments": f'{{"q": "{k}"}}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": f"result {k} Ünïcödé\n\t ok " * 30})
    return out


def test_a_growing_conversation_tokenizes_only_what_each_turn_adds(tok: HfTokenizer, tmp_path: Path) -> None:
    """The prefix cache (``frontend/token_cache.py``) gives exactly the ids of a whole tokenization, turn by turn, and
    reuses the previous turn's ids: all but what follows its last added token."""
    build_tokenizer(tmp_path)
    cached, plain = HfTokenizer(tmp_path), HfTokenizer(tmp_path, prefix_cache_bytes=0)
    assert cached.cache is not None and plain.cache is None
    requests = _growing_chat(8)
    for k, doc in enumerate(requests):
        ids = cached.apply_openai_chat(doc)
        assert ids == plain.apply_openai_chat(doc), k
    cache = cached.cache
    assert cache is not None and (cache.lookups, cache.hits, len(cache)) == (8, 7, 1)  # one conversation: one entry
    # each turn reused all of the one before it but its last token, the newline after "<|assistant|>" (the reply
    # follows it now: the piece after the added token is tokenized again)
    assert cache.reused_tokens == sum(len(plain.apply_openai_chat(d)) - 1 for d in requests[:-1])
    # a chat of the token path and a short prompt go through it too (short ones are tokenized whole, uncached)
    msgs = [ChatMessage("system", "x " * 3000), ChatMessage("user", "hi")]
    assert cached.apply_chat_template(msgs) == plain.apply_chat_template(msgs)
    assert cached.apply_chat_template(msgs[1:]) == plain.apply_chat_template(msgs[1:])
    assert cached.encode("a completion prompt") == list(plain._tok.encode("a completion prompt"))


def test_a_reuse_that_differs_from_the_whole_tokenization_turns_the_cache_off(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    build_tokenizer(tmp_path)
    tok = HfTokenizer(tmp_path)
    first, second = _growing_chat(2)
    ids = tok.apply_openai_chat(first)
    real = tok._encode_cuts
    monkeypatch.setattr(tok, "_encode_cuts", lambda text, c0, t0: ([1, *real(text, c0, t0)[0]], [], [], []))
    whole = HfTokenizer(tmp_path, prefix_cache_bytes=0).apply_openai_chat(second)
    assert tok.apply_openai_chat(second) == whole and tok.cache is None  # checked, found wrong: off
    assert ids == HfTokenizer(tmp_path, prefix_cache_bytes=0).apply_openai_chat(first)


def test_a_tokenizer_whose_pieces_tokenize_differently_alone_gets_no_cache(tmp_path: Path) -> None:
    """SentencePiece-style tokenizers prepend a space to the text's first piece only: the text after an added token,
    tokenized alone, would get one too. The probe at start finds that and leaves the cache off."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.engines.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, training_text

    sp = Tokenizer(models.BPE())
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    sp.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    sp.train_from_iterator(training_text(500), trainer=trainers.BpeTrainer(vocab_size=300,
                                                                           special_tokens=SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(tmp_path))
    tok = HfTokenizer(tmp_path)
    assert tok.cache is None
    doc = _growing_chat(1)[0]
    assert tok.apply_openai_chat(doc) == list(fast.encode(tok._render(
        __import__("thunderagent.frontend.chat_render", fromlist=["conversation"]).conversation(doc["messages"]),
        doc), add_special_tokens=False))


def test_a_conversation_reuses_only_its_own_scopes_ids(tmp_path: Path) -> None:
    """The scope is the request's cache salt (its tenant's with API keys on): another tenant sending the same
    conversation tokenizes it whole."""
    build_tokenizer(tmp_path)
    tok = HfTokenizer(tmp_path)
    first, second = _growing_chat(2)
    tok.apply_openai_chat(first, scope="tenant:a")
    assert tok.apply_openai_chat(second, scope="tenant:b") == tok.apply_openai_chat(second, scope="tenant:a")
    assert tok.cache is not None and (tok.cache.lookups, tok.cache.hits) == (3, 1)  # (only tenant a's second turn)


def test_a_growing_completion_prompt_goes_through_the_cache_with_its_special_tokens(tmp_path: Path) -> None:
    """``encode_prompt`` (a completion request's text): the ids ``encode`` gives, the BOS the tokenizer's
    post-processor adds included, a long prompt through the cache of its scope."""
    from tokenizers import Tokenizer, processors

    build_tokenizer(tmp_path)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = HfTokenizer(tmp_path)
    assert tok.cache is not None and tok._affix == ([0], [])
    plain = HfTokenizer(tmp_path, prefix_cache_bytes=0)
    assert plain._affix is None
    prompts = [plain.render_chat([ChatMessage(m["role"], m["content"]) for m in doc["messages"]])
               for doc in _growing_chat(4)]
    for text in prompts:
        ids = tok.encode_prompt(text, scope="s")
        assert ids == plain.encode(text) == list(plain._tok.encode(text)) and ids[0] == 0
    assert (tok.cache.lookups, tok.cache.hits) == (4, 3)
    assert tok.encode_prompt("short") == plain.encode_prompt("short") == plain.encode("short")


# -- line cuts: a prompt that grows inside one message or one text ------------------------------------------------

_PIECES = ("word", " word", "Über", " 123", "4567", ".", "!?", "'s", " 'quote'", "\n", "\n\n", "\r\n", "  ", "\t",
           " \n", "\n  ", "-", "(x)", "é", "日本", "\u00a0", "def f():", "    return", ";\n", ".\n", "\n1", "\nx")
#: Llama 3's split pattern (also Qwen 2's and DeepSeek V3's, up to details): a split before the byte-level step
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _random_text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(_PIECES) for _ in range(pieces))


def _tokenizer_dir(tmp_path: Path, kind: str) -> Path:
    """The tests' byte-level BPE (GPT-2's split pattern), or one split with Llama 3's pattern first, or one with no
    split at all (merges cross newlines), each trained on text full of line breaks."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.engines.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, training_text

    d = tmp_path / kind
    if kind == "gpt2":
        build_tokenizer(d)
        return d
    tok = Tokenizer(models.BPE())
    if kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # "unsplit": the whole text between added tokens is one piece
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    rng = random.Random(5)
    corpus = training_text(2000) + [_random_text(rng, 40) for _ in range(2000)] + ["\nline\nlast\nx\n1"] * 500
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(d))
    return d


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_line_cuts_give_the_whole_tokenizations_ids_on_random_text(tmp_path: Path, kind: str) -> None:
    """Random texts full of line breaks, blank lines, CRLFs, trailing spaces and non-ASCII, grown and then changed
    inside: each tokenized through the cache (no check against a whole tokenization: ``_verify_left`` 0) gives the
    ids of a whole tokenization, and reuses the kept text's ids up to a line cut."""
    d = _tokenizer_dir(tmp_path, kind)
    cached, plain = HfTokenizer(d), HfTokenizer(d, prefix_cache_bytes=0)
    assert cached.cache is not None and cached._line_cuts
    cached._verify_left = 0
    rng = random.Random(11)
    reused = tokens = 0
    for k in range(40):
        text = _random_text(rng, 2500)  # (~8k characters: over PREFIX_CACHE_MIN_CHARS, cut or not)
        texts = [text, text + _random_text(rng, 30), text + _random_text(rng, 200)]
        at = rng.randrange(len(text) * 3 // 4, len(text))
        texts += [text[:at] + _random_text(rng, 20), text[:at] + "\n\n" + _random_text(rng, 20),
                  text[:at] + "  " + _random_text(rng, 20)]
        for n, t in enumerate(texts):
            before = cached.cache.reused_tokens  # type: ignore[union-attr]
            ids = cached.encode_prompt(t, scope=str(k))
            assert ids == plain.encode(t), (k, t[-60:])
            if n:
                reused += cached.cache.reused_tokens - before  # type: ignore[union-attr]
                tokens += len(ids)
    assert cached.cache is not None  # (never found wrong)
    assert cached.cache.hits == 40 * 5 and reused > 0.6 * tokens  # (the changed ones part a quarter from the end)


def test_one_growing_message_reuses_all_but_its_last_lines(tok: HfTokenizer, tmp_path: Path) -> None:
    """An agent that writes its whole transcript into one user message (no added token inside it to cut at): each
    step tokenizes the lines it adds and the last ~``LINE_CUT_CHARS`` before them, not the whole message."""
    from thunderagent.frontend.hf_tokenizer import LINE_CUT_CHARS

    build_tokenizer(tmp_path)
    lines_on, plain = HfTokenizer(tmp_path), HfTokenizer(tmp_path, prefix_cache_bytes=0)
    lines_off = HfTokenizer(tmp_path)
    lines_off._line_cuts = False
    transcript = "Task: fix the router.\n"
    reused = last = 0
    for step in range(8):
        transcript += "".join(f"Thought {step}.{i}: read the index, Über cached={i}\n  detail {i}\n\n"
                              for i in range(90))  # (~5k characters a step: the first is long enough to keep)
        doc = {"messages": [{"role": "system", "content": "You are an agent."},
                            {"role": "user", "content": transcript}]}
        ids = lines_on.apply_openai_chat(doc)
        assert ids == lines_off.apply_openai_chat(doc) == plain.apply_openai_chat(doc), step
        if step:
            # reused: the previous prompt's ids up to its last line's start (what follows it there, "<|end|>" and
            # the assistant header, changed)
            gained = lines_on.cache.reused_tokens - reused  # type: ignore[union-attr]
            assert last - 60 < gained < last, (step, gained, last)  # (its last two lines: ~45 tokens)
        reused, last = lines_on.cache.reused_tokens, len(ids)  # type: ignore[union-attr]
    assert lines_on.cache is not None and len(lines_on.cache) == 1  # each turn replaced the last (token_cache.py)
    # without line cuts only the system prompt and the user header before the message are reused
    assert lines_off.cache is not None and lines_off.cache.reused_tokens < 7 * 20
    # a long text keeps a line cut about every LINE_CUT_CHARS characters and its last line's
    text = lines_on.render_chat([ChatMessage("user", transcript)])
    cut_chars = lines_on._encode_cuts(text, 0, 0)[1]
    lines = [c for c in cut_chars if text[c - 1] == "\n"]
    assert [text[c : c + 12] for c in lines[-3:]] == ["Thought 7.89", "<|end|>\n<|as", "<|assistant|"]
    spaced = lines[:-3]
    assert len(spaced) == pytest.approx(len(text) / LINE_CUT_CHARS, rel=0.1)
    assert all(b - a >= LINE_CUT_CHARS for a, b in itertools.pairwise(spaced))


def test_a_tokenizer_whose_merges_cross_newlines_gets_no_line_cuts(tmp_path: Path) -> None:
    """Without a split pattern, BPE merges can join a newline with what follows it: the probe finds a line that
    tokenizes differently alone and cuts at added tokens only; the ids are still the whole tokenization's."""
    d = _tokenizer_dir(tmp_path, "unsplit")
    tok, plain = HfTokenizer(d), HfTokenizer(d, prefix_cache_bytes=0)
    assert tok.cache is not None and not tok._line_cuts
    rng = random.Random(2)
    text = _random_text(rng, 1500)
    for t in (text, text + "\nline\nlast", text + "\nx1"):
        assert tok.encode_prompt(t) == plain.encode(t)
