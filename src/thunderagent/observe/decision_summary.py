"""Summary of a decision log (``thunderagent explain --log``): what the router decided and why.

Every decision falls in exactly one cache class, by the candidates' overlaps at routing time:

- ``hit``: the chosen worker holds the longest cached prefix any candidate held (> 0 blocks);
- ``elsewhere``: some candidate held more of the prompt than the chosen one; ``elsewhere_why`` says
  why (:func:`why_elsewhere`): the policy ignores the cache, a hot prefix's replica, all workers
  busy, the best holders busy-filtered, or their load outweighed the cache (cost);
- ``miss``: no candidate held any of the prompt (no cached prefix anywhere).

Workers: how often each was chosen, busy-filtered (a candidate marked busy), or no candidate at
all and why (``skipped``: the live fleet records unavailable, unhealthy, tried-before workers).
Lines of several runs (``thunderagent sim`` rows, tagged ``run``) are summarised per run; the live
server's lines have no tag and are summarised as ``serve``.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["LogError", "log_files", "read_lines", "summarise", "why_elsewhere"]

_NUM = re.compile(r"\d+(?:\.\d+)?")
#: reasons listed per run (the rest are summed under "other")
TOP_REASONS = 20


class LogError(ValueError):
    """A decision log cannot be read; the message names the file and line."""


class _Candidate(msgspec.Struct):
    worker: str
    overlap_blocks: int
    busy: bool


class _Line(msgspec.Struct):
    """What the summary reads of a line (``observe.decision_log.decision_line`` writes more)."""

    request_id: str
    worker: str
    policy: str
    reason: str
    prompt_tokens: int
    overlap_blocks: int
    predicted_tokens: int
    best_known_tokens: int
    queue_wait: float
    candidates: list[_Candidate]
    run: str = "serve"
    tried: list[str] = []
    skipped: dict[str, str] = {}


def log_files(paths: Iterable[Path]) -> list[Path]:
    """Each given file preceded by its rotated files that exist (``F.N`` ... ``F.1``): oldest first."""
    out: list[Path] = []
    for p in paths:
        rotated = sorted((q for q in p.parent.glob(f"{p.name}.*") if q.suffix[1:].isdigit()),
                         key=lambda q: -int(q.suffix[1:]))
        out += [q for q in (*rotated, p) if q not in out and q.exists()]
    return out


def read_lines(files: Iterable[Path]) -> Iterator[dict[str, Any]]:
    dec = msgspec.json.Decoder(dict[str, Any])
    # Each line is decoded twice: once against the fields the summary reads, so a line of another
    # shape is an error naming its file, line and field (not a KeyError deep in the summary), and
    # once as the plain dict the summary takes. ``explain`` is offline; the check is worth the time.
    check = msgspec.json.Decoder(_Line)
    for f in files:
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    check.decode(raw)
                    yield dec.decode(raw)
                except msgspec.ValidationError as exc:
                    raise LogError(f"{f}:{n}: not a decision line: {exc}") from exc
                except msgspec.DecodeError as exc:
                    if raw.endswith(b"\n"):
                        raise LogError(f"{f}:{n}: not a decision line: {exc}") from exc
                    # a last line cut short (the writer was killed mid-write): nothing follows it


def reason_kind(reason: str) -> str:
    """A reason with its numbers replaced by ``#``, so decisions group by kind."""
    return _NUM.sub("#", reason)


def why_elsewhere(line: dict[str, Any]) -> str:
    """Why a decision did not go to the worker holding the most of the prompt."""
    cands = line["candidates"]
    best = max(c["overlap_blocks"] for c in cands)
    holders = [c for c in cands if c["overlap_blocks"] == best]
    if line["policy"] != "kv_aware":
        return f"policy {line['policy']} ignores the cache"
    if "hot_prefix" in line:
        return "hot prefix: sent to a replica"
    if "all workers busy" in line["reason"]:
        return "all workers busy"
    if all(c["busy"] for c in holders):
        return "best holder busy-filtered"
    return "load outweighed the cache (lower cost elsewhere)"


def cache_class(line: dict[str, Any]) -> str:
    best = max((c["overlap_blocks"] for c in line["candidates"]), default=0)
    if best == 0:
        return "miss"
    return "hit" if line["overlap_blocks"] >= best else "elsewhere"


def summarise(lines: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run (``run`` tag; ``serve`` when none), the summary described in the module docstring."""
    runs: dict[str, _Run] = defaultdict(_Run)
    for line in lines:
        runs[line.get("run", "serve")].add(line)
    return {name: r.summary() for name, r in runs.items()}


class _Run:
    def __init__(self) -> None:
        self.decisions = 0
        self.requests: set[str] = set()
        self.retries = 0
        self.reasons: Counter[str] = Counter()
        self.cache: Counter[str] = Counter({"hit": 0, "elsewhere": 0, "miss": 0})
        self.elsewhere: Counter[str] = Counter()
        self.chosen: Counter[str] = Counter()
        self.busy: Counter[str] = Counter()
        self.skipped: dict[str, Counter[str]] = defaultdict(Counter)
        self.prompt_tokens = 0
        self.predicted_tokens = 0
        self.best_known_tokens = 0
        self.waits: list[float] = []
        self.affinity = 0  # held requests sent ahead of the queue's next for their cache

    def add(self, line: dict[str, Any]) -> None:
        self.decisions += 1
        self.requests.add(line["request_id"])
        self.retries += bool(line.get("tried"))
        self.reasons[reason_kind(line["reason"])] += 1
        kind = cache_class(line)
        self.cache[kind] += 1
        if kind == "elsewhere":
            self.elsewhere[why_elsewhere(line)] += 1
        self.chosen[line["worker"]] += 1
        for c in line["candidates"]:
            self.busy[c["worker"]] += c["busy"]
        for wid, why in line.get("skipped", {}).items():
            self.skipped[wid][why] += 1
        self.prompt_tokens += line["prompt_tokens"]
        self.predicted_tokens += line["predicted_tokens"]
        self.best_known_tokens += line["best_known_tokens"]
        self.waits.append(line["queue_wait"])
        self.affinity += bool(line.get("affinity"))

    def summary(self) -> dict[str, Any]:
        n = self.decisions
        top = self.reasons.most_common(TOP_REASONS)
        other = n - sum(k for _, k in top)
        workers = sorted({*self.chosen, *self.busy, *self.skipped})
        return {
            "decisions": n,
            "requests": len(self.requests),
            "retries": self.retries,
            "cache": dict(self.cache),
            "cache_rates": {k: round(v / n, 4) for k, v in self.cache.items()} if n else {},
            "elsewhere_why": dict(self.elsewhere.most_common()),
            "by_reason": dict(top) | ({"other": other} if other else {}),
            "workers": {w: {"chosen": self.chosen[w], "busy_filtered": self.busy[w],
                            "skipped": dict(self.skipped[w].most_common())} for w in workers},
            "tokens": {"prompt": self.prompt_tokens, "predicted_cached": self.predicted_tokens,
                       "best_known_cached": self.best_known_tokens},
            "queue_wait_s": {"mean": round(sum(self.waits) / n, 6) if n else 0.0,
                             "max": round(max(self.waits, default=0.0), 6),
                             "sent_ahead_for_cache": self.affinity},
        }
