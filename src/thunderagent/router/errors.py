"""The router's refusal. Its own module: an exception class cannot be compiled by mypyc (setup.py), and
the modules that raise it are."""

from __future__ import annotations


class NoWorkerAvailable(RuntimeError):
    """No worker can take the request now (none healthy, or all busy with fallback=reject).

    ``lasting``: no wait makes room, the request itself does not fit (strict disaggregation: its KV is more
    than the decode worker may take even empty). A request held in the scheduler is then refused at once
    instead of waiting first in line."""

    def __init__(self, message: str, retry_after: float = 1.0, *, lasting: bool = False) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.lasting = lasting


class HeldRefused(NoWorkerAvailable):
    """A request held in the scheduler is refused: routing it failed for good (``lasting``) or after it waited
    ``scheduler.max_wait_s``. It left the queue; the driver ends it with this error (a live 503)."""

    def __init__(self, request_id: str, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after)
        self.request_id = request_id
