"""Error logging that a flood of bad requests cannot turn into a flood of log lines.

Each cause (an exception type and where it was raised, or a protocol error's kind) is logged at most
once per interval; the repeats in between are counted and the next line for that cause reports how
many were suppressed. A traceback is logged with the first occurrence of a cause in an interval only.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

#: distinct causes remembered at most; past it the oldest are forgotten (bounds memory under a
#: flood of distinct causes, at the price of logging a forgotten cause again)
MAX_CAUSES = 1024


@dataclass(slots=True)
class _Cause:
    last_logged: float
    suppressed: int = 0


class ErrorLog:
    def __init__(self, logger: logging.Logger, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._causes: dict[str, _Cause] = {}

    def _admit(self, cause: str) -> int | None:
        """None: suppress this occurrence; else log it, with this many repeats suppressed before it."""
        now = self._clock()
        entry = self._causes.get(cause)
        if entry is not None and now - entry.last_logged < self.interval_s:
            entry.suppressed += 1
            return None
        suppressed = entry.suppressed if entry is not None else 0
        self._causes.pop(cause, None)
        self._causes[cause] = _Cause(now)  # re-inserted: dict order is least recently logged first
        if len(self._causes) > MAX_CAUSES:
            del self._causes[next(iter(self._causes))]
        return suppressed

    def _log(self, level: int, cause: str, msg: str, args: tuple[object, ...], exc: BaseException | None) -> bool:
        suppressed = self._admit(cause)
        if suppressed is None:
            return False
        if suppressed:
            msg += f" [{suppressed} more like it suppressed in the last {self.interval_s:g}s]"
        exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def exception(self, exc: BaseException, msg: str, *args: object) -> bool:
        """Log an unexpected exception (with its traceback) once per cause per interval."""
        return self._log(logging.ERROR, exception_cause(exc), msg, args, exc)

    def warning(self, cause: str, msg: str, *args: object) -> bool:
        """Log a client-caused problem (no traceback) once per cause per interval."""
        return self._log(logging.WARNING, cause, msg, args, None)


ERROR_LOG_KEY = web.AppKey("error_log", ErrorLog)


def exception_cause(exc: BaseException) -> str:
    """An exception's type and the place it was raised: the same bug, whatever the request."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return f"{type(exc).__qualname__}@{where}"
