"""Real KV bytes for simulated workers: a small TCP service per worker process.

The simulated engine hands a transfer over as block hashes (``engine/kv_handoff.py``); this module
makes the transfer move bytes, so a slow link, a cut connection, corrupted bytes and a full target
are real failure paths:

* the **prefill side** :meth:`KvByteService.offer`s a finished job's blocks under its request id;
  each block's payload is ``block_bytes`` deterministic bytes derived from its hash (nothing is
  stored: a payload is rebuilt when it is sent);
* the **decode side** :func:`pull`s them before its engine admits the request: per block a header
  (hash, xxh3-64 checksum of the payload) then the payload; every block's hash must be the one the
  transfer names and its checksum must match the bytes received. Any failure is a cause
  (``kv_timeout``, ``kv_interrupted``, ``kv_checksum``, ``kv_unreachable``, ``kv_missing``,
  ``target_full``: ``thunderagent_pd_fallbacks_total{cause}``), and the request prefills on its
  decode worker instead.

Why TCP on 127.0.0.1 (``kv_cache_transfer.sim_host``) rather than NATS request/reply: it is the one
transport that works the same in ``serve`` (one process, no bus) and between NATS worker processes,
it streams megabytes without NATS's 1 MiB message cap, and a cut or a slow link is a real socket's.

Wire (all integers big-endian): a request is a 4-byte length and a msgpack map ``{"op": ...}``; the
answer starts with a 4-byte length and a msgpack map (``{"ok": bool, ...}``), then raw data:
``pull`` (``transfer``): ``blocks`` x (8-byte hash, 8-byte checksum, ``block_bytes`` payload);
``probe`` (``nbytes``): one such block of hash 0; ``probe_from`` (``host``, ``port``, ``nbytes``,
``rounds``): this service measures its link *from* that service (``thunderagent probe-links``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import xxhash

from thunderagent.config.transfer import SimKvFaults
from thunderagent.types import KvPull

log = logging.getLogger(__name__)

#: an offer nobody pulled is dropped after this long (its request went away or fell back)
OFFER_TTL_S = 120.0
#: slow-link sending granularity: small enough that the rate holds within a block
_CHUNK = 64 << 10
_LEN = struct.Struct(">I")
_BLOCK_HEAD = struct.Struct(">QQ")
_MAX_HEADER = 1 << 20
#: the reader's buffer limit (asyncio's default, 64 KiB, pauses and resumes the socket every 128 KiB:
#: half the throughput on loopback) and the pieces a block is read and hashed in
_READ_LIMIT = 4 << 20
_PIECE = 1 << 20


def payload(block_hash: int, nbytes: int) -> bytes:
    """A block's payload: its hash's 8 bytes repeated (cheap to rebuild, distinct per block)."""
    tile = block_hash.to_bytes(8, "big") * 8192  # repeating a 64 KiB tile beats repeating 8 bytes
    reps, rest = divmod(nbytes, len(tile))
    return tile * reps + tile[:rest]


def checksum(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(slots=True)
class KvByteStats:
    """Counters of one process's service (both sides)."""

    pulls_served: int = 0  # offers sent whole
    bytes_sent: int = 0
    pulls_ok: int = 0
    bytes_received: int = 0  # verified payload bytes
    checksums_verified: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # decode side, by cause
    injected: dict[str, int] = field(default_factory=dict)  # prefill side faults, by kind


@dataclass(slots=True)
class _Offer:
    hashes: tuple[int, ...]
    block_bytes: int
    expires: float


class PullError(Exception):
    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


async def _send_msg(w: asyncio.StreamWriter, obj: object) -> None:
    data = msgspec.msgpack.encode(obj)
    w.write(_LEN.pack(len(data)) + data)
    await w.drain()


async def _read_msg(r: asyncio.StreamReader) -> dict[str, object]:
    (n,) = _LEN.unpack(await r.readexactly(_LEN.size))
    if n > _MAX_HEADER:
        raise PullError("kv_interrupted", f"header of {n} bytes")
    msg = msgspec.msgpack.decode(await r.readexactly(n))
    if not isinstance(msg, dict):
        raise PullError("kv_interrupted", "malformed header")
    return msg


class KvByteService:
    """One process's KV byte server (every simulated worker of the process shares it; offers are
    keyed by request id) with its fault injection and counters."""

    def __init__(self, host: str, faults: SimKvFaults) -> None:
        self.host = host
        self.faults = faults
        self._rng = random.Random(faults.seed)
        self.stats = KvByteStats()
        self._offers: dict[str, _Offer] = {}
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._starting: asyncio.Task[None] | None = None
        self._users = 0
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self, name: str) -> None:
        """Bind now (the address is known at once; a client connecting before the accept loop runs
        waits in the listen backlog) and start serving. Counted: one per worker using it; the first
        one's ``name`` seeds the fault draws (worker processes of one config draw differently)."""
        self._users += 1
        if self._sock is not None:
            return
        # string seeds hash deterministically (random.seed hashes str with sha512, not PYTHONHASHSEED)
        self._rng.seed(f"{self.faults.seed}:{name}")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._starting = asyncio.get_running_loop().create_task(self._serve(sock), name="kv-bytes-server")
        log.info("KV bytes served on %s:%d", self.host, self.port)

    async def _serve(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_server(self._handle, sock=sock)

    async def close(self) -> None:
        self._users -= 1
        if self._users > 0 or self._sock is None:
            return
        if self._starting is not None:
            await self._starting
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._sock = None
        self._offers.clear()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # -- prefill side ------------------------------------------------------------------------
    def offer(self, transfer: str, hashes: Sequence[int], block_bytes: int, now: float) -> None:
        """Hold ``transfer``'s blocks for a decode worker to pull (once)."""
        for tid in [t for t, o in self._offers.items() if o.expires < now]:
            del self._offers[tid]
        self._offers[transfer] = _Offer(tuple(hashes), block_bytes, now + OFFER_TTL_S)

    def _inject(self, kind: str, p: float) -> bool:
        hit = p > 0 and self._rng.random() < p
        if hit:
            self.stats.injected[kind] = self.stats.injected.get(kind, 0) + 1
        return hit

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            msg = await _read_msg(r)
            op = msg.get("op")
            if op == "pull":
                await self._serve_pull(str(msg.get("transfer")), w)
            elif op == "probe":
                n = int(msg.get("nbytes", 0))  # type: ignore[call-overload]
                await _send_msg(w, {"ok": True, "blocks": 1, "block_bytes": n})
                data = payload(0, n)
                w.write(_BLOCK_HEAD.pack(0, checksum(data)))
                await self._write(w, data, None)
            elif op == "probe_from":
                try:
                    res = await probe_link(str(msg["host"]), int(msg["port"]), int(msg["nbytes"]),  # type: ignore[call-overload]
                                           int(msg.get("rounds", 3)))  # type: ignore[call-overload]
                except (OSError, ValueError, KeyError, PullError, asyncio.IncompleteReadError) as exc:
                    await _send_msg(w, {"ok": False, "error": repr(exc)})  # the prober reports it
                else:
                    await _send_msg(w, {"ok": True, **res})
            else:
                await _send_msg(w, {"ok": False, "error": f"unknown op {op!r}"})
        except (ConnectionError, asyncio.IncompleteReadError, PullError, OSError, msgspec.DecodeError, ValueError,
                KeyError, TypeError) as exc:  # a peer's garbage or a cut ends its connection, not the server
            log.debug("KV byte connection ended: %r", exc)
        finally:
            w.close()

    async def _serve_pull(self, transfer: str, w: asyncio.StreamWriter) -> None:
        offer = self._offers.pop(transfer, None)  # one pull per offer: a failed one falls back
        if offer is None:
            await _send_msg(w, {"ok": False, "error": f"no transfer {transfer!r} here"})
            return
        f = self.faults
        cut = self._inject("interrupt", f.interrupt_p)
        bad = self._inject("corrupt", f.corrupt_p)
        n = len(offer.hashes)
        await _send_msg(w, {"ok": True, "blocks": n, "block_bytes": offer.block_bytes})
        sent = 0
        for k, h in enumerate(offer.hashes):
            data = payload(h, offer.block_bytes)
            w.write(_BLOCK_HEAD.pack(h, checksum(data)))
            if bad and k == n // 2 and data:  # the checksum was taken: the receiver must notice
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            if cut and k == n // 2:  # half a block, then the connection drops
                await self._write(w, data[: len(data) // 2], f.slow_link_bps)
                w.transport.abort()
                log.info("KV bytes of %s: connection cut after %d of %d blocks (injected)", transfer, k, n)
                return
            await self._write(w, data, f.slow_link_bps)
            sent += len(data)
        self.stats.pulls_served += 1
        self.stats.bytes_sent += sent
        log.info("KV bytes of %s served: %d blocks, %d bytes", transfer, n, sent)

    @staticmethod
    async def _write(w: asyncio.StreamWriter, data: bytes, rate_bps: float | None) -> None:
        view = memoryview(data)
        if rate_bps is None:
            # in pieces: Python 3.11's transport keeps unsent bytes in one bytearray and deletes what
            # each send took from its front, quadratic in a multi-megabyte write
            for k in range(0, len(view), _PIECE):
                w.write(view[k:k + _PIECE])
                await w.drain()
            return
        for k in range(0, len(view), _CHUNK):  # a slow link: paced chunks
            chunk = view[k:k + _CHUNK]
            w.write(chunk)
            await w.drain()
            await asyncio.sleep(len(chunk) / rate_bps)

    # -- decode side -------------------------------------------------------------------------
    def draw_target_full(self) -> bool:
        return self._inject("target_full", self.faults.target_full_p)

    def count(self, pull: KvPull) -> None:
        st = self.stats
        if pull.cause == "ok":
            st.pulls_ok += 1
            st.bytes_received += pull.nbytes
            st.checksums_verified += pull.blocks
        else:
            st.failures[pull.cause] = st.failures.get(pull.cause, 0) + 1


async def _read_blocks(r: asyncio.StreamReader, expect: Sequence[int] | None, progress: Callable[[], None] | None,
                       ) -> tuple[int, int]:
    """Read an answer's blocks, verifying each; (payload bytes, blocks)."""
    head = await _read_msg(r)
    if not head.get("ok"):
        raise PullError("kv_missing", str(head.get("error")))
    blocks, size = int(head["blocks"]), int(head["block_bytes"])  # type: ignore[call-overload]
    if expect is not None and blocks != len(expect):
        raise PullError("kv_missing", f"{blocks} blocks offered, {len(expect)} expected")
    total = 0
    for k in range(blocks):
        h, want = _BLOCK_HEAD.unpack(await r.readexactly(_BLOCK_HEAD.size))
        if expect is not None and h != expect[k]:
            raise PullError("kv_checksum", f"block {k} is {h:#x}, expected {expect[k]:#x}")
        # read and hash in pieces: a multi-megabyte readexactly would grow and copy the stream's buffer
        hasher = xxhash.xxh3_64()
        left = size
        while left:
            piece = await r.readexactly(min(left, _PIECE))
            hasher.update(piece)
            left -= len(piece)
        if hasher.intdigest() != want:
            raise PullError("kv_checksum", f"block {k} ({h:#x}) fails its checksum")
        total += size
        if progress is not None:
            progress()
    return total, blocks


async def pull(host: str, port: int, transfer: str, hashes: Sequence[int], timeout: float,
               progress: Callable[[], None] | None = None) -> KvPull:
    """Pull ``transfer``'s blocks (``hashes``, in order) from the service at ``host:port``, verifying
    each; the result says how it went (``cause`` "ok" or a failure cause), timed from connect to the
    last block verified."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    got = [0, 0]
    w: asyncio.StreamWriter | None = None

    async def run() -> None:
        nonlocal w
        try:
            r, w = await asyncio.open_connection(host, port, limit=_READ_LIMIT)
        except OSError as exc:
            raise PullError("kv_unreachable", str(exc)) from exc
        await _send_msg(w, {"op": "pull", "transfer": transfer})
        got[0], got[1] = await _read_blocks(r, hashes, progress)

    try:
        async with asyncio.timeout(timeout):
            await run()
        cause = "ok"
    except TimeoutError:
        cause = "kv_timeout"
    except PullError as exc:
        cause = exc.cause
        log.warning("KV pull of %s from %s:%d failed: %s", transfer, host, port, exc)
    except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
        cause = "kv_interrupted"
        log.warning("KV pull of %s from %s:%d cut: %r", transfer, host, port, exc)
    finally:
        if w is not None:
            w.close()
    return KvPull(cause, got[0] if cause == "ok" else 0, got[1] if cause == "ok" else 0, loop.time() - t0)


async def _probe_once(host: str, port: int, nbytes: int) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r, w = await asyncio.open_connection(host, port, limit=_READ_LIMIT)
    try:
        await _send_msg(w, {"op": "probe", "nbytes": nbytes})
        await _read_blocks(r, None, None)
    finally:
        w.close()
    return loop.time() - t0


async def probe_link(host: str, port: int, nbytes: int, rounds: int = 3) -> dict[str, float]:
    """Measure the link from the service at ``host:port`` to this process: the round trip of an
    empty block (``rtt_s``) and the time of an ``nbytes`` block (``seconds``), each the fastest of
    ``rounds`` probes; ``bandwidth_bps`` is ``nbytes`` over their difference. The fastest, not the
    median: a busy host only adds time to a probe (a CI run on 2 loaded cores had a median of two
    empty round trips, 2.0 ms, above the 1 MiB block's, 1.9 ms, which makes the bandwidth absurd)."""
    if nbytes <= 0 or rounds <= 0:
        raise ValueError(f"probe needs nbytes > 0 and rounds > 0, got {nbytes}, {rounds}")
    rtt = min([await _probe_once(host, port, 0) for _ in range(rounds)])
    secs = min([await _probe_once(host, port, nbytes) for _ in range(rounds)])
    moving = max(secs - rtt, 1e-9)
    return {"rtt_s": rtt, "seconds": secs, "nbytes": float(nbytes), "bandwidth_bps": nbytes / moving}


async def probe_pair(dst: tuple[str, int], src: tuple[str, int], nbytes: int, rounds: int,
                     timeout: float = 60.0) -> dict[str, float]:
    """Ask the service at ``dst`` to measure its link from ``src`` (it pulls the probe blocks)."""
    async with asyncio.timeout(timeout):
        r, w = await asyncio.open_connection(*dst)
        try:
            await _send_msg(w, {"op": "probe_from", "host": src[0], "port": src[1], "nbytes": nbytes,
                                "rounds": rounds})
            res = await _read_msg(r)
        finally:
            w.close()
    if not res.get("ok"):
        raise RuntimeError(f"probe from {src} at {dst} failed: {res.get('error')}")
    return {k: float(v) for k, v in res.items() if k != "ok"}  # type: ignore[arg-type]
