"""Trace loaders (sim.traces): formats, arrivals, interning, namespacing, tokens, errors."""

from __future__ import annotations

import json
import math
import random
from array import array
from pathlib import Path

import pytest

from thunderagent.sim.traces import (
    PAD_BASE,
    TraceError,
    TraceRequest,
    detect_format,
    load_kvtester,
    load_mooncake,
    load_trace,
    load_traces,
)

DATA = Path(__file__).parents[1] / "data"


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _naive_tokens(tr: TraceRequest) -> list[int]:
    toks = [c for c in tr.block_ids for _ in range(tr.trace_block_size)][: tr.input_length]
    return toks + [tr.pad_token] * (tr.input_length - len(toks))


# ---------------------------------------------------------------------------------------------
# Mooncake
# ---------------------------------------------------------------------------------------------
TINY_MOONCAKE = [
    {"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [7, 9]},
    {"timestamp": 1500, "input_length": 1024, "output_length": 6, "hash_ids": [7, 9]},
    {"timestamp": 1500, "output_length": 1, "hash_ids": [3]},  # no input_length -> 1 * 512
    {"timestamp": 1200, "input_length": 600, "output_length": 2, "hash_ids": [9, 3]},  # earlier than line 2
    {"timestamp": 2000, "input_length": 600, "output_length": 0, "hash_ids": [7], "session_id": 42},  # 88 pad tokens
]


def test_mooncake_tiny_arrivals_order_interning(tmp_path: Path) -> None:
    reqs = load_trace(_jsonl(tmp_path / "tiny.jsonl", TINY_MOONCAKE))
    # dispatch order = arrival order; rows 1 and 2 tie at 1500 ms -> file order
    assert [r.request_id for r in reqs] == ["tiny:0", "tiny:3", "tiny:1", "tiny:2", "tiny:4"]
    # seconds relative to the first timestamp (1000 ms), before any speedup
    assert [r.arrival_s for r in reqs] == [0.0, 0.2, 0.5, 0.5, 1.0]
    assert [r.input_length for r in reqs] == [700, 600, 1024, 512, 600]
    assert [r.output_length for r in reqs] == [5, 2, 6, 1, 0]
    # interned densely in dispatch order: 7 -> 0, 9 -> 1 (row 0), 3 -> 2 (row 3, dispatched 2nd)
    assert [r.block_ids for r in reqs] == [[0, 1], [1, 2], [0, 1], [2], [0]]
    assert all(r.trace_block_size == 512 for r in reqs)
    assert [r.session for r in reqs] == [None, None, None, None, "42"]
    assert all(r.think_s is None for r in reqs)


def test_mooncake_tokens_exact(tmp_path: Path) -> None:
    reqs = load_trace(_jsonl(tmp_path / "tiny.jsonl", TINY_MOONCAKE))
    r0, r1, r2, r3, r4 = reqs
    t0 = r0.tokens()
    assert isinstance(t0, array) and t0.typecode == "I"
    # 700 tokens: block 0 full (512 x token 0), then the partial last block (188 x token 1)
    assert t0.tolist() == [0] * 512 + [1] * 188
    assert r2.tokens().tolist() == [0] * 512 + [1] * 512
    assert r3.tokens().tolist() == [2] * 512
    # 600 tokens but one 512-token block listed: 88 padding tokens unique to the request
    t4 = r4.tokens().tolist()
    assert t4[:512] == [0] * 512
    assert len(set(t4[512:])) == 1 and t4[512] >= PAD_BASE
    assert t4[512] == r4.pad_token
    assert len({r.pad_token for r in reqs}) == len(reqs)
    for r in reqs:
        assert len(r.tokens()) == r.input_length
        assert r.tokens().tolist() == _naive_tokens(r)


def test_mooncake_excerpt() -> None:
    reqs = load_trace(DATA / "mooncake_excerpt.jsonl")
    assert detect_format(DATA / "mooncake_excerpt.jsonl") == "mooncake"
    assert len(reqs) == 200
    assert reqs[0].arrival_s == 0.0 and reqs[-1].arrival_s == 72.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert [r.request_id for r in reqs] == [f"mooncake_excerpt:{i}" for i in range(200)]  # already sorted
    assert sum(r.input_length for r in reqs) == 2_782_179
    assert sum(len(r.block_ids) for r in reqs) == 5_537
    # 5,215 distinct ids, interned densely in order of first appearance
    firsts: list[int] = []
    seen: set[int] = set()
    for r in reqs:
        for b in r.block_ids:
            if b not in seen:
                seen.add(b)
                firsts.append(b)
    assert firsts == list(range(5_215))
    assert all(r.block_ids[0] == 0 for r in reqs)  # every conversation starts with the same block
    assert all(len(r.block_ids) == math.ceil(r.input_length / 512) for r in reqs)
    for r in reqs[:20]:
        assert len(r.tokens()) == r.input_length


def test_load_mooncake_any_extension_and_sniffing(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "rows.json", TINY_MOONCAKE)  # not .jsonl: content decides
    assert detect_format(p) == "mooncake"
    assert [r.request_id for r in load_trace(p)] == ["rows:0", "rows:3", "rows:1", "rows:2", "rows:4"]
    assert len(load_mooncake(p)) == 5


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"input_length": 10, "output_length": 1, "hash_ids": [1]}, "timestamp"),
        ({"timestamp": 0, "input_length": 10, "hash_ids": [1]}, "output_length"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1}, "hash_ids"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "x"]}, "hash_ids"),
        ({"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": [1]}, "input_length"),
        ({"timestamp": 0, "input_length": 1.5, "output_length": 1, "hash_ids": [1]}, "input_length"),
        ({"timestamp": "0", "input_length": 10, "output_length": 1, "hash_ids": [1]}, "timestamp"),
        ({"timestamp": 0, "output_length": 1, "hash_ids": []}, "input_length"),
    ],
)
def test_mooncake_bad_field(tmp_path: Path, row: dict[str, object], field: str) -> None:
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    p = _jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    msg = str(ei.value)
    assert "bad.jsonl" in msg and "line 2" in msg and f"'{field}'" in msg
    assert isinstance(ei.value, ValueError)


def test_mooncake_bad_json_and_empty(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "bad.jsonl", [{"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "", "{not json"])
    with pytest.raises(TraceError, match=r"bad\.jsonl: line 3: invalid JSON"):
        load_trace(p)
    p = _jsonl(tmp_path / "arr.jsonl", ["[1, 2]"])
    with pytest.raises(TraceError, match=r"line 1: expected a JSON object"):
        load_trace(p)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")


def test_unrecognised_and_missing(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"foo": 1}')
    with pytest.raises(TraceError, match="unrecognised trace format"):
        load_trace(tmp_path / "x.json")
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(TraceError, match=r"no \*\.json"):
        load_trace(tmp_path / "empty_dir")


# ---------------------------------------------------------------------------------------------
# kv-cache-tester
# ---------------------------------------------------------------------------------------------
CONV_A = {
    "id": "convA",
    "block_size": 4,
    "hash_id_scope": "local",
    "requests": [
        {"t": 0.0, "type": "n", "in": 10, "out": 3, "hash_ids": [1, 2], "api_time": 2.0, "think_time": 0.0},
        {  # finished at t = 30 after 20 s: started at 10; its requests arrive at 10 + t
            "t": 30.0,
            "type": "subagent",
            "agent_id": "agent_001",
            "duration_ms": 20000,
            "requests": [
                {"t": 0.0, "type": "n", "in": 8, "out": 1, "hash_ids": [5, 6], "api_time": 1.0, "think_time": 0.0},
                {"t": 4.0, "type": "n", "in": 12, "out": 1, "hash_ids": [5, 6, 7], "api_time": 1.0, "think_time": 3.0},
            ],
        },
        {"t": 35.0, "type": "n", "in": 12, "out": 2, "hash_ids": [1, 2, 3], "api_time": 1.0, "think_time": 33.0},
        # no t: previous arrival 35 + its api_time 1 + think_time 5 = 41
        {"type": "s", "in": 13, "out": 2, "hash_ids": [1, 2, 3], "think_time": 5.0},
    ],
}
# same raw ids as convA: a different conversation, so different blocks ("local" scope)
CONV_B = {
    "id": "convB",
    "block_size": 4,
    "hash_id_scope": "local",
    "requests": [
        {"t": 0.0, "type": "n", "in": 8, "out": 1, "hash_ids": [1, 2]},
        {"t": 12.0, "type": "n", "in": 9, "out": 1, "hash_ids": [1, 2]},
    ],
}


def _folder(tmp_path: Path, docs: dict[str, object]) -> Path:
    d = tmp_path / "kvt"
    d.mkdir()
    for name, doc in docs.items():
        (d / name).write_text(json.dumps(doc))
    (d / "README.md").write_text("not a trace")  # ignored: only *.json
    return d


def test_kvtester_folder_arrivals_subagents_namespacing(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"b_second.json": CONV_B, "a_first.json": CONV_A})  # name order: A, B
    assert detect_format(folder) == "kv-cache-tester"
    reqs = load_trace(folder)
    got = [(r.request_id, r.arrival_s, r.session) for r in reqs]
    assert got == [
        ("convA:0", 0.0, "convA"),  # both conversations start at 0; file (name) order breaks the tie
        ("convB:0", 0.0, "convB"),
        ("convA:1.0", 10.0, "convA/agent_001"),  # sub-agent start = 30 - 20000 ms
        ("convB:1", 12.0, "convB"),
        ("convA:1.1", 14.0, "convA/agent_001"),
        ("convA:2", 35.0, "convA"),
        ("convA:3", 41.0, "convA"),
    ]
    ids = {r.request_id: r.block_ids for r in reqs}
    # dense ids in dispatch order, namespaced per conversation (convB's 1, 2 are not convA's 1, 2);
    # sub-agents share their conversation's namespace
    assert ids == {
        "convA:0": [0, 1],
        "convB:0": [2, 3],
        "convA:1.0": [4, 5],
        "convB:1": [2, 3],
        "convA:1.1": [4, 5, 6],
        "convA:2": [0, 1, 7],
        "convA:3": [0, 1, 7],
    }
    by = {r.request_id: r for r in reqs}
    assert [by[k].think_s for k in ("convA:0", "convA:1.0", "convA:1.1", "convA:2", "convA:3")] == [0, 0, 3, 33, 5]
    assert by["convB:1"].think_s is None
    assert [by[k].input_length for k in ("convA:0", "convA:3", "convB:1")] == [10, 13, 9]
    assert [by[k].output_length for k in ("convA:0", "convA:3", "convB:1")] == [3, 2, 1]
    assert all(r.trace_block_size == 4 for r in reqs)
    # tokens: each id 4 times, then the untracked tail (in % 4) as padding unique to the request
    pa, pb = by["convA:3"].pad_token, by["convB:1"].pad_token
    assert by["convA:3"].tokens().tolist() == [0] * 4 + [1] * 4 + [7] * 4 + [pa]
    assert by["convB:1"].tokens().tolist() == [2] * 4 + [3] * 4 + [pb]
    assert pa != pb and min(pa, pb) >= PAD_BASE
    assert by["convA:0"].tokens().tolist() == [0] * 4 + [1] * 4 + [by["convA:0"].pad_token] * 2
    assert load_kvtester(folder) == reqs


def test_kvtester_single_file_and_global_scope(tmp_path: Path) -> None:
    p = tmp_path / "conv.txt"  # odd extension: content decides
    p.write_text(json.dumps(CONV_B))
    assert detect_format(p) == "kv-cache-tester"
    reqs = load_trace(p)
    got = [(r.request_id, r.arrival_s, r.block_ids) for r in reqs]
    assert got == [("convB:0", 0.0, [0, 1]), ("convB:1", 12.0, [0, 1])]
    # "global" scope: ids shared across the files of one folder
    ga = dict(CONV_B, id="g1", hash_id_scope="global")
    gb = dict(CONV_B, id="g2", hash_id_scope="global")
    reqs = load_trace(_folder(tmp_path, {"1.json": ga, "2.json": gb}))
    assert {r.request_id: r.block_ids for r in reqs} == {k: [0, 1] for k in ("g1:0", "g2:0", "g1:1", "g2:1")}


def test_kvtester_subagent_without_duration_and_clamps(tmp_path: Path) -> None:
    doc = {
        "id": "c",
        "requests": [  # no block_size: 64
            {"t": 5.0, "in": 64, "out": 1, "hash_ids": [1]},
            # no duration_ms: t is the start offset
            {"t": 7.0, "type": "subagent", "requests": [{"t": 1.0, "in": 64, "out": 1, "hash_ids": [2]}]},
            # would start at 2 - 10 = -8, before the request that spawned it (5): clamped to 5
            {"t": 2.0, "type": "subagent", "duration_ms": 10000,
             "requests": [{"t": 0.5, "in": 64, "out": 1, "hash_ids": [3]}]},
            {"t": 4.0, "in": 70, "out": 1, "hash_ids": [1]},  # earlier than its predecessor (5): kept at 5
        ],
    }
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    reqs = load_trace(p)
    got = {r.request_id: (r.arrival_s, r.session) for r in reqs}
    # re-based at the first arrival (5 s)
    assert got == {"c:0": (0.0, "c"), "c:1.0": (3.0, "c/sub1"), "c:2.0": (0.5, "c/sub2"), "c:3": (0.0, "c")}
    assert all(r.trace_block_size == 64 for r in reqs)


def test_kvtester_excerpt() -> None:
    folder = DATA / "kv-cache-tester"
    reqs = load_trace(folder)
    # trace_0003 (truncated): 1 + 10 sub-agent + 1; trace_0022: 7; trace_0026: 3
    assert len(reqs) == 22
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert all(len(r.block_ids) == r.input_length // 64 and r.trace_block_size == 64 for r in reqs)
    sessions: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        sessions.setdefault(r.session, []).append(r)
    assert {k: len(v) for k, v in sessions.items()} == {
        "trace_0003": 2, "trace_0003/agent_001": 10, "trace_0022": 7, "trace_0026": 3,
    }
    # the recorded t of parent requests is their arrival; each conversation starts at 0
    assert [r.arrival_s for r in sessions["trace_0026"]] == [0.0, 94.0, 146.0]
    assert [r.arrival_s for r in sessions["trace_0022"]] == [0.0, 18.0, 34.0, 52.0, 330.0, 365.0, 400.0]
    assert [r.arrival_s for r in sessions["trace_0003"]] == [0.0, 153.0]
    # sub-agent: finished at t = 134.227 s after 126,015 ms -> started at 8.212 s (the parent's first
    # request ended at 0 + api_time 7.27); its requests at 8.212 + t
    sub_t = [0, 6, 14, 19, 25, 32, 39, 47, 57, 88]
    assert [r.arrival_s for r in sessions["trace_0003/agent_001"]] == pytest.approx([8.212 + t for t in sub_t])
    # recorded t already includes the think time: t[i] - t[i-1] = api_time[i-1] + think_time[i] (+-1 s)
    assert sessions["trace_0026"][1].think_s == 48.0 and sessions["trace_0026"][2].think_s == 4.0
    # namespaces: the three conversations share no block id although their raw ids overlap (1, 2, ...)
    blocks = {s: {b for r in v for b in r.block_ids} for s, v in sessions.items()}
    assert not blocks["trace_0022"] & blocks["trace_0026"]
    assert not (blocks["trace_0003"] | blocks["trace_0003/agent_001"]) & blocks["trace_0022"]
    # within a conversation, successive requests extend the same prefix
    a, b = sessions["trace_0026"][:2]
    assert b.block_ids[:200] == a.block_ids[:200]
    for r in reqs[:5]:
        assert r.tokens().tolist() == _naive_tokens(r)


@pytest.mark.parametrize(
    ("doc", "where", "field"),
    [
        ({"id": "x", "requests": [{"t": 0, "in": 10, "out": 1, "hash_ids": []}, {"t": 1, "out": 1, "hash_ids": []}]},
         "requests[1]", "in"),
        ({"id": "x", "requests": [{"t": 0, "in": 10, "out": -1, "hash_ids": []}]}, "requests[0]", "out"),
        ({"id": "x", "requests": [{"t": 0, "in": 10, "out": 1, "hash_ids": [1.5]}]}, "requests[0]", "hash_ids"),
        ({"id": "x", "requests": [{"t": "soon", "in": 10, "out": 1, "hash_ids": [1]}]}, "requests[0]", "t"),
        ({"id": "x", "requests": [{"t": 0, "type": "subagent", "requests": [{"t": 0, "in": 5, "out": 1}]}]},
         "requests[0].requests[0]", "hash_ids"),
        ({"id": "x", "requests": [{"t": 0, "type": "subagent"}]}, "requests[0]", "requests"),
        ({"id": "x", "block_size": 0, "requests": []}, "top level", "block_size"),
        ({"id": "x", "requests": 3}, "top level", "requests"),
    ],
)
def test_kvtester_bad_field(tmp_path: Path, doc: dict[str, object], where: str, field: str) -> None:
    p = tmp_path / "bad_conv.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(TraceError) as ei:
        load_kvtester(p)
    msg = str(ei.value)
    assert "bad_conv.json" in msg and f"{where}:" in msg and f"'{field}'" in msg


def test_kvtester_invalid_json(tmp_path: Path) -> None:
    p = tmp_path / "broken.json"
    p.write_text('{"id": "x", "requests": [\n{"t": 0,,}]}')
    with pytest.raises(TraceError, match=r"broken\.json: line 2: invalid JSON"):
        load_trace(p)


# ---------------------------------------------------------------------------------------------
# Merging
# ---------------------------------------------------------------------------------------------
def test_load_traces_namespaces_per_path(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa = _jsonl(tmp_path / "a" / "t.jsonl", TINY_MOONCAKE[:2])
    pb = _jsonl(tmp_path / "b" / "t.jsonl", [dict(TINY_MOONCAKE[0], timestamp=50_000)])
    reqs = load_traces([pa, pb])
    # each path relative to its own first arrival; ties broken by path order; ids clash -> prefixed
    assert [(r.request_id, r.arrival_s) for r in reqs] == [("0/t:0", 0.0), ("1/t:0", 0.0), ("0/t:1", 0.5)]
    # same raw ids [7, 9] in both files, but different namespaces
    assert [r.block_ids for r in reqs] == [[0, 1], [2, 3], [0, 1]]
    assert len({r.pad_token for r in reqs}) == 3
    # a Mooncake file and a kv-cache-tester file together: ids distinct, no prefix needed
    pk = tmp_path / "convB.json"
    pk.write_text(json.dumps(CONV_B))
    mixed = load_traces([pa, pk])
    assert [r.request_id for r in mixed] == ["t:0", "convB:0", "t:1", "convB:1"]
    assert [r.block_ids for r in mixed] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [r.trace_block_size for r in mixed] == [512, 4, 512, 4]


# ---------------------------------------------------------------------------------------------
# tokens()
# ---------------------------------------------------------------------------------------------
def test_tokens_matches_naive_expansion() -> None:
    rng = random.Random(7)
    for i in range(300):
        bs = rng.choice([1, 2, 3, 4, 8, 64])
        ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 80))]
        n = rng.randrange(1, (len(ids) + 2) * bs + 1)
        tr = TraceRequest(f"r{i}", 0.0, n, 1, ids, bs, pad_token=PAD_BASE + i)
        toks = tr.tokens()
        assert len(toks) == n
        assert toks.tolist() == _naive_tokens(tr)


def test_tokens_default_pad_is_unique_per_request() -> None:
    a = TraceRequest("a", 0.0, 6, 1, [5], 4)
    b = TraceRequest("b", 0.0, 6, 1, [5], 4)
    ta, tb = a.tokens().tolist(), b.tokens().tolist()
    assert ta[:4] == tb[:4] == [5] * 4
    assert ta[4] == ta[5] >= PAD_BASE and tb[4] >= PAD_BASE and ta[4] != tb[4]
    assert a.tokens() == a.tokens()  # deterministic
