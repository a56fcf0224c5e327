"""``frontend/trace_context.py``: which client headers go on to the engine server, and which are dropped."""

from __future__ import annotations

from multidict import CIMultiDict

from thunderagent.frontend.trace_context import trace_headers

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_trace_context_and_request_id_go_on() -> None:
    h = CIMultiDict({"TraceParent": PARENT, "tracestate": "vendor=opaque,other=1", "X-Request-Id": "req-42",
                     "Authorization": "Bearer sk-client", "cookie": "a=b", "baggage": "k=v"})
    assert trace_headers(h) == (("traceparent", PARENT), ("tracestate", "vendor=opaque,other=1"),
                                ("x-request-id", "req-42"))
    assert trace_headers(CIMultiDict({"content-type": "application/json"})) == ()
    # a future version may add fields after the flags; version 00 may not
    assert trace_headers(CIMultiDict({"traceparent": "01" + PARENT[2:] + "-extra"})) == (
        ("traceparent", "01" + PARENT[2:] + "-extra"),)


def test_a_malformed_parent_is_dropped_with_its_state() -> None:
    for bad in ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
                "00-" + "0" * 32 + "-b7ad6b7169203331-01",  # zero trace id
                "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",  # zero parent id
                "ff" + PARENT[2:],  # the forbidden version
                PARENT + "-extra",  # version 00 with more fields
                PARENT.upper()):  # ids are lower-case hex
        assert trace_headers(CIMultiDict({"traceparent": bad, "tracestate": "v=1"})) == (), bad
    # the request id goes on by itself; one too long or not printable does not
    assert trace_headers(CIMultiDict({"tracestate": "v=1", "x-request-id": "r"})) == (("x-request-id", "r"),)
    assert trace_headers(CIMultiDict({"x-request-id": "r" * 513})) == ()
    assert trace_headers(CIMultiDict({"x-request-id": "caf\u00e9"})) == ()
    assert trace_headers(CIMultiDict({"traceparent": PARENT, "tracestate": "s" * 513})) == (("traceparent", PARENT),)
