"""The garbage-collector policy of the long-running processes (``serve``, ``frontend``, ``worker``).

Why: with CPython's default thresholds (700, 10, 10) a serving process runs a young collection every 700
container allocations, and a full one whenever the objects that survived since the last one reach a quarter
of the heap. A router's heap grows with its index and its requests in flight, and a full collection
walks all of it, in one go, on the event loop: measured on the scheduler's own path
(``bench/scheduler_overhead.py``, 1,000 held requests and 1,000 agent programs), it was most of the
enqueue + dispatch p99 (1.2-1.6 ms against 0.6-0.8 ms with the collector off).

What: a young-generation threshold of :data:`GEN0_THRESHOLD` (full collections come that many times
less often; a young one then walks at most that many objects, ~1 ms), and ``gc.freeze()`` once start-up
is done, so what it built (modules, the config, a model's tokenizer, the app) is never walked again.
Reference counting still frees a request's acyclic garbage at once; only cycles wait longer.
"""

from __future__ import annotations

import gc

#: young container allocations between two collections (CPython's default: 700)
GEN0_THRESHOLD = 20_000


def tune_gc() -> None:
    """Apply the policy: call once, after start-up (what exists then is frozen out of every collection)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
