"""A minimal discrete-event driver of one :class:`SimulatedEngine` for engine tests: arrivals of an
instant are added before the engine is asked for its next wakeup (the engine's driver contract);
every output and pass is recorded."""

from __future__ import annotations

from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.types import EngineRequest, TokenOutput


class Run:
    def __init__(self, eng: SimulatedEngine) -> None:
        self.eng = eng
        self.outs: list[TokenOutput] = []
        self.passes: list = []

    def run(self, arrivals: list[tuple[float, EngineRequest]], until: float | None = None) -> Run:
        arrivals = sorted(arrivals, key=lambda a: a[0])
        eng, i, now = self.eng, 0, arrivals[0][0] if arrivals else 0.0
        while True:
            while i < len(arrivals) and arrivals[i][0] <= now:
                eng.add_request(arrivals[i][1], arrivals[i][0])
                i += 1
            self.outs += eng.advance(now)
            w = eng.next_wakeup()
            if eng.last_pass is not None and (not self.passes or self.passes[-1] is not eng.last_pass):
                self.passes.append(eng.last_pass)
            nxt = [x for x in (w, arrivals[i][0] if i < len(arrivals) else None) if x is not None]
            if not nxt or (until is not None and min(nxt) > until):
                return self
            now = min(nxt)

    def of(self, rid: str) -> list[TokenOutput]:
        return [o for o in self.outs if o.request_id == rid]

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.of(rid) for t in o.token_ids]

    def ttft_ms(self, rid: str, arrival: float = 0.0) -> float:
        return (self.of(rid)[0].time - arrival) * 1e3

    def e2e_ms(self, rid: str, arrival: float = 0.0) -> float:
        return (self.of(rid)[-1].time - arrival) * 1e3

    def pass_ending_after(self, t: float):  # type: ignore[no-untyped-def]
        return next(p for p in self.passes if p.start < t <= p.end)
