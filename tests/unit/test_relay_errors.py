"""What an ``engine: openai`` fleet's relay tells a client about a server's failure: the server's own
OpenAI-shaped error as it was, else a wrapped one naming the worker and quoting the server's body
for callers who may see the fleet (keys off, admin keys), and neither for a tenant."""

from __future__ import annotations

import json

from thunderagent.frontend.relay import _error_event, upstream_error
from thunderagent.types import FinishReason, TokenOutput


def _out(raw: bytes | None, status: int, reason: FinishReason = FinishReason.ERROR) -> TokenOutput:
    return TokenOutput("r1", [], 0.0, 5, 0, True, reason, raw=raw, raw_status=status)


def _error(resp) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    return resp.status, json.loads(resp.body)["error"]


def test_a_servers_openai_shaped_error_passes_unchanged_to_anyone() -> None:
    raw = json.dumps({"error": {"message": "bad top_p", "type": "invalid_request_error", "param": "top_p",
                                "code": None}}).encode()
    for worker in ("w3", None):
        resp = upstream_error(worker, _out(raw, 400))
        assert resp.status == 400 and resp.body == raw


def test_a_wrapped_error_names_the_worker_and_the_body_for_admins_only() -> None:
    page = b"<html>502 Bad Gateway from gpu-node-17.internal</html>"
    status, err = _error(upstream_error("w3", _out(page, 503)))
    assert status == 502 and err["code"] == "upstream_error"
    assert err["message"] == f"worker w3 failed the request (HTTP 503: {page.decode()})"
    status, err = _error(upstream_error(None, _out(page, 503)))
    assert status == 502 and err["message"] == "the worker failed the request (HTTP 503)"
    status, err = _error(upstream_error(None, _out(b"no such adapter", 404)))
    assert status == 404 and err["message"] == "the worker failed the request (HTTP 404)"


def test_a_broken_stream_names_the_worker_for_admins_only() -> None:
    out = _out(None, 0, FinishReason.ERROR)
    shown, hidden = _error_event("w3", out), _error_event(None, out)
    assert shown.endswith(b"data: [DONE]\n\n") and hidden.endswith(b"data: [DONE]\n\n")
    msg = json.loads(shown.split(b"\n\n")[0][6:])["error"]["message"]
    assert msg.startswith("worker w3 failed while streaming the request")
    msg = json.loads(hidden.split(b"\n\n")[0][6:])["error"]["message"]
    assert msg.startswith("the worker failed while streaming the request") and "w3" not in msg


def test_the_messages_api_gets_anthropic_shaped_failures() -> None:
    anthropic_body = json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                            "message": "bad max_tokens"}}).encode()
    resp = upstream_error("w3", _out(anthropic_body, 400), anthropic=True)
    assert resp.status == 400 and resp.body == anthropic_body  # the server's own, unchanged
    openai_body = json.dumps({"error": {"message": "bad", "type": "invalid_request_error"}}).encode()
    for raw, status, expect_status, kind in ((openai_body, 400, 400, "invalid_request_error"),
                                             (b"<html>down</html>", 503, 502, "api_error")):
        resp = upstream_error(None, _out(raw, status), anthropic=True)  # wrapped in Anthropic's shape
        doc = json.loads(resp.body)
        assert resp.status == expect_status and doc["type"] == "error" and doc["error"]["type"] == kind
        assert doc["error"]["message"] == f"the worker failed the request (HTTP {status})"
    event = _error_event(None, _out(None, 0), anthropic=True)  # a stream that broke: Anthropic's error event
    head, data = event.split(b"\n", 1)
    assert head == b"event: error" and event.endswith(b"\n\n") and b"[DONE]" not in event
    doc = json.loads(data[len(b"data: "):])
    assert doc["type"] == "error" and doc["error"]["type"] == "api_error"
    assert doc["error"]["message"].startswith("the worker failed while streaming the request")
