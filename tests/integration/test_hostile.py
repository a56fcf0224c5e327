"""Hostile input against a real server (issue 11 item 7): every rejection is a clear 4xx in OpenAI's
shape, no response is a 5xx, nothing hangs past its configured timeout, idle connections are closed,
the connection limit holds, and the server still serves a normal request afterwards."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import time

import pytest

from support.rawhttp import Reply, exchange, read_reply, request

pytestmark = pytest.mark.integration

MODEL = "thunderagent-sim"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
CHAT = "/v1/chat/completions"
LIMITS = {"body_timeout_s": 1.0, "idle_timeout_s": 1.5, "max_body_bytes": 4 * 1024 * 1024}


def port_of(srv) -> int:
    return int(srv.base_url.rsplit(":", 1)[1])


def chat(extra: dict | None = None, **kw) -> bytes:
    return request(CHAT, json.dumps({**GOOD, **(extra or {})}).encode(), **kw)


def assert_openai_error(reply: Reply, status: int, param: str | None = None, text: str | None = None) -> dict:
    assert reply.status == status, (reply.status, reply.body[:300])
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if text is not None:
        assert text in err["message"], err
    assert not any(k.startswith("access-control-") for k in reply.headers), reply.headers  # never CORS
    return err


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


# (name, raw request, status, param, text in the message)
CASES: list[tuple[str, bytes, int, str | None, str | None]] = [
    ("invalid utf-8", request(CHAT, b'{"model":"thunderagent-sim","messages":[{"role":"user","content":"\xff\xfe"}]}'),
     400, None, "UTF-8"),
    ("10,000-deep JSON at the top", request(CHAT, deep(10_000)), 400, None, None),
    ("10,000-deep JSON in extra_body", request(CHAT, json.dumps(GOOD).encode()[:-1] + b', "extra_body": {"a": '
                                               + deep(10_000) + b"}}"), 400, None, "nested too deeply"),
    ("10,000-deep JSON in a content part", request(CHAT, json.dumps({**GOOD, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x", "deep": "@"}]}]}).encode().replace(
        b'"@"', deep(10_000))), 400, None, "nested too deeply"),
    ("huge max_tokens", chat({"max_tokens": 10**30}), 400, "max_tokens", None),
    ("max_tokens past int32", chat({"max_tokens": 2**31}), 400, "max_tokens", None),
    ("negative max_tokens", chat({"max_tokens": -1}), 400, "max_tokens", None),
    ("negative temperature", chat({"temperature": -0.5}), 400, "temperature", None),
    ("NaN temperature", request(CHAT, json.dumps({**GOOD, "temperature": float("nan")}).encode()), 400, None,
     "not valid JSON"),
    ("infinite top_p", request(CHAT, json.dumps(GOOD).encode()[:-1] + b', "top_p": 1e999}'), 400, "top_p", None),
    ("seed past int64", chat({"seed": 2**64}), 400, "seed", None),
    ("priority past int32", chat({"priority": -(2**40)}), 400, "priority", None),
    ("token id 2^32", request("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 2**32]}).encode()),
     400, "prompt", "uint32"),
    ("token id 2^70", request("/v1/completions", json.dumps({"model": MODEL, "prompt": [2**70]}).encode()),
     400, "prompt", None),
    ("gzip that is not gzip", request(CHAT, b"not gzip at all", headers={"Content-Encoding": "gzip"}), 400, None,
     "Content-Encoding"),
    ("brotli (not installed)", request(CHAT, b"x", headers={"Content-Encoding": "br"}), 415, None, "Content-Encoding"),
    ("unknown Content-Encoding", chat(headers={"Content-Encoding": "zstd2"}), 415, None, "Content-Encoding"),
    ("gzip bomb", request(CHAT, gzip.compress(b'{"model": "' + b"0" * (40 * 1024 * 1024) + b'"}'),
                          headers={"Content-Encoding": "gzip"}), 413, None, "too large"),
    ("10 MB string", chat({"messages": [{"role": "user", "content": "x" * 10_000_000}]}), 413, None,
     "max_body_bytes"),
    ("text/plain body (cross-origin simple request)", chat(ctype="text/plain"), 415, None, "application/json"),
    ("form body", request(CHAT, b"model=x&messages=y", ctype="application/x-www-form-urlencoded"), 415, None, None),
    ("multipart body", chat(ctype="multipart/form-data; boundary=x"), 415, None, None),
    ("no Content-Type", chat(ctype=None), 415, None, "none"),
    ("browser Origin", chat(headers={"Origin": "https://evil.example"}), 403, None, "cross-origin"),
    ("CORS preflight", request(CHAT, method="OPTIONS", ctype=None, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}), 405, None, None),
    ("one 100 KB header", chat(headers={"X-Big": "a" * 100_000}), 431, None, "max_header_bytes"),
    ("a 20 KB request line", request("/v1/chat/completions?" + "a" * 20_000, json.dumps(GOOD).encode()), 431, None,
     None),
    ("500 headers", chat(headers={f"X-H{i}": "v" for i in range(500)}), 431, None, "max_headers"),
    ("garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 hello\r\n\r\n", 400, None, None),
    ("path traversal, encoded", request("/v1/programs/..%2F..%2Fetc%2Fpasswd/release"), 400, "program_id", None),
    ("path traversal, NUL", request("/v1/programs/a%00b/release"), 400, "program_id", None),
    ("path traversal, newline", request("/v1/programs/a%0Ab/release"), 400, "program_id", None),
    ("path traversal, dots", request("/v1/programs/../../../etc/passwd"), 404, None, None),
    ("path traversal, body", request("/programs/release", b'{"program_id": "../../etc/passwd"}'), 400, "program_id",
     None),
    ("path traversal, header", chat(headers={"x-thunderagent-program-id": "../x"}), 400, "program_id", None),
    ("logprobs", chat({"logprobs": True}), 400, "logprobs", "not supported"),
    ("top_logprobs", chat({"top_logprobs": 3}), 400, "top_logprobs", None),
    ("tools", chat({"tools": [{"type": "function", "function": {"name": "f"}}]}), 400, "tools", None),
    ("tool_choice", chat({"tool_choice": "required"}), 400, "tool_choice", None),
    ("response_format", chat({"response_format": {"type": "json_object"}}), 400, "response_format", None),
    ("frequency_penalty", chat({"frequency_penalty": 0.5}), 400, "frequency_penalty", None),
    ("presence_penalty", chat({"presence_penalty": -1}), 400, "presence_penalty", None),
    ("logit_bias", chat({"logit_bias": {"50256": -100}}), 400, "logit_bias", None),
    ("n", chat({"n": 2}), 400, "n", None),
    ("message name", chat({"messages": [{"role": "user", "content": "x", "name": "bob"}]}), 400,
     "messages[0].name", None),
    ("an unknown field", chat({"store": True}), 400, "store", "unsupported field"),
    ("unknown stream option", chat({"stream": True, "stream_options": {"continuous_usage_stats": True}}), 400,
     "stream_options.continuous_usage_stats", None),
    ("echo", request("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "echo": True}).encode()), 400,
     "echo", None),
    ("best_of", request("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "best_of": 3}).encode()), 400,
     "best_of", None),
    ("completion logprobs", request("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "logprobs": 0})
                                    .encode()), 400, "logprobs", None),
    ("suffix", request("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "suffix": "y"}).encode()), 400,
     "suffix", None),
]


async def test_hostile_requests_get_clear_4xx_and_the_server_keeps_serving(server_factory):
    async with server_factory(control_plane=LIMITS) as srv:
        port = port_of(srv)
        for name, raw, status, param, text in CASES:
            reply = await exchange(port, raw, timeout=10)
            assert reply.status is not None, f"{name}: no answer"
            assert_openai_error(reply, status, param, text)
            assert reply.elapsed < 5, (name, reply.elapsed)
        # neutral values of what is not implemented, and `user` (a route key), are accepted
        ok = await exchange(port, chat({"user": "u1", "logprobs": False, "frequency_penalty": 0, "tools": [],
                                        "tool_choice": "none", "response_format": {"type": "text"}}))
        assert ok.status == 200, ok.body
        # thousands of messages are served (they fit the body limit and the KV cache)
        many = await exchange(port, chat({"messages": [{"role": "user", "content": f"m{i}"} for i in range(3000)]}))
        assert many.status == 200, many.body[:300]
        await assert_still_serving(port)


async def assert_still_serving(port: int) -> None:
    reply = await exchange(port, chat())
    assert reply.status == 200, reply.body[:300]
    assert reply.json()["choices"][0]["message"]["content"]


async def test_answers_name_no_versions(server_factory):
    """aiohttp's default ``Server`` header names Python's and aiohttp's versions; ours names the product."""
    async with server_factory() as srv:
        port = port_of(srv)
        for raw in (chat(), chat({"stream": True}), request("/nowhere", method="GET", ctype=None),
                    chat({"max_tokens": -1}), b"GARBAGE / HTTP/1.1\r\n\r\n"):
            reply = await exchange(port, raw)
            assert reply.status is not None, raw
            assert reply.headers.get("server") == "ThunderAgent", (raw, reply.status, reply.headers)


async def test_request_ids_are_random(server_factory):
    async with server_factory() as srv:
        ids = [(await exchange(port_of(srv), chat())).json()["id"].removeprefix("chatcmpl-") for _ in range(3)]
        assert all(len(i) == 24 and int(i, 16) >= 0 for i in ids), ids
        assert len({i[:8] for i in ids}) == 3, ids  # a counter would share its leading digits


async def test_a_content_length_larger_than_the_body_gets_408_within_the_body_timeout(server_factory):
    async with server_factory(control_plane=LIMITS) as srv:
        body = json.dumps(GOOD).encode()
        reply = await exchange(port_of(srv), request(CHAT, body, length=len(body) + 100), timeout=10)
        err = assert_openai_error(reply, 408, text="body_timeout_s")
        assert err["code"] == "request_timeout" and 0.9 < reply.elapsed < 3, reply.elapsed
        assert reply.headers.get("connection", "").lower() == "close"
        await assert_still_serving(port_of(srv))


async def test_slow_loris_body_and_headers_are_cut_off(server_factory):
    async with server_factory(control_plane=LIMITS) as srv:
        port = port_of(srv)
        body = json.dumps(GOOD).encode()
        raw = request(CHAT, body)
        head, rest = raw[: -len(body)], raw[-len(body):]
        # the body one byte every 0.1 s (would take ~5 s): 408 after body_timeout_s (1 s)
        slow_body = await exchange(port, [head, *[rest[i:i + 1] for i in range(len(rest))]], pause=0.1, timeout=10)
        assert_openai_error(slow_body, 408)
        assert slow_body.elapsed < 3, slow_body.elapsed
        # headers one line every 0.3 s, forever: the connection is closed after idle_timeout_s (1.5 s)
        lines = [b"POST /v1/chat/completions HTTP/1.1\r\n", *[b"X-Slow-%d: v\r\n" % i for i in range(30)]]
        slow_head = await exchange(port, lines, pause=0.3, timeout=10)
        assert slow_head.status is None and slow_head.elapsed < 4, slow_head
        await assert_still_serving(port)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_idle_connections_are_closed_and_the_connection_limit_holds(server_factory):
    n_limit, n_extra = 1000, 200
    cfg = {**LIMITS, "idle_timeout_s": 2.0, "max_connections": n_limit}
    async with server_factory(control_plane=cfg) as srv:
        port = port_of(srv)
        before = open_fds()
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n_limit + n_extra)]
        t_opened = time.monotonic()
        assert srv.guard is not None and srv.guard.open_connections == n_limit
        assert open_fds() >= before + 2 * n_limit  # both ends live in this process
        # past the limit: told so (503, OpenAI's shape) and closed at once
        refused = await asyncio.gather(*(read_reply(r, 5) for r, _ in conns[n_limit:]))
        for reply in refused:
            assert_openai_error(reply, 503, text="max_connections")
            assert reply.headers["retry-after"] == "1"
        # a normal request cannot get in while the idle ones hold every slot...
        assert (await exchange(port, chat(), timeout=5)).status == 503
        # ...until the idle timeout closes them: every idle client sees the server hang up
        closed = await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in conns[:n_limit]))
        assert closed == [b""] * n_limit
        assert time.monotonic() - t_opened < 6
        for _, w in conns:
            w.close()
        await asyncio.sleep(0.2)
        assert srv.guard.open_connections == 0
        assert open_fds() <= before + 10, (before, open_fds())
        await assert_still_serving(port)


async def test_a_flood_of_errors_logs_once_per_cause(server_factory, caplog):
    cfg = {**LIMITS, "error_log_interval_s": 60.0}
    async with server_factory(control_plane=cfg) as srv:
        port = port_of(srv)

        async def broken(*args, **kwargs):
            raise RuntimeError("an internal bug")

        srv.fleet.start_generation = broken  # type: ignore[method-assign]
        caplog.set_level(logging.INFO)
        caplog.clear()
        for _ in range(200):
            assert_openai_error(await exchange(port, chat()), 500)  # the bug: a 500, but one log line
            assert_openai_error(await exchange(port, b"BAD REQUEST LINE\r\n\r\n"), 400)
            assert_openai_error(await exchange(port, chat(headers={"X-Big": "a" * 20_000})), 431)
        records = [r for r in caplog.records if r.name.startswith(("thunderagent", "aiohttp"))]
        tracebacks = [r for r in records if r.exc_info]
        assert len(tracebacks) == 1 and "an internal bug" in caplog.text
        assert len(records) <= 4, [r.getMessage() for r in records]
        assert len(caplog.text) < 10_000  # was a traceback per request
