"""Long prompts are rendered and tokenized on a small thread pool, off the event loop.

Tokenizing a 100k-token prompt with a model's tokenizer takes about 140 ms of CPU here (``bench/tokenize_prefix.py``);
on the event loop that stalls every other request and stream the frontend carries for as long. ``tokenizers``
releases the GIL while it encodes (``HfTokenizer`` calls its ``encode_batch``), so on a thread of this pool the loop
keeps serving meanwhile. Short prompts stay on the loop: a hop to a thread costs more than they do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class TokenizePool:
    def __init__(self, threads: int, offload_bytes: int) -> None:
        self.offload_bytes = offload_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize") if threads > 0 else None
        self.offloaded = 0

    async def run(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``: on the pool when the request's body is at least ``offload_bytes`` long (``size``),
        else here. Its exception, if any, is raised here either way."""
        if self._pool is None or size < self.offload_bytes:
            return fn(*args, **kwargs)
        self.offloaded += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
