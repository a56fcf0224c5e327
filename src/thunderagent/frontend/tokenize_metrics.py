"""Scrape-time metrics of prompt tokenization: the tokenize pool's offloads and the tokenizer's prefix cache.

Read from the plain counters the pool and the cache keep (no per-request Prometheus call on a thread of the pool).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from thunderagent.frontend.token_cache import PrefixTokenCache
from thunderagent.frontend.tokenize_pool import TokenizePool


class TokenizeCollector(Collector):
    def __init__(self, pool: TokenizePool, tokenizer: object) -> None:
        self.pool = pool
        self.tokenizer = tokenizer  # its ``cache`` is read at each scrape: it turns None if a check finds it wrong

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("thunderagent_tokenize_offloaded", "Prompts rendered and tokenized on the tokenize "
                                  "pool's threads (control_plane.tokenizer)", value=self.pool.offloaded)
        cache = getattr(self.tokenizer, "cache", None)
        yield GaugeMetricFamily("thunderagent_tokenizer_prefix_cache_enabled", "1 while the tokenizer's prefix cache "
                                "is on (off: not configured, no model tokenizer, or its probe or a check failed)",
                                value=float(isinstance(cache, PrefixTokenCache)))
        if not isinstance(cache, PrefixTokenCache):
            return
        yield CounterMetricFamily("thunderagent_tokenizer_prefix_lookups", "Long chat prompts looked up in the "
                                  "prefix cache", value=cache.lookups)
        yield CounterMetricFamily("thunderagent_tokenizer_prefix_hits", "Long chat prompts that reused a cached "
                                  "prompt's token ids", value=cache.hits)
        yield CounterMetricFamily("thunderagent_tokenizer_prefix_reused_tokens", "Token ids reused from the prefix "
                                  "cache instead of tokenized again", value=cache.reused_tokens)
        yield GaugeMetricFamily("thunderagent_tokenizer_prefix_cache_bytes", "Bytes the prefix cache holds (text + "
                                "4 a token id)", value=cache.nbytes)
