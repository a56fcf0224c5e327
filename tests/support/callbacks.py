"""Worker callbacks that record what a handle reports (events, heartbeats, loads, refusals)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from thunderagent.execution.handle import WorkerCallbacks
from thunderagent.types import KvEvent, LoadReport


@dataclass
class Recorder:
    clock: Callable[[], float] = time.monotonic
    events: list[KvEvent] = field(default_factory=list)
    heartbeats: list[LoadReport] = field(default_factory=list)
    loads: list[LoadReport] = field(default_factory=list)  # pushed reports, heartbeats included
    unavailable: list[str] = field(default_factory=list)
    limits: list[tuple[int, int]] = field(default_factory=list)  # (max_seq, max_prompt) as stated
    adapters: list[tuple[str, ...]] = field(default_factory=list)  # the served names, each time they changed

    def callbacks(self) -> WorkerCallbacks:
        def heartbeat(wid: str, load: LoadReport) -> None:
            self.heartbeats.append(load)
            self.loads.append(load)

        return WorkerCallbacks(lambda wid, evs: self.events.extend(evs), heartbeat,
                               lambda wid, load: self.loads.append(load),
                               lambda wid, reason: self.unavailable.append(reason), self.clock,
                               on_limits=lambda wid, seq, prompt: self.limits.append((seq, prompt)),
                               on_adapters=lambda wid, names: self.adapters.append(names))

    @property
    def load(self) -> LoadReport:
        """The freshest load the handle pushed."""
        return self.loads[-1]
