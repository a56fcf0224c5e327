"""A tiny random-weight Llama with a locally trained byte-level BPE tokenizer and a chat template.

Built from nothing on disk in a few seconds (numpy + safetensors for the weights, ``tokenizers`` for
the BPE, ``transformers`` for the config and tokenizer files): no download, no torch in the test
environment. vLLM serves it on the CPU. Shapes follow what the CPU build accepts: head_dim 64
(16 crashes its attention kernels), float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Prefix-stable: the prompt of turn k is a token prefix of the prompt of turn k+1 (every message
# ends with the special token <|end|> and a newline, so BPE merges never cross a message boundary).
# Tools, when a request has them, come first as a system block, and an assistant's tool calls after its
# text, both as JSON (as tool-calling templates render them), so relayed tool requests render for real.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (  # noqa: SIM905 (a sentence reads better than a list of 100 quoted words)
    "the router sends every request to the worker that already holds the longest cached prefix of its "
    "prompt weighed against load memory and queue depth so that computed blocks are reused and no worker "
    "drowns engines publish stored removed and cleared events with sequence numbers a gap triggers a "
    "replay or a resync tenants never share a prefix by accident conversations grow turn by turn agents "
    "call tools and wait while their cache is kept or dropped by policy quick brown fox jumps over lazy "
    "dog zero one two three four five six seven eight nine ten hundred thousand"
).split()


def training_text(lines: int = 4000, seed: int = 0) -> list[str]:
    """A small deterministic corpus (words of the domain, digits, punctuation, some UTF-8)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(lines):
        n = int(rng.integers(4, 16))
        words = [_WORDS[int(k)] for k in rng.integers(0, len(_WORDS), n)]
        out.append(" ".join(words) + f" {i}. Ünïcödé ok? yes!")
    return out


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|eos|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_tiny_llama(out_dir: str | Path, *, hidden: int = 128, heads: int = 2, layers: int = 2,
                     intermediate: int = 256, max_positions: int = 4096, seed: int = 0) -> Path:
    """Write config, weights (float32, N(0, 0.02)) and tokenizer into ``out_dir``; returns it."""
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    vocab = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]) + len(SPECIAL_TOKENS)
    vocab = (vocab + 63) // 64 * 64  # room for added tokens, aligned
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
        bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False, torch_dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(str(out))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32),
               "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(hidden, hidden),
            p + "self_attn.k_proj.weight": w(hidden, hidden),
            p + "self_attn.v_proj.weight": w(hidden, hidden),
            p + "self_attn.o_proj.weight": w(hidden, hidden),
            p + "mlp.gate_proj.weight": w(intermediate, hidden),
            p + "mlp.up_proj.weight": w(intermediate, hidden),
            p + "mlp.down_proj.weight": w(hidden, intermediate),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1]))
