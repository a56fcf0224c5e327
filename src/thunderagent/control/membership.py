"""Static membership: the workers the config names, built in this process (``thunderagent serve``).

Each node group's ``engine`` kind picks a :data:`~thunderagent.execution.handle.WorkerFactory`
(the simulated engine's, vLLM's and SGLang's are registered by ``thunderagent.assemble``); the
handles live as long as the fleet. A worker whose lease expires stays known: when it heartbeats
again the fleet takes it back and its cache is reloaded from a snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from thunderagent.config import ExecutionGroupConfig
from thunderagent.execution.handle import WorkerFactory, WorkerHandle, snapshot_checks
from thunderagent.execution.kv_stream import StreamStats
from thunderagent.types import PromptLimit, WorkerInfo

if TYPE_CHECKING:
    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)


class StaticMembership:
    def __init__(self, group: ExecutionGroupConfig, factories: Mapping[str, WorkerFactory]) -> None:
        for node in group.nodes:
            if node.engine not in factories:
                raise ValueError(f"no worker factory for engine kind {node.engine!r}")
        self.group = group
        self.factories = dict(factories)
        self.handles: dict[str, WorkerHandle] = {}
        self._fleet: Fleet | None = None

    async def start(self, fleet: Fleet) -> None:
        self._fleet = fleet
        callbacks = replace(fleet.callbacks(), on_limits=self._on_limits, on_adapters=self._on_adapters)
        n = 0
        for node in self.group.nodes:
            factory = self.factories[node.engine]
            for k in range(node.count):
                wid = f"worker-{n}"
                n += 1
                handle = factory(node, wid, k, callbacks)
                info = WorkerInfo(wid, node.role.value, node.block_size, node.max_num_batched_tokens,
                                  node.queue_depth_threshold, node.kv_blocks, node.max_batch_size,
                                  *node.sequence_limits())
                fleet.join(handle, info, synced=True)  # a new handle: its cache is empty or replayed
                self.handles[wid] = handle
                handle.start()
        fleet.metrics.watch_kv_streams(self._kv_streams)
        fleet.max_context_tokens = fleet.registry.context_limit()  # real engines state theirs later
        if all(node.engine == "simulated" for node in self.group.nodes):
            if not any(node.enable_chunked_prefill for node in self.group.nodes):
                # the engine would end such a prompt unserved (it can never fit one pass); vLLM refuses
                # it up front too (without chunked prefill its max_model_len is at most a pass)
                fleet.prompt_limit = PromptLimit(max(node.max_num_batched_tokens for node in self.group.nodes),
                                                 "a worker prefills in one pass (max_num_batched_tokens; "
                                                 "enable_chunked_prefill is off)")

    def _on_limits(self, worker_id: str, max_seq: int, max_prompt: int) -> None:
        """A real engine stated its limits (vLLM: max_model_len): routing and the frontend's check use them."""
        fleet = self._fleet
        assert fleet is not None
        registry = fleet.registry
        try:
            info = registry.info(worker_id)
        except KeyError:  # not registered (any more)
            return
        registry.restate(replace(info, max_seq_tokens=max_seq, max_prompt_tokens=max_prompt))
        fleet.max_context_tokens = registry.context_limit()  # once all stated one: refused up front

    def _on_adapters(self, worker_id: str, adapters: tuple[str, ...]) -> None:
        """A real engine's LoRA adapters (vLLM's /v1/models): the frontend serves them by name."""
        registry = self._fleet.registry if self._fleet is not None else None
        if registry is not None and worker_id in registry.worker_ids():
            registry.restate(replace(registry.info(worker_id), adapters=adapters))

    async def stop(self) -> None:
        for handle in self.handles.values():
            await handle.stop()

    def _kv_streams(self) -> dict[str, StreamStats]:
        """The engine adapters' KV-event streams (simulated workers have none)."""
        out = {}
        for wid, handle in self.handles.items():
            stats = getattr(handle, "kv_stream_stats", None)  # EngineWorker (vLLM / SGLang servers)
            if stats is not None:
                out[wid] = stats()
        return out

    def resync(self, worker_id: str) -> None:
        fleet, handle = self._fleet, self.handles.get(worker_id)
        if fleet is None or handle is None:
            return
        fleet.feed.begin_sync(worker_id)
        snap = handle.snapshot()  # may flush pending events first: the feed buffers them
        now = fleet.now()
        if snap is None:
            fleet.feed.abandon_sync(worker_id, now)
        elif fleet.feed.apply_dump(worker_id, snap[0], snap[1], now, snapshot_checks(snap)):
            log.warning("worker %s: events lost during its resync; the index waits for its next events", worker_id)

    def lease_expired(self, worker_id: str) -> None:
        pass  # the handle stays: the fleet takes the worker back when its heartbeats resume

    def summary(self) -> dict[str, object]:
        return {}
