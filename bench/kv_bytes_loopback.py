"""Simulated workers' KV byte transport (``execution/kv_bytes.py``) between two processes on loopback.

A child process runs a :class:`KvByteService` with one offer per block size, and, as the baseline
measured in the same run, a bare asyncio server that writes the same number of bytes (no framing, no
payload to build, no checksum). This process pulls each way (``pull``: every block's hash and xxh3
checksum verified) and reads the baseline the same way (1 MiB pieces), interleaved; medians over
``--rounds``.
"ratio" = the pull's median time / the baseline's (1.0: the transport costs nothing over a socket).

Run: ``cd bench && python kv_bytes_loopback.py [--sizes-mib 1 8 64] [--blocks 4] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table  # noqa: E402

from thunderagent.execution.kv_bytes import pull  # noqa: E402

CHILD = """
import asyncio, sys
from thunderagent.config.transfer import SimKvFaults
from thunderagent.execution.kv_bytes import KvByteService

async def main():
    sizes, blocks, rounds = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3])
    svc = KvByteService("127.0.0.1", SimKvFaults())
    svc.open("bench")
    for size in sizes:
        for k in range(rounds):
            svc.offer(f"{size}-{k}", list(range(1, blocks + 1)), size, 0.0)

    ready = {}  # the baseline's bytes are built once, outside its timing

    async def raw(r, w):
        n = int((await r.readline()).decode())
        data = ready.get(n) or ready.setdefault(n, memoryview(b"x" * n))
        for k in range(0, n, 1 << 20):
            w.write(data[k:k + (1 << 20)])
            await w.drain()
        w.close()

    srv = await asyncio.start_server(raw, "127.0.0.1", 0)
    print(svc.port, srv.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def read_raw(port: int, n: int) -> float:
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=4 << 20)
    w.write(f"{n}\n".encode())
    left = n
    while left:
        left -= len(await r.readexactly(min(left, 1 << 20)))
    w.close()
    return time.perf_counter() - t0


async def run(kv_port: int, raw_port: int, sizes: list[int], blocks: int, rounds: int) -> list[list[object]]:
    rows: list[list[object]] = []
    hashes = list(range(1, blocks + 1))
    for size in sizes:
        total = size * blocks
        await read_raw(raw_port, total)  # builds the baseline's bytes
        raw, times = [], []
        for k in range(rounds):  # interleaved: a load change on the machine hits both alike
            raw.append(await read_raw(raw_port, total))
            res = await pull("127.0.0.1", kv_port, f"{size}-{k}", hashes, timeout=120)
            assert res.cause == "ok" and res.nbytes == total and res.blocks == blocks, res
            times.append(res.seconds)
        base, ours = statistics.median(raw), statistics.median(times)
        rows.append([f"{blocks} x {size >> 20} MiB", total / base / 1e6, total / ours / 1e6,
                     total * 8 / ours / 1e9, ours * 1e3, ours / base])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    sizes = [s << 20 for s in a.sizes_mib]
    child = subprocess.Popen([sys.executable, "-c", CHILD, ",".join(map(str, sizes)), str(a.blocks), str(a.rounds)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        kv_port, raw_port = (int(x) for x in child.stdout.readline().split())
        rows = asyncio.run(run(kv_port, raw_port, sizes, a.blocks, a.rounds))
    finally:
        child.kill()
        child.wait()
    print_table(f"KV byte pulls between two processes on loopback (medians of {a.rounds})",
                ["transfer", "raw socket MB/s", "pull MB/s", "pull Gbit/s", "pull ms", "ratio"], rows)


if __name__ == "__main__":
    main()
