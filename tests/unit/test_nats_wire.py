"""Wire messages of the NATS deployment: exact encodings, round trips, chunked dumps, subjects."""

from __future__ import annotations

import random

import msgspec
import pytest

from thunderagent.bus import wire
import dataclasses

from thunderagent.types import (
    Passthrough,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    FinishReason,
    KvTransfer,
    LoadReport,
    Sampling,
    TokenOutput,
    WorkerInfo,
)

U64_MAX = 2**64 - 1


def test_packed_integers_round_trip_little_endian():
    assert wire.pack_u64([1, U64_MAX]) == b"\x01" + b"\x00" * 7 + b"\xff" * 8
    assert wire.unpack_u64(wire.pack_u64([0, 5, U64_MAX])) == [0, 5, U64_MAX]
    assert wire.pack_u32([258]) == b"\x02\x01\x00\x00"
    assert wire.unpack_u32(wire.pack_u32([0, 256, 2**32 - 1])) == [0, 256, 2**32 - 1]
    with pytest.raises(ValueError, match="multiple of 8"):
        wire.unpack_u64(b"\x00" * 7)


def test_kv_batch_exact_bytes_and_round_trip():
    # array_like structs: no field names on the wire; tagged events start with their tag
    msg = wire.encode(wire.KvBatch("i1", [wire.WireCleared(5)]))
    assert msg == msgspec.msgpack.encode(["i1", [[2, 5]]])
    events = [
        BlockStored("w", 0, (1, U64_MAX), None),
        BlockStored("w", 1, (7,), U64_MAX),
        BlockRemoved("w", 2, (1,)),
        AllBlocksCleared("w", 3),
    ]
    batch = wire.decode_kv(wire.encode(wire.KvBatch("inst", wire.events_to_wire(events))))
    assert batch.instance == "inst"
    assert wire.events_from_wire("w", batch.events) == events


def test_heartbeat_round_trip_carries_info_load_and_seq():
    info = WorkerInfo("w-1", "both", 64, 8192, 64, 1000, 0, 64000, 8192)
    load = LoadReport("w-1", 12.5, 2, 3, 400, 900, 10, 20, 1000)
    hb = wire.Heartbeat(wire.WIRE_VERSION, "abc", wire.info_to_wire(info, "simulated"), wire.load_to_wire(load), 41)
    back = wire.decode_heartbeat(wire.encode(hb))
    assert back == hb
    assert wire.info_from_wire(back.info) == info
    assert back.info.engine == "simulated"
    assert wire.load_from_wire(back.load, "w-1") == load
    assert back.last_seq == 41
    # a worker from before the limits: a simulated one holds its KV pool, a real one states nothing
    old = wire.WireInfo("w-2", "both", "simulated", 64, 8192, 64, 1000)
    assert (wire.info_from_wire(old).max_seq_tokens, wire.info_from_wire(old).max_prompt_tokens) == (64000, 0)
    assert wire.info_from_wire(wire.WireInfo("w-3", "both", "vllm", 16, 8192, 64, 1000)).max_seq_tokens == 0
    lora = WorkerInfo("w-4", "both", 16, 8192, 64, 1000, 16, 4096, 0, ("math-lora", "sql-lora"))
    assert wire.info_from_wire(wire.decode_heartbeat(wire.encode(wire.Heartbeat(
        wire.WIRE_VERSION, "abc", wire.info_to_wire(lora, "vllm"), wire.load_to_wire(load), 0))).info) == lora
    assert wire.info_from_wire(wire.WireInfo("w-5", "both", "vllm", 16, 8192, 64, 1000)).adapters == ()  # older
    # one data-parallel rank of a server (an operator's calls reach that server once for all its ranks)
    rank = WorkerInfo("w-6", "both", 16, 8192, 64, 1000, server="http://10.0.0.5:8000")
    assert wire.info_from_wire(wire.decode_heartbeat(wire.encode(wire.Heartbeat(
        wire.WIRE_VERSION, "abc", wire.info_to_wire(rank, "vllm"), wire.load_to_wire(load), 0))).info) == rank
    assert wire.info_from_wire(wire.WireInfo("w-7", "both", "vllm", 16, 8192, 64, 1000)).server == ""  # older


def test_generate_request_and_token_batch_round_trip():
    req = EngineRequest("r1", [1, 2, 300, 70000], [11, U64_MAX], 99, 16, ignore_eos=True, priority=-2,
                        cache_salt="tenant", lora_name="sql-lora")
    back = wire.request_from_wire(wire.decode_generate(wire.encode(wire.request_to_wire(req))))
    assert back == req
    outs = [TokenOutput("r1", [5, 6], 1.5, 4, 2), TokenOutput("r1", [], 2.0, 4, 2, True, "length", "hi"),
            TokenOutput("r1", [9], 2.5, 4, 0, True, "length", None, KvTransfer("p0", 4, (7,), '{"a": 1}'))]
    batch = wire.decode_tokens(wire.encode(wire.TokenBatch(3, [wire.output_to_wire(o) for o in outs])))
    assert batch.n == 3 and batch.error is None
    assert [wire.output_from_wire("r1", w) for w in batch.outputs] == outs


def test_wrong_message_type_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        wire.decode_heartbeat(wire.encode(wire.Bye("x")))


def test_dump_chunks_split_and_join_in_any_order():
    hashes = [random.Random(1).getrandbits(64) for _ in range(7)]
    chunks = wire.dump_chunks("inst", hashes, 12, chunk=3)
    assert [(c.part, c.final, len(c.hashes) // 8) for c in chunks] == [(0, False, 3), (1, False, 3), (2, True, 1)]
    decoded = [wire.decode_dump_chunk(wire.encode(c)) for c in reversed(chunks)]
    dump = wire.join_dump(decoded)
    assert dump == wire.Dump("inst", 12, hashes)
    with pytest.raises(ValueError, match="incomplete"):
        wire.join_dump(chunks[1:])
    with pytest.raises(ValueError, match="different snapshots"):
        wire.join_dump([chunks[0], wire.dump_chunks("other", hashes, 12, chunk=3)[1], chunks[2]])


def test_empty_and_unavailable_dumps():
    (empty,) = wire.dump_chunks("i", [], 4)
    assert empty.final and wire.join_dump([empty]) == wire.Dump("i", 4, [])
    (none,) = wire.dump_chunks("i", None, 4)
    assert not none.available and wire.join_dump([none]).hashes is None


def test_subjects_and_tokens():
    s = wire.Subjects("ta")
    assert s.worker("w1", "hb") == "ta.worker.w1.hb"
    assert s.parse_worker("ta.worker.w1.kv") == ("w1", "kv")
    assert s.parse_worker("ta.rpc.w1.dump") is None
    assert s.parse_worker("other.worker.w1.kv") is None
    assert s.rpcs("w1") == "ta.rpc.w1.*"
    for bad in ("a.b", "a b", "*", ">", ""):
        with pytest.raises(ValueError, match="NATS subject token"):
            wire.check_token(bad, "worker id")


def _non_default(field: dataclasses.Field, k: int) -> object:
    """A value for ``field`` that differs from its default (so a dropped field cannot pass)."""
    values = {
        "request_id": "req-1", "prompt_tokens": [1, 2**32 - 1, 7], "block_hashes": [2**64 - 1, 3],
        "hash_seed": 2**63 + k, "max_tokens": 77, "ignore_eos": True, "priority": -3, "arrival": 12.5,
        "cache_salt": "tenant-a", "lora_name": "adapter-x",
        "sampling": Sampling(temperature=0.25, top_p=0.5, seed=4242), "resumed": 5,
        "check_hashes": [2**64 - 2, 0], "remote_decode": True,
        "kv_from": KvTransfer("w-prefill", 130, (2**64 - 1, 5), '{"remote_engine_id": "e1"}'),
        "passthrough": Passthrough("/v1/chat/completions", b'{"model": "m", "tools": []}', True, "GET"),
        "headers": (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("x-request-id", "r1")),
    }
    assert field.name in values, f"EngineRequest.{field.name} is new: give it a wire test value here and a wire field"
    value = values[field.name]
    assert value != field.default, field.name
    return value


def test_every_engine_request_field_crosses_the_wire():
    """Each field of the engine request, sampling included, survives NATS unchanged (a relayed request's prompt as
    its length alone, and no hashes: the worker sends the client's body, below)."""
    fields = dataclasses.fields(EngineRequest)
    relayed = EngineRequest(**{f.name: _non_default(f, k) for k, f in enumerate(fields)})
    req = dataclasses.replace(relayed, passthrough=None)
    back = wire.request_from_wire(wire.decode_generate(wire.encode(wire.request_to_wire(req))))
    for f in fields:
        assert getattr(back, f.name) == getattr(req, f.name), f.name
    back = wire.request_from_wire(wire.decode_generate(wire.encode(wire.request_to_wire(relayed))))
    for f in fields:
        if f.name == "prompt_tokens":
            assert back.prompt_tokens == range(len(relayed.prompt_tokens))  # its length: the worker's accounting
        elif f.name in ("block_hashes", "check_hashes"):
            assert not getattr(back, f.name)  # unused by a relay
        else:
            assert getattr(back, f.name) == getattr(relayed, f.name), f.name
    # sampling parameters one by one: a request that sets only one of them keeps the others unset
    for only in ("temperature", "top_p", "seed"):
        s = Sampling(**{only: 1})
        out = wire.request_from_wire(wire.decode_generate(wire.encode(wire.request_to_wire(
            dataclasses.replace(req, sampling=s)))))
        assert out.sampling == s


def test_relayed_bytes_cross_the_wire():
    """A passthrough request's answer bytes (engine openai) and their HTTP status survive NATS."""
    out = TokenOutput("r", [], 0.5, 3, 0, True, FinishReason.ERROR, raw=b'{"error": {"message": "bad"}}',
                      raw_status=400)
    assert wire.output_from_wire("r", wire.output_to_wire(out)) == out


def test_finish_reasons_cross_as_the_enum():
    for reason in FinishReason:
        out = TokenOutput("r", [1], 0.5, 3, 0, True, reason)
        back = wire.output_from_wire("r", wire.output_to_wire(out))
        assert back.finish_reason is reason and back == out


@pytest.mark.parametrize(("max_payload", "block_size"), [(1024 * 1024, 64), (8 * 1024 * 1024, 16), (65536, 1)])
def test_max_prompt_tokens_is_the_longest_prompt_one_message_carries(max_payload, block_size):
    n = wire.message_limits(max_payload, block_size)[0]
    blocks = list(range(n // block_size))
    req = EngineRequest("r" * 32, list(range(n)), blocks, 1, 16, cache_salt="s" * 1000, lora_name="l" * 1000,
                        check_hashes=blocks)  # (the double-hash guard: on by default)
    size = len(wire.encode(wire.request_to_wire(req)))
    assert max_payload - 8192 < size <= max_payload


@pytest.mark.parametrize("max_payload", [1024 * 1024, 65536])
def test_a_relayed_request_carries_its_body_not_its_prompt(max_payload):
    """A relayed body of up to ``message_limits``' body bytes fits one message whatever its prompt's length (the
    worker gets the length only): over 1 MiB, a conversation some 4 times longer than with its tokens sent."""
    body = b"x" * wire.message_limits(max_payload, 16)[1]
    n = 4 * len(body)  # far past max_prompt_tokens: the prompt is not what crosses
    req = EngineRequest("r" * 32, list(range(n)), list(range(n // 16)), 1, 16, cache_salt="s" * 1000,
                        lora_name="l" * 1000, check_hashes=list(range(n // 16)),
                        passthrough=Passthrough("/v1/chat/completions", body, True),
                        headers=(("traceparent", "t" * 55), ("tracestate", "s" * 512), ("x-request-id", "r" * 512)))
    data = wire.encode(wire.request_to_wire(req))
    assert max_payload - 8192 < len(data) <= max_payload
    back = wire.request_from_wire(wire.decode_generate(data))
    assert back.passthrough == req.passthrough and len(back.prompt_tokens) == n and back.block_hashes == []
