"""The simulated workers' KV byte transport on loopback (``execution/kv_bytes.py``): a pull moves and
verifies every block; each injected fault is its own failure cause; probes measure a link."""

from __future__ import annotations

import pytest

from thunderagent.config.transfer import SimKvFaults
from thunderagent.execution.kv_bytes import KvByteService, checksum, payload, probe_link, probe_pair, pull

pytestmark = pytest.mark.integration

HASHES = (0x1111, 0x2222, 0x3333, 0x4444)
BLOCK = 64 << 10


async def served(faults: SimKvFaults | None = None) -> KvByteService:
    s = KvByteService("127.0.0.1", faults or SimKvFaults())
    s.open("w0")
    return s


def test_payload_is_deterministic_and_distinct_per_block():
    assert payload(7, 20) == payload(7, 20) and len(payload(7, 20)) == 20
    assert payload(7, 8) == (7).to_bytes(8, "big") and payload(7, 64) != payload(8, 64)
    assert checksum(payload(7, 64)) != checksum(payload(8, 64))


async def test_a_pull_moves_and_verifies_every_block_once():
    s = await served()
    try:
        s.offer("r1", HASHES, BLOCK, now=0.0)
        res = await pull(*s.address, "r1", HASHES, timeout=10)
        assert (res.cause, res.nbytes, res.blocks) == ("ok", 4 * BLOCK, 4) and res.seconds > 0
        assert (s.stats.pulls_served, s.stats.bytes_sent) == (1, 4 * BLOCK)
        again = await pull(*s.address, "r1", HASHES, timeout=10)  # an offer is pulled once
        assert (again.cause, again.nbytes) == ("kv_missing", 0)
        wrong = (*HASHES[:3], 0x9999)  # the transfer names other blocks than the ones served
        s.offer("r2", HASHES, BLOCK, now=0.0)
        assert (await pull(*s.address, "r2", wrong, timeout=10)).cause == "kv_checksum"
    finally:
        await s.close()


@pytest.mark.parametrize(("faults", "cause", "injected"), [
    (SimKvFaults(corrupt_p=1.0), "kv_checksum", "corrupt"),
    (SimKvFaults(interrupt_p=1.0), "kv_interrupted", "interrupt"),
    (SimKvFaults(slow_link_bps=256 << 10), "kv_timeout", None),  # 256 KiB in 1 s: 4 blocks take 1 s
])
async def test_each_injected_fault_is_its_own_cause(faults, cause, injected):
    s = await served(faults)
    try:
        s.offer("r1", HASHES, BLOCK, now=0.0)
        res = await pull(*s.address, "r1", HASHES, timeout=0.5)
        assert (res.cause, res.nbytes, res.blocks) == (cause, 0, 0)
        if injected is not None:
            assert s.stats.injected == {injected: 1}
        assert s.stats.pulls_ok == 0  # the sender of corrupted bytes cannot tell: the receiver's checksum does
    finally:
        await s.close()


async def test_an_unreachable_source_is_a_cause_not_an_exception():
    s = await served()
    host, port = s.address
    await s.close()
    assert (await pull(host, port, "r1", HASHES, timeout=2)).cause == "kv_unreachable"


async def test_probes_measure_rtt_and_bandwidth_between_two_services():
    a, b = await served(), await served()
    try:
        direct = await probe_link(*a.address, 1 << 20, rounds=3)
        assert 0 < direct["rtt_s"] < direct["seconds"] and direct["bandwidth_bps"] > 1e6
        res = await probe_pair(b.address, a.address, 1 << 20, rounds=2)  # b measures its link from a
        assert res["nbytes"] == 1 << 20 and res["bandwidth_bps"] > 1e6
        with pytest.raises(RuntimeError, match="probe from"):
            await probe_pair(b.address, ("127.0.0.1", 1), 1 << 20, rounds=1)
    finally:
        await a.close()
        await b.close()


async def test_garbage_from_a_peer_ends_its_connection_not_the_server():
    import asyncio

    s = await served()
    try:
        r, w = await asyncio.open_connection(*s.address)
        w.write(b"\x00\x00\x00\x04junk")
        await w.drain()
        assert await r.read() == b""  # closed on us
        w.close()
        s.offer("r1", HASHES, BLOCK, now=0.0)
        assert (await pull(*s.address, "r1", HASHES, timeout=10)).cause == "ok"
    finally:
        await s.close()
