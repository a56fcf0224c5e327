"""Static membership: the workers the config names, built in this process (``thunderagent serve``).

Each node group's ``engine`` kind picks a :data:`~thunderagent.execution.handle.WorkerFactory`
(the simulated engine's, vLLM's and SGLang's are registered by ``thunderagent.assemble``); the
handles live as long as the fleet. A worker whose lease expires stays known: when it heartbeats
again the fleet takes it back and its cache is reloaded from a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from dataclasses import replace
from typing import TYPE_CHECKING

from thunderagent.config import EndpointConfig, ExecutionGroupConfig, NodeConfig, check_servers
from thunderagent.control.admin_state import Added, AdminState, Named, load_state, save_state
from thunderagent.control.marks import apply_asleep, apply_cordon, apply_paused
from thunderagent.execution.handle import WorkerCallbacks, WorkerFactory, WorkerHandle, snapshot_checks
from thunderagent.execution.kv_stream import StreamStats
from thunderagent.types import PromptLimit, WorkerInfo

if TYPE_CHECKING:
    from thunderagent.control.fleet import Fleet

log = logging.getLogger(__name__)


class StaticMembership:
    def __init__(self, group: ExecutionGroupConfig, factories: Mapping[str, WorkerFactory],
                 state_file: Path | None = None) -> None:
        for node in group.nodes:
            if node.engine not in factories:
                raise ValueError(f"no worker factory for engine kind {node.engine!r}")
        self.group = group
        self.factories = dict(factories)
        self.handles: dict[str, WorkerHandle] = {}
        self.groups: dict[str, int] = {}  # worker id -> its node group's index
        self._fleet: Fleet | None = None
        self._callbacks: WorkerCallbacks | None = None
        self._used: set[str] = set()  # every id a worker had: not made up again (a removed one's series stay its)
        self._next = 0  # the next worker-<n> to try
        #: control_plane.admin_state_file (control/admin_state.py): the operator's changes kept across restarts,
        #: read and checked here (a bad file stops the start with its error, before serving)
        self.state_file = state_file
        self.endpoints: dict[str, EndpointConfig] = {}  # each real engine's worker: its server
        self._state = load_state(state_file) if state_file is not None else AdminState()
        self._check_state(self._state)
        self._saving = asyncio.Lock()
        self.configured: dict[str, Named] = {}  # the config's workers: id -> (id, its server's url)
        self.added: dict[str, Added] = {}  # workers added at runtime, as the state file keeps them

    async def start(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._callbacks = replace(fleet.callbacks(), on_limits=self._on_limits, on_adapters=self._on_adapters,
                                  on_asleep=self._on_asleep, on_paused=self._on_paused, on_kv_pulls=self._on_kv_pulls,
                                  on_prefill=self._on_prefill)
        state = self._state
        removed = {(n.id, n.url) for n in state.removed}
        for g, node in enumerate(self.group.nodes):
            for k in range(node.count):
                wid = self._new_id()
                self.configured[wid] = named = Named(wid, node.endpoints[k].url if node.engine != "simulated" else None)
                if (wid, named.url) in removed:  # an operator removed it before the restart: it stays out
                    self._used.add(wid)
                    log.warning("worker %s stays removed (control_plane.admin_state_file)", wid)
                else:
                    self._join(g, node, k, wid)
        if self.state_file is not None:
            self._restore(state)
        fleet.metrics.watch_kv_streams(self._kv_streams)
        fleet.max_context_tokens = fleet.registry.context_limit()  # real engines state theirs later
        if all(node.engine == "simulated" for node in self.group.nodes):
            if not any(node.enable_chunked_prefill for node in self.group.nodes):
                # the engine would end such a prompt unserved (it can never fit one pass); vLLM refuses
                # it up front too (without chunked prefill its max_model_len is at most a pass)
                fleet.prompt_limit = PromptLimit(max(node.max_num_batched_tokens for node in self.group.nodes),
                                                 "a worker prefills in one pass (max_num_batched_tokens; "
                                                 "enable_chunked_prefill is off)")

    def _check_state(self, state: AdminState) -> None:
        """The state file's added workers, checked as ``add`` checks them (a group, a server for an engine's), each id
        once and none a configured worker's that is not removed. Raises ValueError naming the entry."""
        removed = {n.id for n in state.removed}
        configured = {f"worker-{k}" for k in range(sum(node.count for node in self.group.nodes))} - removed
        seen: set[str] = set()
        for a in state.added:
            try:
                self._check_add(a.group, a.endpoint())
                if a.id in seen or a.id in configured:
                    raise ValueError(f"id: {a.id!r} names another worker too")
            except ValueError as e:
                raise ValueError(f"control_plane.admin_state_file {self.state_file}: added worker {a.id!r}: {e}") \
                    from None
            seen.add(a.id)

    def _check_add(self, g: int, endpoint: EndpointConfig | None) -> NodeConfig:
        nodes = self.group.nodes
        if not 0 <= g < len(nodes):
            raise ValueError(f"group: the fleet has node groups 0..{len(nodes) - 1}, got {g}")
        node = nodes[g]
        if (endpoint is None) != (node.engine == "simulated"):
            raise ValueError(f"url: group {g} runs engine {node.engine}: " + (
                "a simulated engine has no server to name" if endpoint is not None else "name its server's url"))
        if endpoint is not None:  # a server is in the fleet once (once per data-parallel rank)
            if endpoint.data_parallel_rank is not None and node.engine == "sglang":
                raise ValueError("data_parallel_rank: vLLM's (SGLang's ranks are not addressed by ThunderAgent)")
            check_servers([*((f"worker {w}", e) for w, e in self.endpoints.items() if w in self.handles),
                           ("url", endpoint)])
        return node

    def _restore(self, state: AdminState) -> None:
        """The state file's added workers and cordons, after the configured workers joined; then the file is written
        back as the fleet now is (which also shows at start that it can be written)."""
        fleet = self._fleet
        assert fleet is not None and self.state_file is not None
        for n in state.removed:
            if self.configured.get(n.id) != n:
                log.warning("control_plane.admin_state_file: removed worker %s (%s) is not a configured worker now: "
                            "not applied", n.id, n.url)
        for a in state.added:  # (checked when the file was read)
            self.add(a.group, a.endpoint(), a.id)
        for n in state.cordoned:
            if n.id in self.handles and self.server_of(n.id) == n.url:
                apply_cordon(fleet, n.id, True, "kept from before the restart (control_plane.admin_state_file)")
            else:
                log.warning("control_plane.admin_state_file: cordoned worker %s (%s) is not in the fleet now: not "
                            "applied", n.id, n.url)
        try:
            save_state(self.state_file, self.snapshot())
        except OSError as e:  # (a read-only folder: said at start, not at the first change)
            log.error("control_plane.admin_state_file: cannot write %s: %s; the operator's changes will not be "
                      "kept", self.state_file, e)

    def server_of(self, worker_id: str) -> str | None:
        """The url of the worker's server (None: a simulated engine, or not a worker of this fleet)."""
        if worker_id in self.added:
            return self.added[worker_id].url
        named = self.configured.get(worker_id)
        return named.url if named is not None else None

    def snapshot(self) -> AdminState:
        """The operator's changes as the fleet now is: added workers, configured ones removed, cordons."""
        fleet = self._fleet
        cordoned = sorted(fleet.cordoned) if fleet is not None else []
        return AdminState(added=list(self.added.values()),
                          removed=[n for wid, n in self.configured.items() if wid not in self.handles],
                          cordoned=[Named(w, self.server_of(w)) for w in cordoned if w in self.handles])

    async def save(self) -> None:
        """Write the state file (when there is one) as the fleet now is; one write at a time, off the event loop.
        Raises OSError when it cannot be written."""
        if self.state_file is None:
            return
        async with self._saving:
            await asyncio.to_thread(save_state, self.state_file, self.snapshot())

    def _join(self, g: int, node: NodeConfig, k: int, wid: str) -> None:
        """Build the worker of group ``g``'s ``k``-th server (a simulated engine: its ``k``-th) and let it join."""
        fleet = self._fleet
        assert fleet is not None and self._callbacks is not None
        handle = self.factories[node.engine](node, wid, k, self._callbacks)  # (raises on a bad endpoint: no id taken)
        self._used.add(wid)
        if node.endpoints:
            self.endpoints[wid] = node.endpoints[k]
        info = WorkerInfo(wid, node.role.value, node.block_size, node.max_num_batched_tokens,
                          node.queue_depth_threshold, node.kv_blocks, node.max_batch_size, *node.sequence_limits(),
                          server=node.shared_server(k))
        fleet.join(handle, info, synced=True)  # a new handle: its cache is empty or replayed
        self.handles[wid] = handle
        self.groups[wid] = g
        handle.start()

    def _new_id(self) -> str:
        while f"worker-{self._next}" in self._used:
            self._next += 1
        return f"worker-{self._next}"

    def add(self, g: int, endpoint: EndpointConfig | None, worker_id: str | None) -> str:
        """A worker added at runtime to node group ``g`` (``POST /v1/admin/workers``): one more server of a real
        engine group (``endpoint``), or one more simulated engine; routable at once. Returns its id. Raises
        ValueError (what is wrong, naming the field) when it cannot be added; the config is not rewritten."""
        node = self._check_add(g, endpoint)
        wid = worker_id or self._new_id()
        if self._fleet is None or wid in self._fleet.workers:
            raise ValueError(f"id: a worker {wid!r} is already in the fleet")
        if endpoint is not None:  # a copy of the group with this one server (the factory reads endpoints[k])
            node = node.model_copy(update={"endpoints": [endpoint], "count": 1})
        self._join(g, node, 0, wid)
        self.added[wid] = Added.of(wid, g, endpoint)
        self._fleet.max_context_tokens = self._fleet.registry.context_limit()
        return wid

    async def remove(self, worker_id: str) -> None:
        """Stop a worker the fleet let go (``fleet.leave`` first: its requests drained or cut)."""
        handle = self.handles.pop(worker_id, None)
        self.groups.pop(worker_id, None)
        self.added.pop(worker_id, None)
        self.endpoints.pop(worker_id, None)
        if handle is not None:
            await handle.stop()
        if self._fleet is not None:
            self._fleet.max_context_tokens = self._fleet.registry.context_limit()

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

    def _on_asleep(self, worker_id: str, asleep: bool) -> None:
        """A server's own sleep state (vLLM's ``vllm:engine_sleep_state`` gauge) changed."""
        if self._fleet is not None:
            apply_asleep(self._fleet, worker_id, asleep, "its server's metrics say so")

    def _on_paused(self, worker_id: str, paused: bool) -> None:
        """A server's own pause state (vLLM's ``/is_paused``, read with its load polls)."""
        if self._fleet is not None:
            apply_paused(self._fleet, worker_id, paused, "its server's /is_paused says so")

    def _on_kv_pulls(self, worker_id: str, nbytes: float, seconds: float, transfers: float) -> None:
        """A server's own KV pulls so far (vLLM's NIXL metrics): the transfer plane's links learn from them."""
        fleet = self._fleet
        if fleet is not None:
            fleet.transfers.on_server_pulls(worker_id, nbytes, seconds, transfers, fleet.now())

    def _on_prefill(self, worker_id: str, tokens: float, seconds: float) -> None:
        """A server's computed prompt tokens and prefill seconds so far (vLLM's metrics): its measured prefill rate."""
        if self._fleet is not None:
            self._fleet.transfers.on_server_prefill(worker_id, tokens, seconds)

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
