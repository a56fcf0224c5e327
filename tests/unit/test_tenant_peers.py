"""Tenant limits shared by the frontends of one bus (control/tenant_peers.py), over an in-memory bus:
what one frontend reports, the other takes from its own buckets; its own reports come back ignored;
nothing is published when nothing changed; an undecodable report is ignored."""

from __future__ import annotations

import asyncio

import msgspec

from fake_bus import FakeBus
from thunderagent.bus import wire
from thunderagent.bus.nats import BusMsg
from thunderagent.config import TenantLimit
from thunderagent.control.tenant_peers import TenantPeers
from thunderagent.scheduler.tenant_limits import TenantLimiter

LIMITS = {"acme": TenantLimit(requests_per_s=0.5, burst=2, tokens_per_min=600, max_in_flight=2)}
SUBJECT = "ta.tenants.usage"


async def test_one_frontends_report_is_taken_by_the_other() -> None:
    now = [0.0]
    bus_a, bus_b = FakeBus(), FakeBus()
    a, b = TenantLimiter(LIMITS), TenantLimiter(LIMITS)
    pa, pb = TenantPeers(bus_a, wire.Subjects("ta"), "fa", 3600), TenantPeers(bus_b, wire.Subjects("ta"), "fb", 3600)
    await pa.start(a, lambda: now[0])
    await pb.start(b, lambda: now[0])
    assert set(bus_b.subs) == {SUBJECT}
    pa.report()
    assert bus_a.published == []  # nothing used yet: nothing sent
    assert a.admit("acme", 0.0) is None and a.take_tokens("acme", 250, 0.0) is None
    pa.report()
    (subject, data, _), = bus_a.published
    assert subject == SUBJECT
    assert wire.decode_tenant_usage(data) == wire.TenantUsage("fa", [wire.TenantUse("acme", 1, 250, 1)])
    await bus_b.subs[SUBJECT](BusMsg(SUBJECT, data))
    await bus_a.subs[SUBJECT](BusMsg(SUBJECT, data))  # its own report comes back: ignored
    assert b.tokens_left("acme", 0.0) == 350 and a.tokens_left("acme", 0.0) == 350
    assert b.admit("acme", 0.0) is None  # the last request token (a took the first) and a's 1 + 1 in flight
    assert b.admit("acme", 0.0).limit == "max_in_flight"  # type: ignore[union-attr]
    await bus_b.subs[SUBJECT](BusMsg(SUBJECT, b"\x01garbage"))
    assert (pa.reports_sent, pb.reports_taken, pa.reports_taken) == (1, 1, 0)
    a.done("acme")
    await pa.stop()  # the last change still goes out: a has nothing in flight now
    assert wire.decode_tenant_usage(bus_a.published[-1][1]).uses == [wire.TenantUse("acme", 0, 0, 0)]
    await pb.stop()


async def test_reports_go_out_every_interval() -> None:
    bus = FakeBus()
    lim = TenantLimiter(LIMITS)
    peers = TenantPeers(bus, wire.Subjects("ta"), "fa", 0.01)
    await peers.start(lim, lambda: 0.0)
    assert lim.admit("acme", 0.0) is None
    for _ in range(200):
        if bus.published:
            break
        await asyncio.sleep(0.01)
    assert [wire.decode_tenant_usage(d).uses for _, d, _ in bus.published[:1]] == [[wire.TenantUse("acme", 1, 0, 1)]]
    await peers.stop()


def test_a_report_carries_busy_programs_and_an_older_frontends_report_still_decodes() -> None:
    use = wire.TenantUse("acme", 0, 0, 1, 2)
    assert wire.decode_tenant_usage(wire.encode(wire.TenantUsage("fa", [use]))).uses == [use]
    older = msgspec.msgpack.encode(["fa", [["acme", 1, 250, 1]]])  # before max_programs was shared
    assert wire.decode_tenant_usage(older).uses == [wire.TenantUse("acme", 1, 250, 1, 0)]
