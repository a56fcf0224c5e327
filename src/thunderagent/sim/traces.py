"""Trace loaders: Mooncake JSONL and kv-cache-tester JSON, turned into :class:`TraceRequest` s.

No trace publishes prompt text. What they publish are *block ids*: two requests carrying the same id
at the same position share that block of prompt (and, the ids being prefix hashes, everything before
it). We turn ids into synthetic token ids exactly as Dynamo's mocker does
(Dynamo 1.6.1 ``dynamo.mocker`` trace replay), so prefix reuse measured here is comparable with it:

* ids are **interned** to dense ids ``0, 1, 2, ...`` in order of first appearance, in dispatch
  (arrival) order, so token values stay small;
* each dense id ``c`` expands to ``trace_block_size`` copies of the token ``c``, truncated at
  ``input_length``: a prompt ending inside a trace block still shares the full engine blocks of that
  trace block with a longer request carrying the same id (the engine's block size is independent of
  the trace's; 512 Mooncake, 64 kv-cache-tester);
* if ``input_length`` exceeds ``len(block_ids) * trace_block_size`` (kv-cache-tester lists only full
  64-token blocks, so its ``in % 64`` tail always does), the remaining tokens are **padding unique to
  the request**: ``PAD_BASE + ordinal``, ``ordinal`` being the request's position in the loaded trace.
  Dense ids stay below ``PAD_BASE`` (2**31), so padding never equals a block token and never equals
  another request's padding: no false sharing. Padding is never shared with anything (we cannot know
  what the tail held), which is the conservative choice.

Tokens are built per call by :meth:`TraceRequest.tokens`; a whole trace is never materialised (the
Mooncake conversation trace alone has ~145 M prompt tokens).

Arrivals (``arrival_s``) are seconds relative to the trace's first arrival, **before** any speedup (a
driver divides by its speedup). Dispatch order = arrival order; the order in which requests appear in
the input (file order, then line/flattened order) breaks ties.

Mooncake (``*.jsonl``, one object per line, see ``traces/mooncake/README.md``)
    ``arrival_s = (timestamp - min timestamp) / 1000``; ``input_length`` missing ->
    ``len(hash_ids) * 512``; ``output_length`` required; ``session_id`` (optional) -> ``session``.
    Ids are global to the file.

kv-cache-tester (``*.json``, one conversation per file, or a folder of them; see
``traces/kv-cache-tester/README.md``). Arrival rules, checked against the 32 shared files:

* A plain request (``type`` ``"n"`` / ``"s"``) arrives at ``base + t``, ``t`` being its recorded
  seconds from the start of its conversation (``base`` = 0) or sub-agent (``base`` = sub-agent
  start). ``t`` already contains the think time: for every pair of successive requests where the
  earlier one records ``api_time`` (3,125 pairs), ``t[i] = t[i-1] + api_time[i-1] + think_time[i]``
  to within 1 s (the file rounds to whole seconds); replaying ``t`` therefore replays the recorded
  client delays. (The 11 exceptions follow a streaming request that has no ``api_time``; there the
  recorded ``t`` wins.) ``think_time`` is kept in :attr:`TraceRequest.think_s` for closed-loop
  drivers (``delay after the previous response of the same session``).
  If ``t`` is missing: ``previous arrival + previous api_time (0 if absent) + think_time (0 if
  absent)``. Arrivals within one conversation/sub-agent are made non-decreasing (never earlier than
  the previous request of the same stream).
* A ``"subagent"`` entry is a tool call of the parent that ran a nested agent. Its ``t`` is when
  the sub-agent **finished** (when the parent got the tool result) and ``duration_ms`` its run time,
  so it **started** at ``t - duration_ms/1000``: in every file this is 0.1-1 s after the end
  (``t + api_time``) of the parent request that spawned it; sub-agents spawned together share one
  start (parallel sub-agents), and the parent's next request comes after the last one finished.
  Its requests arrive at ``start + their own t`` (sub-agents nest recursively). Without
  ``duration_ms``, ``t`` is taken as the start. A start is never earlier than the spawning request.
  Sub-agent requests share the conversation's id namespace (``hash_id_scope`` is per conversation)
  and get ``session = "<conversation>/<agent_id>"``; parent requests ``session = "<conversation>"``.
* ``hash_id_scope: "local"`` (all shared files): ids are namespaced per conversation (per file), so
  the same integer in two files is two different blocks. ``"global"``: ids are shared by all files
  of one :func:`load_trace` folder.
* Several conversations of one folder all start at time 0 (concurrent users, as the repository's
  replay tool starts its users); each one keeps its recorded internal timing.

:func:`load_traces` merges several paths: each keeps its own namespace (ids of different paths
never collide), arrivals are relative to each path's first arrival, and the union is sorted by
arrival (path order, then input order, breaks ties) and re-interned.

Bad input raises :class:`TraceError` (a ``ValueError``) naming the file, the line (JSONL) or the
JSON location (``requests[3].requests[1]``; kv-cache-tester files are one line), and the field.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import filterfalse
from os import PathLike
from pathlib import Path
from typing import Any

import xxhash

__all__ = [
    "KVTESTER_BLOCK_SIZE",
    "MOONCAKE_BLOCK_SIZE",
    "PAD_BASE",
    "TraceError",
    "TraceRequest",
    "detect_format",
    "load_kvtester",
    "load_mooncake",
    "load_trace",
    "load_traces",
]

MOONCAKE_BLOCK_SIZE = 512
KVTESTER_BLOCK_SIZE = 64
#: first padding token; dense block ids must stay below it.
PAD_BASE = 1 << 31

StrPath = str | PathLike[str]


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, line or location, and field."""


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace (or of a synthetic workload).

    ``block_ids`` are dense ids of ``trace_block_size``-token content blocks; :meth:`tokens` expands
    them into the synthetic prompt. ``session`` groups the requests of one conversation / program
    (None for independent requests). ``think_s`` is the recorded client delay between the previous
    response of the same session and this request, when the source records one (None otherwise).
    ``pad_token`` is the token used past the last listed block (see the module docstring); None
    derives one from ``request_id``.
    """

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    block_ids: list[int]
    trace_block_size: int
    session: str | None = None
    think_s: float | None = None
    pad_token: int | None = None
    priority: int = 0  # scheduler tier (higher first); traces carry none, generators may set it

    def tokens(self) -> array:
        """Exactly ``input_length`` synthetic tokens (``array('I')``), built on each call."""
        n = self.input_length
        bs = self.trace_block_size
        ids = self.block_ids
        k = min(len(ids), -(-n // bs))  # blocks that contribute tokens
        covered = min(n, k * bs)
        out = array("I", bytes(4 * max(n, k * bs)))
        if k:
            if k < bs:  # few blocks: one C-level fill per block
                for i in range(k):
                    out[i * bs : (i + 1) * bs] = array("I", (ids[i],)) * bs
            else:  # many blocks: one strided C-level copy per position in the block
                src = array("I", ids[:k])
                for j in range(bs):
                    out[j : k * bs : bs] = src
            if k * bs > n:  # the last trace block is truncated at input_length
                del out[n:]
        if covered < n:
            pad = self.pad_token
            if pad is None:
                pad = PAD_BASE + (xxhash.xxh3_64_intdigest(self.request_id.encode()) & (PAD_BASE - 1))
            out[covered:n] = array("I", (pad,)) * (n - covered)
        return out


# ---------------------------------------------------------------------------------------------
# Parsing: raw records with namespaced (not yet interned) ids
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Raw:
    request_id: str
    arrival: float
    seq: int  # input order (global across merged paths): breaks arrival ties
    input_length: int
    output_length: int
    ns: object  # namespace key of the ids
    ids: list[int]
    block_size: int
    session: str | None
    think_s: float | None


def _err(path: Path, where: str, field: str | None, msg: str) -> TraceError:
    f = f" field '{field}':" if field else ""
    return TraceError(f"{path}: {where}:{f} {msg}")


def _num(obj: dict[str, Any], key: str, path: Path, where: str, *, required: bool = True) -> float | None:
    v = obj.get(key)
    if v is None:
        if required:
            raise _err(path, where, key, "missing")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _err(path, where, key, f"expected a finite number, got {v!r}")
    return float(v)


def _int(obj: dict[str, Any], key: str, path: Path, where: str, *, minimum: int, required: bool = True) -> int | None:
    v = obj.get(key)
    if v is None:
        if required:
            raise _err(path, where, key, "missing")
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(path, where, key, f"expected an integer, got {v!r}")
    if v < minimum:
        raise _err(path, where, key, f"must be >= {minimum}, got {v}")
    return v


def _ids(obj: dict[str, Any], key: str, path: Path, where: str) -> list[int]:
    v = obj.get(key)
    if v is None:
        raise _err(path, where, key, "missing")
    if not isinstance(v, list):
        raise _err(path, where, key, f"expected a list of integers, got {type(v).__name__}")
    if not set(map(type, v)) <= {int}:  # C-speed check; bools and floats rejected
        i, x = next((i, x) for i, x in enumerate(v) if type(x) is not int)
        raise _err(path, where, key, f"element {i} is not an integer: {x!r}")
    return v


def _parse_mooncake(path: Path, ns: object, seq0: int) -> list[_Raw]:
    stem = path.stem
    out: list[_Raw] = []
    try:
        fh = path.open("r", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e}") from e
    with fh:
        row = 0
        for lineno, line in enumerate(fh, 1):
            s = line.strip()
            if not s:
                continue
            where = f"line {lineno}"
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise _err(path, where, None, f"invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(obj, dict):
                raise _err(path, where, None, f"expected a JSON object, got {type(obj).__name__}")
            ts = _num(obj, "timestamp", path, where)
            ids = _ids(obj, "hash_ids", path, where)
            il = _int(obj, "input_length", path, where, minimum=1, required=False)
            if il is None:
                il = len(ids) * MOONCAKE_BLOCK_SIZE
                if il == 0:
                    raise _err(path, where, "input_length", "missing and hash_ids is empty")
            ol = _int(obj, "output_length", path, where, minimum=0)
            sid = obj.get("session_id")
            out.append(
                _Raw(f"{stem}:{row}", ts, seq0 + row, il, ol, ns, ids, MOONCAKE_BLOCK_SIZE,
                     None if sid is None else str(sid), None)
            )
            row += 1
    if not out:
        raise TraceError(f"{path}: no requests")
    t0 = min(r.arrival for r in out)  # ms: re-base before converting, as the mocker does
    for r in out:
        r.arrival = (r.arrival - t0) / 1000.0
    return out


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from e


def _parse_kvtester_doc(doc: Any, path: Path, ns: object, seq0: int) -> list[_Raw]:
    """One conversation (already decoded). Arrivals relative to the conversation start (t = 0)."""
    if not isinstance(doc, dict):
        raise _err(path, "top level", None, f"expected a JSON object, got {type(doc).__name__}")
    bs = _int(doc, "block_size", path, "top level", minimum=1, required=False) or KVTESTER_BLOCK_SIZE
    conv = doc.get("id")
    conv = str(conv) if conv not in (None, "") else path.stem
    reqs = doc.get("requests")
    if not isinstance(reqs, list):
        raise _err(path, "top level", "requests", "missing or not a list")
    out: list[_Raw] = []

    def walk(items: list[Any], base: float, loc: str, session: str, rid: str) -> None:
        prev_arrival: float | None = None
        prev_api = 0.0
        for i, r in enumerate(items):
            where = f"{loc}[{i}]"
            if not isinstance(r, dict):
                raise _err(path, where, None, f"expected a JSON object, got {type(r).__name__}")
            if r.get("type") == "subagent":
                subs = r.get("requests")
                if not isinstance(subs, list):
                    raise _err(path, where, "requests", "sub-agent without a requests list")
                t = _num(r, "t", path, where, required=False)
                dur = _num(r, "duration_ms", path, where, required=False)
                if t is None:
                    start = base if prev_arrival is None else prev_arrival + prev_api
                else:
                    start = base + t - (dur / 1000.0 if dur is not None else 0.0)
                start = max(start, base if prev_arrival is None else prev_arrival)
                agent = r.get("agent_id")
                agent = str(agent) if agent not in (None, "") else f"sub{i}"
                walk(subs, start, f"{where}.requests", f"{session}/{agent}", f"{rid}{i}.")
                continue
            t = _num(r, "t", path, where, required=False)
            think = _num(r, "think_time", path, where, required=False)
            if t is not None:
                arrival = base + t
            elif prev_arrival is None:
                arrival = base
            else:
                arrival = prev_arrival + prev_api + (think or 0.0)
            if prev_arrival is not None and arrival < prev_arrival:
                arrival = prev_arrival
            il = _int(r, "in", path, where, minimum=1)
            ol = _int(r, "out", path, where, minimum=0)
            ids = _ids(r, "hash_ids", path, where)
            api = _num(r, "api_time", path, where, required=False)
            out.append(_Raw(f"{rid}{i}", arrival, seq0 + len(out), il, ol, ns, ids, bs, session, think))
            prev_arrival = arrival
            prev_api = api or 0.0

    walk(reqs, 0.0, "requests", conv, f"{conv}:")
    return out


def _scope_ns(doc: Any, file_ns: object, folder_ns: object) -> object:
    if isinstance(doc, dict) and doc.get("hash_id_scope") == "global":
        return folder_ns
    return file_ns


def _parse_kvtester_files(files: list[Path], ns: object, seq0: int) -> list[_Raw]:
    out: list[_Raw] = []
    for k, f in enumerate(files):
        doc = _read_json(f)
        out += _parse_kvtester_doc(doc, f, _scope_ns(doc, (ns, k), (ns, "global")), seq0 + len(out))
    if not out:
        raise TraceError(f"{files[0] if len(files) == 1 else files[0].parent}: no requests")
    t0 = min(r.arrival for r in out)
    if t0:
        for r in out:
            r.arrival -= t0
    return out


def detect_format(path: StrPath) -> str:
    """``"mooncake"`` or ``"kv-cache-tester"``: a folder is a kv-cache-tester folder; a ``.jsonl``
    file is Mooncake; otherwise the content decides (a JSON object with ``requests`` ->
    kv-cache-tester; JSON objects per line with ``hash_ids`` -> Mooncake)."""
    p = Path(path)
    if p.is_dir():
        return "kv-cache-tester"
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory")
    if p.suffix.lower() == ".jsonl":
        return "mooncake"
    try:
        with p.open("r", encoding="utf-8") as fh:
            head = fh.read(1 << 16)
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{p}: cannot read: {e}") from e
    first = head.lstrip().split("\n", 1)[0].strip()
    if first.startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError:
            obj = None  # a pretty-printed or >64 KiB one-line document: decide on key names below
        if isinstance(obj, dict):
            if "requests" in obj:
                return "kv-cache-tester"
            if "hash_ids" in obj:
                return "mooncake"
        elif '"requests"' in head:
            return "kv-cache-tester"
        elif '"hash_ids"' in first and '"timestamp"' in first:
            return "mooncake"
    raise TraceError(f"{p}: unrecognised trace format (expected Mooncake JSONL or kv-cache-tester JSON)")


def _parse_path(path: StrPath, ns: object, seq0: int) -> list[_Raw]:
    p = Path(path)
    fmt = detect_format(p)
    if fmt == "mooncake":
        return _parse_mooncake(p, ns, seq0)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.json") if f.is_file())
        if not files:
            raise TraceError(f"{p}: folder holds no *.json trace files")
        return _parse_kvtester_files(files, ns, seq0)
    return _parse_kvtester_files([p], ns, seq0)


def _finalize(raws: list[_Raw]) -> list[TraceRequest]:
    """Sort by (arrival, input order), re-base at the first arrival, intern ids densely in dispatch
    order per namespace, assign padding tokens."""
    raws.sort(key=lambda r: (r.arrival, r.seq))
    t0 = raws[0].arrival if raws else 0.0
    maps: dict[object, dict[int, int]] = {}
    next_id = 0
    out: list[TraceRequest] = []
    for k, r in enumerate(raws):
        m = maps.get(r.ns)
        if m is None:
            m = maps[r.ns] = {}
        for h in filterfalse(m.__contains__, dict.fromkeys(r.ids)):
            m[h] = next_id
            next_id += 1
        out.append(
            TraceRequest(
                r.request_id, r.arrival - t0, r.input_length, r.output_length, list(map(m.__getitem__, r.ids)),
                r.block_size, r.session, r.think_s, PAD_BASE + k,
            )
        )
    if next_id >= PAD_BASE or len(out) >= PAD_BASE:
        raise TraceError("trace too large: dense block ids or request count reach 2**31")
    return out


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
def load_trace(path: StrPath) -> list[TraceRequest]:
    """Load one trace (Mooncake JSONL file, kv-cache-tester JSON file or folder), format
    auto-detected; requests sorted by arrival."""
    return _finalize(_parse_path(path, 0, 0))


def load_mooncake(path: StrPath) -> list[TraceRequest]:
    """Load a Mooncake JSONL trace whatever its file name."""
    return _finalize(_parse_mooncake(Path(path), 0, 0))


def load_kvtester(path: StrPath) -> list[TraceRequest]:
    """Load a kv-cache-tester conversation file, or a folder of them (``*.json`` in name order)."""
    p = Path(path)
    files = sorted(f for f in p.glob("*.json") if f.is_file()) if p.is_dir() else [p]
    if not files:
        raise TraceError(f"{p}: folder holds no *.json trace files")
    return _finalize(_parse_kvtester_files(files, 0, 0))


def load_traces(paths: Iterable[StrPath]) -> list[TraceRequest]:
    """Merge several traces: ids namespaced per path (never collide), each path's arrivals
    relative to its own first arrival, union sorted by arrival (path order breaks ties). Request
    ids are prefixed with ``"<path index>/"`` when two paths would otherwise yield the same id."""
    per_path: list[list[_Raw]] = []
    seq = 0
    for k, p in enumerate(paths):
        raws = _parse_path(p, ("path", k), seq)
        seq += len(raws)
        per_path.append(raws)
    seen: set[str] = set()
    clash = False
    for raws in per_path:
        ids = {r.request_id for r in raws}
        clash = clash or not seen.isdisjoint(ids)
        seen |= ids
    if clash:
        for k, raws in enumerate(per_path):
            for r in raws:
                r.request_id = f"{k}/{r.request_id}"
    return _finalize([r for raws in per_path for r in raws])
