"""The router's refusal. Its own module: an exception class cannot be compiled by mypyc (setup.py), and
the modules that raise it are."""

from __future__ import annotations


class NoWorkerAvailable(RuntimeError):
    """No worker can take the request now (none healthy, or all busy with fallback=reject)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
