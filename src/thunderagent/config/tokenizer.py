"""How the frontend tokenizes prompts: a thread pool for long ones, a cache of recent conversations' token ids."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from thunderagent.config._base import _Strict


class TokenizerConfig(_Strict):
    """``frontend/tokenize_pool.py`` and ``frontend/token_cache.py``."""

    threads: int = Field(2, ge=0, le=64, description="threads that render and tokenize long prompts off the event "
                         "loop (0: every prompt on the loop)")
    offload_bytes: int = Field(32768, ge=0, description="request bodies at least this long are tokenized on those "
                               "threads; shorter ones on the loop (a thread hop costs more than they do)")
    prefix_cache_mb: float = Field(64.0, ge=0, description="memory for the token ids of recent long chat prompts, "
                                   "so that a conversation's next turn tokenizes only what it adds (a model's "
                                   "tokenizer, `model`; 0: off)")

    @field_validator("offload_bytes")
    @classmethod
    def _needs_threads(cls, v: int, info: ValidationInfo) -> int:
        if v != cls.model_fields["offload_bytes"].default and info.data.get("threads") == 0:
            raise ValueError("acts only with threads > 0 (threads: 0 tokenizes every prompt on the event loop)")
        return v
