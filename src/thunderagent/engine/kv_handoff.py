"""Prefill/decode disaggregation in the simulated engine: both sides of a KV handoff.

Kept apart from the engine's hot loop (``engine/simulated.py`` calls in at two points: an arrival with
``remote_decode`` or ``kv_from``, and :meth:`advance`'s outputs while remote prefill jobs are in).

* **Prefill side** (``EngineRequest.remote_decode``): the job runs as an ordinary request (the
  driver asks for one token); its finished output gets a :class:`KvTransfer` with the hashes of the
  prompt's full blocks, and those blocks stay pinned (referenced, not evictable) until the driver
  calls :meth:`release_transfer` when the transfer ended, as a real prefill worker keeps them for
  the decode worker to pull.
* **Decode side** (``EngineRequest.kv_from``): on arrival the transferred blocks the cache lacks are
  allocated and registered (a ``BlockStored`` event says so), then released into the prefix cache as
  its most recently used entries: admission counts them as cache hits, the first token costs one
  pass over the rest. If the pool is too full to take them the request computes its prompt (the
  transfer is wasted, counted in ``kv_import_failed``); if they are evicted before admission the
  same happens, by the ordinary prefix-cache rules.
"""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.engine.eviction import Eviction
from thunderagent.types import EngineRequest, FinishReason, KvTransfer, TokenOutput


class KvHandoff(Eviction):
    """A link of :class:`~thunderagent.engine.simulated.SimulatedEngine` (``engine/fields.py``; its state set by
    ``_handoff_init``)."""

    def _handoff_init(self) -> None:
        self._remote_jobs = {}
        self._pinned = {}
        self.kv_imported_blocks = 0  # blocks taken from transfers (not present before)
        self.kv_import_failed = 0  # kv_from requests whose blocks did not fit
        # The simulator moves a transfer on its virtual clock and unpins the blocks when it ends
        # (``release_transfer``). Served live, a simulated decode engine takes the blocks as it gets
        # the request, and nothing would ever unpin them (over NATS the prefill engine is in another
        # process): live engines leave them in the prefix cache unpinned.
        self.pin_transfers = False

    def _handoff_arrival(self, req: EngineRequest) -> None:
        if req.remote_decode:  # a prefill-only job: one token, then its KV is handed off
            req.max_tokens = 1
            self._remote_jobs[req.request_id] = tuple(req.block_hashes)
        src = req.kv_from
        if src is None or not src.block_hashes:
            return
        # The imported blocks are the prompt's leading ones: their check hashes are the request's.
        hashes, checks = src.block_hashes, req.check_hashes
        if checks is not None and tuple(hashes) != tuple(req.block_hashes[:len(hashes)]):
            checks = None
        if not self.import_blocks(hashes, checks):
            self.kv_import_failed += 1

    def import_blocks(self, block_hashes: Sequence[int], check_hashes: Sequence[int] | None = None) -> bool:
        """Take moved blocks into the prefix cache (a ``BlockStored`` says so, with ``check_hashes``:
        their double-hash guard's check hashes, None when unknown) as its most recently used entries;
        those already cached stay. False when the pool is too full to take them."""
        self._touch()  # the pool changes (``SimulatedEngine.load_unchanged``)
        hashes = list(block_hashes)
        bm = self._bm
        hits = bm.match_prefix(hashes, len(hashes))[0]
        if hits == len(hashes):
            return True
        table: list[int] = []
        if not bm.allocate(table, hashes, hits, len(hashes)):
            return False
        ok = check_hashes is not None and len(check_hashes) >= len(hashes)
        bm.cache_blocks(table, hashes, hits, len(hashes), check_hashes if ok else None)
        self.kv_imported_blocks += len(hashes) - hits
        bm.release(table)
        return True

    def pin_blocks(self, key: str, block_hashes: Sequence[int]) -> int:
        """Pin the leading cached blocks of ``block_hashes`` (a copy of them is leaving) until
        :meth:`release_transfer` of ``key``; returns how many were cached (and pinned)."""
        self._touch()  # the pool changes (``SimulatedEngine.load_unchanged``)
        n = self._bm.match_prefix(block_hashes, len(block_hashes))[0]
        if n:
            table: list[int] = []
            self._bm.allocate(table, block_hashes, n, n)
            self._pinned[key] = table
        return n

    def _handoff_outputs(self, out: list[TokenOutput]) -> list[TokenOutput]:
        """Finished remote prefill jobs get their :class:`KvTransfer`; their blocks are pinned."""
        jobs, bm = self._remote_jobs, self._bm
        for o in out:
            if not o.finished or o.request_id not in jobs:
                continue
            hashes = jobs.pop(o.request_id)
            if o.finish_reason in (FinishReason.ABORT, FinishReason.ERROR, FinishReason.UNAVAILABLE):
                continue
            # Released at the pass end just now and nothing allocated since (the next pass is packed
            # later): the blocks are still cached, and pinning them again is pure bookkeeping.
            n = bm.match_prefix(hashes, len(hashes))[0]
            if n and self.pin_transfers:
                table: list[int] = []
                bm.allocate(table, hashes, n, n)
                self._pinned[o.request_id] = table
            o.kv_transfer = KvTransfer(self.worker_id, n * self._bs, hashes[:n])
        return out

    def release_transfer(self, request_id: str) -> bool:
        """The transfer of ``request_id``'s KV ended (or was abandoned): unpin its blocks (they stay
        cached). False if nothing was pinned for it."""
        self._touch()  # the pool changes (``SimulatedEngine.load_unchanged``)
        table = self._pinned.pop(request_id, None)
        if table is None:
            return False
        self._bm.release(table)
        return True

    @property
    def pinned_transfers(self) -> int:
        return len(self._pinned)
