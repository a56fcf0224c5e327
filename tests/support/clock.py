"""A clock the test moves by hand (inject it into a Fleet: ``clock=ManualClock()``)."""

from __future__ import annotations


class ManualClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
