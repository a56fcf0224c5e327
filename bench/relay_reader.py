"""The relay's event reader (``execution/openai_relay.py``): CPU per relayed stream, before vs after in one run.

A relayed answer's server-sent events are read by the worker for what routing needs (a token per event with
content, the end, usage) and passed on unchanged. This times that reading alone, in process, on a 64-token
chat stream (OpenAI's chunks; and, where the checkout has them, Anthropic's Messages events and the Responses
API's events), cut as a server writes it (one event per network read) and in one read; and the frontend's
parse of a 26 kB relayed chat body (typed fields and whole document). ``--base-src DIR``
runs the same on another checkout's code (a subprocess with its ``src`` first on the path), interleaved.

Run: ``python bench/relay_reader.py [--base-src DIR] [--streams N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import print_table  # noqa: E402


def _events(api: str, n: int = 64) -> list[bytes]:
    def sse(obj: dict, event: str | None = None) -> bytes:
        head = f"event: {event}\n".encode() if event else b""
        return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    if api == "chat":
        out = [sse({"id": "c", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}) for _ in range(n - 1)]
        out.append(sse({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length"}]}))
        return [*out, sse({"choices": [], "usage": {"completion_tokens": n}}), b"data: [DONE]\n\n"]
    if api == "messages":
        out = [sse({"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 5}}}, "message_start")]
        out += [sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "tok"}},
                    "content_block_delta") for _ in range(n)]
        out.append(sse({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                        "usage": {"output_tokens": n}}, "message_delta"))
        return [*out, sse({"type": "message_stop"}, "message_stop")]
    out = [sse({"type": "response.created", "response": {"id": "r", "status": "in_progress"}}, "response.created")]
    out += [sse({"type": "response.output_text.delta", "delta": "tok"}, "response.output_text.delta") for _ in range(n)]
    return [*out, sse({"type": "response.completed", "response": {"id": "r", "status": "completed",
                                                                   "usage": {"output_tokens": n}}},
                      "response.completed")]


class _Streamer:
    worker_id = "w"

    def _clock(self) -> float:
        return 0.0

    def _loop_time(self) -> float:
        return 0.0

    def _progress(self, r: object, n: int) -> None:
        pass


def measure(streams: int) -> dict[str, float]:
    """µs per stream, per (api, cut), on the thunderagent importable here."""
    from thunderagent.execution import openai_relay as mod

    readers = getattr(mod, "_READERS", None)
    takes_reader = "read" in inspect.signature(mod.Relay._stream).parameters
    paths = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
    out: dict[str, float] = {}
    for api, path in paths.items():
        if api != "chat" and (readers is None or path not in readers):
            continue  # an older checkout: OpenAI's streams only
        events = _events(api)
        for cut, pieces in (("one event per read", events), ("one read", [b"".join(events)])):
            async def go() -> None:
                for _ in range(streams):
                    q = types.SimpleNamespace(put_output=lambda o, now: None)
                    r = types.SimpleNamespace(req=types.SimpleNamespace(request_id="r", prompt_tokens=[1]), queue=q,
                                              started=True)

                    async def reads():  # noqa: ANN202
                        for p in pieces:
                            yield p
                    relay = mod.Relay(_Streamer())
                    if takes_reader:
                        await relay._stream(reads(), r, readers[path])  # type: ignore[index]
                    else:
                        await relay._stream(reads(), r)

            t0 = time.process_time()
            asyncio.run(go())
            out[f"{api}|{cut}"] = (time.process_time() - t0) / streams * 1e6
    out["chat body|parsed by the frontend"] = parse_us(streams * 5)
    return out


def _chat_body() -> bytes:
    """A relayed chat request of an agent 30 tool calls in (~26 kB)."""
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent. " * 200}]
    for k in range(30):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "{k}.py"}}'}}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": "def f(x):\n    return x\n" * 20})
    tools = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
    return json.dumps({"model": "m", "messages": msgs, "tools": tools, "max_tokens": 8}).encode()


def parse_us(n: int) -> float:
    """µs for the frontend to read a relayed chat body (its typed fields and its whole document)."""
    from thunderagent.frontend import relay

    body = _chat_body()
    both = getattr(relay, "decode_both", None)
    if both is not None:
        def parse() -> object:
            return both(relay._Request, body)
    else:  # an older checkout: two parses
        def parse() -> object:
            return relay._decode(body), relay._doc.decode(body)
    t0 = time.process_time()
    for _ in range(n):
        parse()
    return (time.process_time() - t0) / n * 1e6


def _measure_in(src: str | None, streams: int) -> dict[str, float]:
    if src is None:
        return measure(streams)
    env = {**os.environ, "PYTHONPATH": str(Path(src) / "src")}
    done = subprocess.run([sys.executable, __file__, "--measure-only", "--streams", str(streams)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-src", help="another checkout: the same measurements on its code, in the same run")
    ap.add_argument("--streams", type=int, default=300, help="streams per measurement")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians are printed)")
    ap.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.streams)))
        return
    arms = [("this checkout", None)] + ([("base", args.base_src)] if args.base_src else [])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in arms}
    for _ in range(args.rounds):
        for name, src in arms:
            runs[name].append(_measure_in(src, args.streams))
    keys = list(runs["this checkout"][0])
    rows = []
    for k in keys:
        api, cut = k.split("|")
        row: list[object] = [api, cut]
        for name, _ in arms:
            vals = [r[k] for r in runs[name] if k in r]
            row.append(f"{statistics.median(vals):.1f}" if vals else "-")
        if args.base_src:
            if all(k in r for r in runs["base"]):
                base = statistics.median(r[k] for r in runs["base"])
                row.append(f"{statistics.median(r[k] for r in runs['this checkout']) / base:.3f}x")
            else:
                row.append("-")
        rows.append(row)
    header = ["api", "network reads", *(f"{name}: CPU µs per stream (per parse)" for name, _ in arms)]
    if args.base_src:
        header.append("this / base")
    print_table(f"the relay's event reader, medians of {args.rounds} interleaved rounds", header, rows)


if __name__ == "__main__":
    main()
