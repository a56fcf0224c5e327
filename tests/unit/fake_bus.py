"""An in-memory Bus for tests of the NATS frontend and worker logic (no server, no network)."""

from __future__ import annotations

from thunderagent.bus import wire
from thunderagent.bus.nats import BusError, BusMsg


class FakeBus:
    """Records publishes; answers dump requests from ``dumps`` (worker id -> (instance, hashes, seq))
    and pings from ``alive`` (worker id -> the instance that answers; none: the ping times out)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, str]] = []
        self.subs: dict[str, object] = {}
        self.dumps: dict[str, tuple[str, list[int], int]] = {}
        self.max_payload = 1024 * 1024
        self.alive: dict[str, str] = {}
        self.requests: list[tuple[str, str]] = []  # (subject, reply) of every request_many

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

    async def request_many(self, subject, data, timeout, done, reply):
        self.requests.append((subject, reply))
        wid = subject.split(".")[2]
        if subject.endswith(".ping"):
            answers = [BusMsg(reply, wire.encode(wire.Pong(self.alive[wid])))] if wid in self.alive else []
            if not any(done(m) for m in answers):
                raise TimeoutError
            return answers
        if wid not in self.dumps:
            raise BusError("no responders")
        instance, hashes, seq = self.dumps[wid]
        return [BusMsg(reply, wire.encode(c)) for c in wire.dump_chunks(instance, hashes, seq)]

    def sent(self, kind: str) -> list[tuple[str, bytes, str]]:
        return [p for p in self.published if p[0].endswith("." + kind)]
