"""The model's own tokenizer and chat template (a locally trained byte-level BPE, no download)."""

from __future__ import annotations

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
