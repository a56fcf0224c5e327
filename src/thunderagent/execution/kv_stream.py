"""One engine publisher's KV-event stream in sequence: gaps, duplicates, replay and restarts resolved,
out come our :mod:`KV events <thunderagent.types>` with our own contiguous ``seq``.

Pure and synchronous: frames in, events out (decoding: :mod:`thunderagent.execution.kv_frames`, hash
translation: :mod:`thunderagent.execution.kv_translate`); the sockets live in
:mod:`thunderagent.execution.kv_pump`.

Replay (the engine's ROUTER endpoint re-sends the batches it still buffers, from a given ``seq``
on, then an end marker) is what fills a gap; its frames are described in
:mod:`~thunderagent.execution.kv_frames`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.execution.kv_frames import (
    END_SEQ,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
    EventBatch,
    EventDecodeError,
    decode_frames,
)
from thunderagent.execution.kv_translate import BlockTranslator
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamStep:
    """What the adapter must do after feeding a batch: publish ``events`` (in order) and, when
    ``replay_from`` is set, ask the engine's replay socket for batches from that seq on."""

    events: list[KvEvent] = field(default_factory=list)
    replay_from: int | None = None


@dataclass(slots=True)
class StreamStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    catch_ups: int = 0  # replays asked on (re)connecting, no gap seen
    resyncs: int = 0
    restarts: int = 0
    decode_errors: int = 0


class KvEventStream:
    """One engine publisher's stream, as seen by one worker handle.

    Live batches arrive on the SUB socket with strictly increasing ``seq``; the next expected one is
    :attr:`next_seq` (0 at start: batches published before we subscribed are a gap too, which
    replay fills when the engine still buffers them).

    - ``seq == next_seq``: applied.
    - ``seq > next_seq`` (a gap): with a replay endpoint, live batches are held back (at most
      ``max_pending``) and the caller is asked to replay from ``next_seq``; replayed batches are
      applied in order, duplicates skipped, then the held-back ones. If the replay cannot cover the
      gap (buffer moved on, timeout, no endpoint), the worker is **resynced**: its blocks are
      dropped (an ``AllBlocksCleared`` of ours) and rebuilt from the events that follow.
    - ``seq < next_seq`` from replay or the held-back queue: a duplicate, skipped.
    - a live ``seq`` not above the previous live one: the engine **restarted** (its counter went
      back); its cache is empty, so ours is cleared and counting starts again from 0.

    Our events carry our own contiguous ``seq`` (the index never sees an engine gap: gaps are
    resolved here).
    """

    def __init__(self, worker_id: str, block_size: int, *, can_replay: bool, max_pending: int = 10_000,
                 checks: bool = True) -> None:
        self.worker_id = worker_id
        self.translator = BlockTranslator(block_size, checks)  # checks: the double-hash guard's (kv.check)
        self.can_replay = can_replay
        self.max_pending = max_pending
        self.next_seq = 0
        self.replaying = False
        self.stats = StreamStats()
        self._last_live = -1
        self._pending: deque[EventBatch] = deque()
        self._our_seq = -1
        self._unknown_tags: set[object] = set()

    # -- inputs ------------------------------------------------------------------------------
    def on_live(self, frames: Sequence[bytes]) -> StreamStep:
        try:
            batch = decode_frames(frames)
        except EventDecodeError as exc:
            return self._decode_error(exc)
        return self.on_live_batch(batch)

    def on_live_batch(self, batch: EventBatch) -> StreamStep:
        step = StreamStep()
        if batch.seq <= self._last_live:
            self.stats.restarts += 1
            log.warning("%s: KV event seq went back from %d to %d: engine restarted, its cache is empty",
                        self.worker_id, self._last_live, batch.seq)
            self._clear(step)
            self.next_seq = 0
            self.replaying = False
            self._pending.clear()
        self._last_live = batch.seq
        if self.replaying:
            self._pending.append(batch)
            if len(self._pending) > self.max_pending:
                log.warning("%s: replay did not answer within %d batches: resyncing", self.worker_id,
                            self.max_pending)
                return self.replay_failed()
            return step
        if batch.seq > self.next_seq and self.can_replay:
            self.stats.gaps += 1
            self.stats.replays += 1
            log.info("%s: KV events %d..%d missed: replaying", self.worker_id, self.next_seq, batch.seq - 1)
            self.replaying = True
            self._pending.append(batch)
            step.replay_from = self.next_seq
            return step
        self._advance(batch, step)
        return step

    def on_replay(self, frames: Sequence[bytes]) -> StreamStep:
        """A reply from the replay socket (``[b"", topic, seq, payload]``)."""
        try:
            batch = decode_frames(frames)
        except EventDecodeError as exc:
            return self._decode_error(exc)
        return self.on_replay_batch(batch)

    def on_replay_batch(self, batch: EventBatch) -> StreamStep:
        step = StreamStep()
        if not self.replaying:  # a late answer to a replay we gave up on
            return step
        if batch.seq == END_SEQ:
            self._finish_replay(step)
        else:
            self._advance(batch, step)
        return step

    def catch_up(self) -> StreamStep:
        """Our subscription just reached the engine (first connect or a reconnect): ask its replay
        socket for what it still buffers from :attr:`next_seq` on. Why: a PUB drops what it sends
        before a subscription arrives (ZMQ's slow joiner) and during a disconnection, and a gap only
        shows when a later batch comes; an engine that goes quiet after that would leave the index
        without those blocks indefinitely. Live batches are held back meanwhile, as for a gap, and
        what the replay repeats is skipped as duplicates. A no-op without a replay endpoint or
        while a replay runs."""
        step = StreamStep()
        if not self.can_replay or self.replaying:
            return step
        self.stats.replays += 1
        self.stats.catch_ups += 1
        self.replaying = True
        step.replay_from = self.next_seq
        return step

    def replay_failed(self) -> StreamStep:
        """The replay socket did not answer in time (or is gone): continue from what we hold."""
        step = StreamStep()
        if self.replaying:
            self._finish_replay(step)
        return step

    def engine_restarted(self) -> StreamStep:
        """The engine is a new process (seen by the adapter, e.g. a new start time in its metrics):
        its cache is empty and its seq starts again from 0. Also lifts a block-size refusal, since
        the new process may run with another block size."""
        self.stats.restarts += 1
        step = StreamStep()
        self.translator.mismatch = None
        self._clear(step)
        self.next_seq = 0
        self._last_live = -1
        self.replaying = False
        self._pending.clear()
        return step

    def leading_cached(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a request the engine holds, as far as its events told us."""
        return self.translator.leading_cached(block_hashes)

    # -- state ---------------------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        """Seq of the last event of ours handed out (-1: none yet)."""
        return self._our_seq

    def snapshot(self) -> tuple[list[int], int, list[int] | None]:
        hashes, checks = self.translator.cached_pairs()
        return hashes, self._our_seq, checks

    @property
    def mismatch(self) -> tuple[int, int] | None:
        return self.translator.mismatch

    # -- internals -----------------------------------------------------------------------------
    def _finish_replay(self, step: StreamStep) -> None:
        self.replaying = False
        pending, self._pending = self._pending, deque()
        for b in pending:
            self._advance(b, step)

    def _advance(self, batch: EventBatch, step: StreamStep) -> None:
        """Apply ``batch`` unless it is a duplicate; a gap that replay did not fill resyncs."""
        if batch.seq < self.next_seq:
            self.stats.duplicates += 1
            return
        if batch.seq > self.next_seq:
            if self.next_seq == 0 and self._our_seq == -1 and not self.can_replay:
                log.info("%s: joined the KV event stream at seq %d", self.worker_id, batch.seq)
            else:
                self.stats.gaps += 1
                self.stats.resyncs += 1
                log.warning("%s: KV events %d..%d lost (no replay): resyncing, its index entries are rebuilt "
                            "from new events", self.worker_id, self.next_seq, batch.seq - 1)
                self._clear(step)
        self.next_seq = batch.seq + 1
        self.stats.batches += 1
        if self.translator.mismatch is not None:
            return
        for ev in batch.events:
            self._translate(ev, step.events)
            if self.translator.mismatch is not None:
                log.error(
                    "%s: engine KV block size %d differs from the configured block_size %d: not routing to "
                    "it (set execution_group.nodes[].block_size to %d, or start the engine with "
                    "--block-size %d)", self.worker_id, *self.translator.mismatch,
                    self.translator.mismatch[0], self.translator.mismatch[1],
                )
                self._clear(step)
                return

    def _translate(self, ev: EngineEvent, out: list[KvEvent]) -> None:
        wid = self.worker_id
        if isinstance(ev, EngineBlockStored):
            try:
                ours, parent = self.translator.stored(ev)
            except EventDecodeError as exc:
                self.stats.decode_errors += 1
                log.warning("%s: bad BlockStored skipped: %s", wid, exc)
                return
            if ours:
                self._our_seq += 1
                checks = self.translator.checks_of(ev.block_hashes)
                out.append(BlockStored(wid, self._our_seq, tuple(ours), parent,
                                       None if checks is None else tuple(checks)))
        elif isinstance(ev, EngineBlockRemoved):
            gone = self.translator.removed(ev)
            if gone:
                self._our_seq += 1
                out.append(BlockRemoved(wid, self._our_seq, tuple(gone)))
        elif isinstance(ev, EngineAllCleared):
            self._clear_into(out)
        else:
            self.translator.stats.skipped_events += 1
            if ev.tag not in self._unknown_tags:  # once: a newer engine may send it in every batch
                self._unknown_tags.add(ev.tag)
                log.warning("%s: unknown KV event type %r skipped", wid, ev.tag)

    def _clear(self, step: StreamStep) -> None:
        self._clear_into(step.events)

    def _clear_into(self, out: list[KvEvent]) -> None:
        self.translator.clear()
        self._our_seq += 1
        out.append(AllBlocksCleared(self.worker_id, self._our_seq))

    def _decode_error(self, exc: EventDecodeError) -> StreamStep:
        # A batch we cannot read is a batch lost: the next good one shows up as a gap.
        self.stats.decode_errors += 1
        log.warning("%s: undecodable KV event batch skipped: %s", self.worker_id, exc)
        return StreamStep()
