"""Fault injection into an in-process worker's engine.

The simulated engine is compiled (``thunderagent/native.py``): its methods cannot be replaced on an
instance. A crash is injected by putting a wrapper in front of it instead: the worker calls
``engine.advance`` on whatever its ``engine`` attribute holds at each step."""

from __future__ import annotations

from typing import Any


class CrashingEngine:
    """Raises in ``advance`` (a crashed engine); everything else goes to the wrapped engine."""

    def __init__(self, inner: Any, message: str) -> None:
        self._inner = inner
        self._message = message

    def advance(self, now: float) -> list:
        raise RuntimeError(self._message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def crash_engine(worker: Any, message: str = "simulated engine crash") -> None:
    """``worker``'s engine raises at its next step."""
    worker.engine = CrashingEngine(worker.engine, message)
