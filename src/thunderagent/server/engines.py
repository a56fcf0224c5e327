"""The fleet ``thunderagent serve`` runs: simulated workers, or real engine servers (vLLM, SGLang)
with the model's own tokenizer."""

from __future__ import annotations

from thunderagent.config import Config, Policy
from thunderagent.engine.sglang import sglang_factory
from thunderagent.engine.vllm import engine_factory
from thunderagent.server.fleet import Fleet
from thunderagent.server.tokenizer import Tokenizer


def load_tokenizer(cfg: Config) -> Tokenizer | None:
    """The model's tokenizer when ``cfg.model`` names a model directory (blocking: call it before
    the server starts), else None (the fleet's byte tokenizer)."""
    if cfg.model is None:
        return None
    from thunderagent.server.hf_tokenizer import HfTokenizer

    return HfTokenizer(cfg.model)


def build_fleet(cfg: Config, *, policy: Policy | None = None, tokenizer: Tokenizer | None = None) -> Fleet:
    fleet = Fleet(cfg, policy=policy, tokenizer=tokenizer or load_tokenizer(cfg))
    fleet.factories["vllm"] = engine_factory(cfg)
    fleet.factories["sglang"] = sglang_factory(cfg)
    return fleet
