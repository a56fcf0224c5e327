"""KV-event decoding on hand-built frames: vLLM's map and array encodings, SGLang's envelope, the
engine-hash -> our-hash map, and the sequence logic (gaps, replay, duplicates, restarts)."""

from __future__ import annotations

import msgspec
import pytest

from support.kv_frames import encode_batch
from thunderagent.execution.kv_frames import (
    END_SEQ,
    EngineBlockRemoved,
    EngineBlockStored,
    EventDecodeError,
    decode_event,
    decode_frames,
)
from thunderagent.execution.kv_stream import KvEventStream
from thunderagent.execution.kv_translate import BlockTranslator
from thunderagent.kv.hashing import block_hashes, hash_seed
from thunderagent.types import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
TOKENS = list(range(100, 112))  # 3 blocks of 4
OURS = block_hashes(TOKENS, BS)


# -- event builders in both wire encodings ------------------------------------------------------
def stored_map(hashes, parent, tokens, bs=BS, **extra):
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
          "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None}
    ev.update(extra)
    return ev


def stored_arr(hashes, parent, tokens, bs=BS):
    return ["BlockStored", hashes, parent, tokens, bs, None, "GPU"]


def removed_map(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def removed_arr(hashes):
    return ["BlockRemoved", hashes, "GPU"]


CLEARED_MAP = {"type": "AllBlocksCleared"}
CLEARED_ARR = ["AllBlocksCleared"]

ENCODINGS = {
    "map": (stored_map, removed_map, CLEARED_MAP),
    "array": (stored_arr, removed_arr, CLEARED_ARR),
}


def replay_reply(seq, events):
    return [b"", *encode_batch(seq, events)]


REPLAY_END = [b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""]


def hashes_of(events, kind=BlockStored):
    return [h for e in events if isinstance(e, kind) for h in e.block_hashes]


# -- decoding -----------------------------------------------------------------------------------
@pytest.mark.parametrize("enc", ENCODINGS)
def test_decode_both_encodings(enc):
    stored, removed, cleared = ENCODINGS[enc]
    frames = encode_batch(7, [stored([11, 12, 13], None, TOKENS), removed([13]), cleared], ts=1.5, rank=0)
    batch = decode_frames(frames)
    assert (batch.seq, batch.ts, batch.rank) == (7, 1.5, 0)
    s, r, c = batch.events
    assert isinstance(s, EngineBlockStored)
    assert (s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size, s.medium) == (
        [11, 12, 13], None, TOKENS, BS, "GPU")
    assert isinstance(r, EngineBlockRemoved) and r.block_hashes == [13]
    assert type(c).__name__ == "EngineAllCleared"


def test_decode_real_vllm_batch():
    """A batch as vLLM 0.32 published it (map events, bytes-free int hashes, extra fields)."""
    payload = [1795957848.17, [{
        "type": "BlockStored", "block_hashes": [4983110391196617255, 8832359988540648073],
        "parent_block_hash": None, "token_ids": list(range(64)), "block_size": 32, "lora_id": None,
        "medium": "GPU", "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }], 0]
    batch = decode_frames([b"kv-events", (0).to_bytes(8, "big"), msgspec.msgpack.encode(payload)])
    (ev,) = batch.events
    assert isinstance(ev, EngineBlockStored) and ev.block_size == 32 and ev.group_idx == 0


def test_decode_oldest_positional_form_with_num_toks_per_block():
    ev = decode_event(["BlockStored", [1, 2], None, list(range(8)), [4, 4], None])
    assert isinstance(ev, EngineBlockStored) and ev.block_size == 4 and ev.medium is None


def test_decode_bytes_hashes():
    frames = encode_batch(0, [stored_map([b"\x01" * 32], None, TOKENS[:4])])
    assert decode_frames(frames).events[0].block_hashes == [b"\x01" * 32]


@pytest.mark.parametrize("enc", ENCODINGS)
def test_sglang_envelope_one_block_per_page(enc):
    """SGLang: [ts, events, attn_dp_rank], one BlockStored per page chained by parent hash, one
    BlockRemoved per radix node (all its pages), AllBlocksCleared on a cache reset."""
    stored, removed, cleared = ENCODINGS[enc]
    events = [stored([1001], None, TOKENS[0:4]), stored([1002], 1001, TOKENS[4:8]),
              stored([1003], 1002, TOKENS[8:12])]
    stream = KvEventStream("w", BS, can_replay=False)
    frames = encode_batch(0, events, rank=3)
    assert decode_frames(frames).rank == 3
    step = stream.on_live(frames)
    assert hashes_of(step.events) == OURS
    assert [e.parent_hash for e in step.events] == [None, OURS[0], OURS[1]]
    step = stream.on_live(encode_batch(1, [removed([1002, 1003])], rank=3))
    assert step.events == [BlockRemoved("w", 3, (OURS[1], OURS[2]))]
    step = stream.on_live(encode_batch(2, [cleared], rank=None))  # rank null
    assert step.events == [AllBlocksCleared("w", 4)] and stream.snapshot() == ([], 4, [])


def test_envelope_without_rank():
    payload = msgspec.msgpack.encode([2.0, [CLEARED_ARR]])  # older publishers: [ts, events]
    batch = decode_frames([b"", (4).to_bytes(8, "big"), payload])
    assert (batch.seq, batch.rank, len(batch.events)) == (4, None, 1)


def test_unknown_event_type_is_skipped_not_fatal():
    stream = KvEventStream("w", BS, can_replay=False)
    step = stream.on_live(encode_batch(0, [{"type": "SomethingNew", "x": 1}, ["AlsoNew"],
                                           stored_map([11], None, TOKENS[:4])]))
    assert hashes_of(step.events) == OURS[:1]
    assert stream.translator.stats.skipped_events == 2


@pytest.mark.parametrize("frames", [
    [b"t", b"\x00" * 8],  # two frames
    [b"t", b"\x00" * 4, b"\x90"],  # short seq
    [b"t", b"\x00" * 8, b"\xc1"],  # not msgpack
    [b"t", b"\x00" * 8, msgspec.msgpack.encode({"ts": 1})],  # not an array
    [b"t", b"\x00" * 8, msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": "x"}]])],
])
def test_malformed_frames_raise(frames):
    with pytest.raises(EventDecodeError):
        decode_frames(frames)


# -- engine hash -> our hash ------------------------------------------------------------------
@pytest.mark.parametrize("enc", ENCODINGS)
def test_translated_hashes_are_the_routers_hashes(enc):
    """The whole point: a stored chain maps to exactly the hashes the frontend computes for a
    prompt with these tokens, so the router matches what the engine caches."""
    stored, removed, _ = ENCODINGS[enc]
    stream = KvEventStream("w", BS, can_replay=False)
    # one event for two blocks, then the third chained by its parent's engine hash
    step = stream.on_live(encode_batch(0, [stored([11, 12], None, TOKENS[:8]), stored([13], 12, TOKENS[8:])]))
    assert [type(e) for e in step.events] == [BlockStored, BlockStored]
    assert hashes_of(step.events) == OURS
    assert [e.seq for e in step.events] == [0, 1]
    assert step.events[1].parent_hash == OURS[1]
    step = stream.on_live(encode_batch(1, [removed([13, 99])]))  # 99: never seen, ignored
    assert step.events == [BlockRemoved("w", 2, (OURS[2],))]
    assert sorted(stream.snapshot()[0]) == sorted(OURS[:2]) and stream.snapshot()[1] == 2


def test_salt_and_lora_seed_the_chain_like_the_frontend():
    t = BlockTranslator(BS)
    ours, _ = t.stored(EngineBlockStored([1], None, TOKENS[:4], BS, extra_keys=[["tenant-a"]]))
    assert ours == block_hashes(TOKENS[:4], BS, hash_seed("tenant-a"))
    ours, _ = t.stored(EngineBlockStored([2], None, TOKENS[:4], BS, lora_name="ad1", extra_keys=[["ad1", "s"]]))
    assert ours == block_hashes(TOKENS[:4], BS, hash_seed("s", "ad1"))
    ours, _ = t.stored(EngineBlockStored([3], None, TOKENS[:4], BS, lora_name="ad1", extra_keys=[["ad1"]]))
    assert ours == block_hashes(TOKENS[:4], BS, hash_seed(None, "ad1"))


def test_unknown_parent_is_unlinked_and_so_are_its_children():
    t = BlockTranslator(BS)
    assert t.stored(EngineBlockStored([5], 4, TOKENS[4:8], BS)) == ([], None)
    assert t.stored(EngineBlockStored([6], 5, TOKENS[8:12], BS)) == ([], None)
    assert t.stats.unlinked_blocks == 2 and len(t) == 0


def test_two_engine_blocks_one_hash_removed_when_the_last_goes():
    t = BlockTranslator(BS)
    t.stored(EngineBlockStored([1], None, TOKENS[:4], BS))
    t.stored(EngineBlockStored([2], None, TOKENS[:4], BS))  # e.g. engine-side key we do not model
    assert t.removed(EngineBlockRemoved([1])) == []
    assert t.removed(EngineBlockRemoved([2])) == OURS[:1]


def test_other_media_and_groups_are_not_indexed():
    t = BlockTranslator(BS)
    assert t.stored(EngineBlockStored([1], None, TOKENS[:4], BS, medium="CPU")) == ([], None)
    assert t.stored(EngineBlockStored([1], None, TOKENS[:4], BS, group_idx=1)) == ([], None)
    t.stored(EngineBlockStored([1], None, TOKENS[:4], BS))
    assert t.removed(EngineBlockRemoved([1], medium="CPU")) == []
    assert len(t) == 1


def test_token_count_must_match_blocks():
    with pytest.raises(EventDecodeError, match="token ids"):
        BlockTranslator(BS).stored(EngineBlockStored([1, 2], None, TOKENS[:5], BS))


def test_sglang_bigram_pages_are_skipped():
    t = BlockTranslator(2)
    assert t.stored(EngineBlockStored([1], None, [[1, 2], [2, 3]], 2)) == ([], None)
    assert t.stats.skipped_events == 1


def test_block_size_mismatch_stops_translation_and_clears():
    stream = KvEventStream("w", BS, can_replay=False)
    stream.on_live(encode_batch(0, [stored_map([1], None, TOKENS[:4])]))
    step = stream.on_live(encode_batch(1, [stored_map([7], None, list(range(8)), bs=8)]))
    assert stream.mismatch == (8, BS)
    assert step.events == [AllBlocksCleared("w", 1)]
    assert stream.on_live(encode_batch(2, [stored_map([2], None, TOKENS[:4])])).events == []
    # a new engine process may be configured right: the refusal is lifted
    step = stream.engine_restarted()
    assert stream.mismatch is None and isinstance(step.events[0], AllBlocksCleared)


# -- sequence numbers -----------------------------------------------------------------------
def chain_batches(enc="map"):
    stored, _, _ = ENCODINGS[enc]
    return [
        encode_batch(0, [stored([11], None, TOKENS[0:4])]),
        encode_batch(1, [stored([12], 11, TOKENS[4:8])]),
        encode_batch(2, [stored([13], 12, TOKENS[8:12])]),
    ]


@pytest.mark.parametrize("enc", ENCODINGS)
def test_in_order_stream(enc):
    stream = KvEventStream("w", BS, can_replay=True)
    out = [e for b in chain_batches(enc) for e in stream.on_live(b).events]
    assert hashes_of(out) == OURS and [e.seq for e in out] == [0, 1, 2]
    assert stream.next_seq == 3 and stream.stats.gaps == 0


@pytest.mark.parametrize("enc", ENCODINGS)
def test_gap_is_replayed_then_held_back_batches_applied(enc):
    b0, b1, b2 = chain_batches(enc)
    stream = KvEventStream("w", BS, can_replay=True)
    assert hashes_of(stream.on_live(b0).events) == OURS[:1]
    step = stream.on_live(b2)  # 1 lost
    assert step.replay_from == 1 and step.events == [] and stream.replaying
    b3 = encode_batch(3, [removed_map([11])])
    assert stream.on_live(b3).events == []  # held back while replaying
    events = []
    for frames in (replay_reply(1, decode_as_raw(b1)), replay_reply(2, decode_as_raw(b2)),
                   replay_reply(3, decode_as_raw(b3)), REPLAY_END):
        events += stream.on_replay(frames).events
    # replay brought 1, 2, 3; the held-back 2 and 3 were duplicates
    assert hashes_of(events) == OURS[1:]
    assert hashes_of(events, BlockRemoved) == OURS[:1]
    assert [e.seq for e in events] == [1, 2, 3]
    assert not stream.replaying and stream.next_seq == 4
    assert stream.stats.duplicates == 2 and stream.stats.resyncs == 0


def decode_as_raw(frames):
    return msgspec.msgpack.decode(frames[2])[1]


def test_join_late_replays_from_zero():
    """Batches published before we subscribed are a gap too: the engine's buffer fills it."""
    b0, b1, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=True)
    assert stream.on_live(b2).replay_from == 0
    events = []
    for seq, b in ((0, b0), (1, b1), (2, b2)):
        events += stream.on_replay(replay_reply(seq, decode_as_raw(b))).events
    events += stream.on_replay(REPLAY_END).events
    assert hashes_of(events) == OURS


def test_catch_up_on_connect_fetches_what_was_published_before_the_subscription():
    """The engine published batch 0 before our subscription reached it, then went quiet: no later
    batch would reveal the gap, so the pump asks for a replay once its handshake completes."""
    b0, b1, _ = chain_batches()
    stream = KvEventStream("w", BS, can_replay=True)
    step = stream.catch_up()
    assert step.replay_from == 0 and step.events == [] and stream.replaying
    assert stream.catch_up().replay_from is None  # one replay at a time
    assert stream.on_live(b1).events == []  # held back while the replay answers
    events = stream.on_replay(replay_reply(0, decode_as_raw(b0))).events
    events += stream.on_replay(replay_reply(1, decode_as_raw(b1))).events
    events += stream.on_replay(REPLAY_END).events  # then the held-back 1: a duplicate
    assert hashes_of(events) == OURS[:2] and [e.seq for e in events] == [0, 1]
    assert not stream.replaying and stream.next_seq == 2
    assert stream.stats.duplicates == 1 and stream.stats.gaps == 0 and stream.stats.resyncs == 0
    assert stream.stats.catch_ups == 1


def test_catch_up_with_nothing_buffered_changes_nothing():
    b0, b1, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=True)
    stream.on_live(b0)
    step = stream.catch_up()  # a reconnect after batch 0: asks from 1 on
    assert step.replay_from == 1
    assert stream.on_replay(REPLAY_END).events == []
    assert not stream.replaying and stream.next_seq == 1 and stream.stats.resyncs == 0
    assert hashes_of(stream.on_live(b1).events) == OURS[1:2]


def test_catch_up_needs_a_replay_endpoint_and_an_idle_stream():
    stream = KvEventStream("w", BS, can_replay=False)
    assert stream.catch_up().replay_from is None and not stream.replaying
    stream = KvEventStream("w", BS, can_replay=True)
    stream.on_live(chain_batches()[0])
    assert stream.on_live(encode_batch(3, [])).replay_from == 1  # a gap: replaying
    assert stream.catch_up().replay_from is None and stream.stats.catch_ups == 0


def test_replay_buffer_moved_on_resyncs():
    """The engine no longer buffers the start of the gap: drop the worker's blocks, rebuild."""
    b0, _, _ = chain_batches()
    stream = KvEventStream("w", BS, can_replay=True)
    stream.on_live(b0)
    assert stream.on_live(encode_batch(5, [stored_map([21], None, TOKENS[:4])])).replay_from == 1
    step = stream.on_replay(replay_reply(4, [stored_map([20], None, TOKENS[4:8])]))
    assert isinstance(step.events[0], AllBlocksCleared)
    assert hashes_of(step.events) == block_hashes(TOKENS[4:8], BS)
    step = stream.on_replay(REPLAY_END)  # then the held-back 5 applies
    assert hashes_of(step.events) == OURS[:1]
    assert stream.stats.resyncs == 1 and stream.next_seq == 6


def test_replay_timeout_resyncs_and_applies_held_back():
    b0, b1, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=True)
    stream.on_live(b0)
    stream.on_live(b2)
    step = stream.replay_failed()
    assert isinstance(step.events[0], AllBlocksCleared)
    assert step.events[1:] == []  # 2's parent (12) was in the lost batch: unlinked
    assert stream.translator.stats.unlinked_blocks == 1 and not stream.replaying
    # a late answer to the abandoned replay is ignored
    assert stream.on_replay(replay_reply(1, decode_as_raw(b1))).events == []


def test_too_many_held_back_batches_give_up_the_replay():
    stream = KvEventStream("w", BS, can_replay=True, max_pending=2)
    stream.on_live(encode_batch(0, [CLEARED_MAP]))
    assert stream.on_live(encode_batch(2, [])).replay_from == 1
    stream.on_live(encode_batch(3, []))
    step = stream.on_live(encode_batch(4, []))
    assert not stream.replaying and isinstance(step.events[0], AllBlocksCleared)
    assert stream.next_seq == 5


def test_gap_without_replay_endpoint_resyncs():
    b0, _, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=False)
    stream.on_live(b0)
    step = stream.on_live(b2)
    assert step.replay_from is None
    assert [type(e) for e in step.events] == [AllBlocksCleared]  # 13's parent lost with batch 1
    assert stream.snapshot() == ([], 1, [])


def test_join_without_replay_adopts_the_first_seq():
    stream = KvEventStream("w", BS, can_replay=False)
    step = stream.on_live(encode_batch(41, [stored_map([11], None, TOKENS[:4])]))
    assert hashes_of(step.events) == OURS[:1] and stream.stats.resyncs == 0


def test_duplicate_from_replay_overlap_is_skipped():
    b0, b1, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=True)
    stream.on_live(b0)
    stream.on_live(b2)
    for seq, b in ((0, b0), (1, b1), (2, b2)):  # replay answered from older than asked
        stream.on_replay(replay_reply(seq, decode_as_raw(b)))
    stream.on_replay(REPLAY_END)
    assert stream.stats.duplicates == 2  # replayed 0, held-back 2
    assert sorted(stream.snapshot()[0]) == sorted(OURS)


@pytest.mark.parametrize("can_replay", [True, False])
def test_restart_seq_back_to_zero_clears(can_replay):
    b0, b1, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=can_replay)
    for b in (b0, b1, b2):
        stream.on_live(b)
    new = [stored_map([77], None, TOKENS[4:8])]
    step = stream.on_live(encode_batch(0, new))  # the new process starts counting again
    assert isinstance(step.events[0], AllBlocksCleared)
    assert hashes_of(step.events) == block_hashes(TOKENS[4:8], BS)
    assert stream.stats.restarts == 1 and stream.next_seq == 1
    assert stream.snapshot()[0] == block_hashes(TOKENS[4:8], BS)


def test_restart_seen_mid_stream_replays_from_zero():
    b0, b1, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=True)
    for b in (b0, b1, b2):
        stream.on_live(b)
    step = stream.on_live(encode_batch(1, []))  # new process, its batch 0 published before we saw it
    assert isinstance(step.events[0], AllBlocksCleared) and step.replay_from == 0


def test_engine_restart_reported_by_the_adapter():
    b0, b1, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=True)
    for b in (b0, b1, b2):
        stream.on_live(b)
    step = stream.engine_restarted()
    assert step.events == [AllBlocksCleared("w", 3)] and stream.snapshot() == ([], 3, [])
    # the new process's batch 5 arrives first: its 0..4 are replayed
    assert stream.on_live(encode_batch(5, [])).replay_from == 0


def test_undecodable_batch_counts_and_next_one_is_a_gap():
    b0, _, b2 = chain_batches()
    stream = KvEventStream("w", BS, can_replay=False)
    stream.on_live(b0)
    assert stream.on_live([b"kv-events", (1).to_bytes(8, "big"), b"\xc1"]).events == []
    assert stream.stats.decode_errors == 1
    step = stream.on_live(b2)
    assert isinstance(step.events[0], AllBlocksCleared) and stream.stats.resyncs == 1


def test_our_seqs_are_contiguous_through_everything():
    """The index must never see a gap from us: gaps are resolved here."""
    stream = KvEventStream("w", BS, can_replay=True)
    seqs = []
    for step in (
        stream.on_live(chain_batches()[0]),
        stream.on_live(encode_batch(3, [])),  # gap -> replay
        stream.replay_failed(),
        stream.on_live(encode_batch(0, [stored_map([5], None, TOKENS[:4])])),  # restart
        stream.engine_restarted(),
    ):
        seqs += [e.seq for e in step.events]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 4
