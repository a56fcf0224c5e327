"""An in-memory Bus for tests of the NATS frontend and worker logic (no server, no network)."""

from __future__ import annotations

from thunderagent.bus import wire
from thunderagent.bus.nats import BusError, BusMsg


class FakeBus:
    """Records publishes; answers dump requests from ``dumps`` (worker id -> (instance, hashes, seq))."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, str]] = []
        self.subs: dict[str, object] = {}
        self.dumps: dict[str, tuple[str, list[int], int]] = {}

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def subscribe(self, subject, handler) -> None:
        self.subs[subject] = handler

    def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        self.published.append((subject, data, reply))

    async def flush(self, timeout: float = 2.0) -> None:
        pass

    async def request_many(self, subject, data, timeout, done):
        wid = subject.split(".")[2]
        if wid not in self.dumps:
            raise BusError("no responders")
        instance, hashes, seq = self.dumps[wid]
        return [BusMsg(subject, wire.encode(c)) for c in wire.dump_chunks(instance, hashes, seq)]

    def sent(self, kind: str) -> list[tuple[str, bytes, str]]:
        return [p for p in self.published if p[0].endswith("." + kind)]
