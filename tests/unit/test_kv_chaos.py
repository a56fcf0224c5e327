"""The chaos seam (kv/chaos.py), exactly; and vLLM-shaped KV-event frames through it into the index:
whatever is lost on the way, once the faults end the index holds exactly what the engine holds.

On the vLLM path the seam drops and delays live frames (a ZMQ SUB connection never duplicates; a
delayed frame arrives after later ones, its seq going back: the stream takes it for a restarted
engine, clears the worker and replays the engine's buffer), and the engine restarts once (seq back
to 0, cache empty; frames of the old process still in flight are lost with its connection). Gaps
are filled by the engine's replay buffer (here: every batch it published since it started)."""

from __future__ import annotations

import random

import pytest

from support.kv_frames import encode_batch
from thunderagent.execution.kv_stream import KvEventStream
from thunderagent.kv.chaos import ChaosSpec, EventChaos
from thunderagent.kv.feed import KvFeed
from thunderagent.kv.index import KvIndex

BS = 4


class Fixed(random.Random):
    """A Random whose draws come from a list (exact fault placement)."""

    def __init__(self, draws: list[float]) -> None:
        super().__init__(0)
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)


def test_each_fault_exactly():
    # per item: drop?, reorder?, delay?, duplicate? (a dropped item draws once, a reordered twice...)
    draws = [0.9, 0.9, 0.9, 0.0,   # a: passes, duplicated
             0.0,                   # b: dropped
             0.9, 0.0,              # c: held back (reordered)
             0.9, 0.9, 0.9, 0.9,   # d: passes; c follows it
             0.9, 0.9, 0.0, 0.5]   # e: delayed by 0.5 * 2 s
    seam: EventChaos[str] = EventChaos(ChaosSpec(drop=0.5, duplicate=0.5, reorder=0.5, delay=0.5, delay_s=2.0),
                                       Fixed(draws))
    assert seam.push(["a", "b", "c", "d", "e"], 10.0) == ["a", "a", "d", "c"]
    assert seam.pending() == 1 and seam.due(10.9) == [] and seam.due(11.0) == ["e"]
    st = seam.stats
    assert (st.dropped, st.duplicated, st.reordered, st.delayed) == (1, 1, 1, 1)


def test_healed_seam_passes_everything_and_releases_what_it_held():
    seam: EventChaos[int] = EventChaos(ChaosSpec(reorder=1.0), random.Random(1))
    assert seam.push([1, 2], 0.0) == []  # both held back
    seam.active = False
    assert seam.push([], 0.0) == [1, 2] and seam.push([3], 0.0) == [3]
    with pytest.raises(ValueError, match="drop is a probability"):
        ChaosSpec(drop=1.5)


def engine_batches(rng: random.Random, n: int) -> list[list[bytes]]:
    """An engine's published batches: chains of 1-3 blocks stored (each on a new or a stored
    parent), some blocks removed later; seq 0..n-1."""
    batches, stored, next_hash = [], [], 1
    for seq in range(n):
        events = []
        if stored and rng.random() < 0.3:
            victim = stored.pop(rng.randrange(len(stored)))
            events.append({"type": "BlockRemoved", "block_hashes": [victim[0]], "medium": "GPU"})
        parent = None
        for _ in range(rng.randint(1, 3)):
            tokens = [rng.randrange(1000) for _ in range(BS)]
            events.append({"type": "BlockStored", "block_hashes": [next_hash], "parent_block_hash": parent,
                           "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU"})
            stored.append((next_hash, tokens))
            parent, next_hash = next_hash, next_hash + 1
        batches.append(encode_batch(seq, events))
    return batches


@pytest.mark.parametrize("seed", range(8))
def test_vllm_frames_through_chaos_end_in_the_engines_content(seed: int):
    rng = random.Random(seed)
    batches = engine_batches(rng, 60)
    restart_at = rng.randrange(20, 40)  # the engine restarts: its seq starts again at 0, its cache empty
    published = batches[:restart_at] + engine_batches(random.Random(seed + 100), 30)
    truth = KvEventStream("truth", BS, can_replay=False)  # what the engine holds, from the clean stream
    for frames in published:
        truth.on_live(frames)
    index = KvIndex(prediction_ttl=0)
    feed = KvFeed(index)
    feed.add_worker("w", live=True)
    stream = KvEventStream("w", BS, can_replay=True)
    seam: EventChaos[list[bytes]] = EventChaos(ChaosSpec(drop=0.25, delay=0.2, delay_s=3.0), random.Random(seed))
    buffer: list[list[bytes]] = []  # the engine's replay buffer since its (re)start

    def apply(step) -> None:
        if step.events:
            assert not feed.events("w", step.events, 0.0), "the index must never see a gap from the stream"
        if step.replay_from is not None:
            for frames in buffer:
                if int.from_bytes(frames[1], "big", signed=True) >= step.replay_from:
                    apply(stream.on_replay([b"", *frames]))
            apply(stream.on_replay([b"", b"", (-1).to_bytes(8, "big", signed=True), b""]))

    now = 0.0
    for k, frames in enumerate(published):
        if k == restart_at:
            buffer = []
        buffer.append(frames)
        now += 1.0
        if k == len(published) - 5:
            seam.active = False  # the faults end; in-flight delayed frames still arrive
        for late in seam.push([frames], now) + seam.due(now):
            if late in buffer:  # else from the process before the restart: gone with its connection
                apply(stream.on_live(late))
    for late in seam.due(now + 10.0):
        if late in buffer:
            apply(stream.on_live(late))
    assert seam.stats.dropped > 0
    assert index.confirmed_blocks("w") == set(truth.snapshot()[0])
