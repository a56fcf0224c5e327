"""Worker factories by engine kind: how a node group's workers are built, in a frontend process
(``serve``) or in a worker process (``thunderagent worker``)."""

from __future__ import annotations

from collections.abc import Callable

from thunderagent.config import Config, KvTransferConfig, NodeConfig
from thunderagent.engine.preemption import knobs_from
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.execution.handle import WorkerCallbacks, WorkerFactory, WorkerHandle
from thunderagent.execution.kv_bytes import KvByteService
from thunderagent.execution.kv_bytes_worker import KvBytesWorker
from thunderagent.execution.local import LocalWorker, ScaledClock
from thunderagent.execution.openai import openai_factory
from thunderagent.execution.sglang import sglang_factory
from thunderagent.execution.vllm import engine_factory


def simulated_factory(cfg: Config, eos_token_id: int | None) -> WorkerFactory:
    """Simulated engines driven in this process; all of them share one scaled clock (started with
    the first worker, inside the running event loop). ``eos_token_id`` None: the engine's default
    (the byte tokenizer's)."""
    clock: ScaledClock | None = None
    plane = fleet_plane(cfg)
    block_bytes = 0 if plane is None else sim_block_bytes(plane, cfg.execution_group.nodes[0].block_size)
    # one KV byte server per process, shared by its simulated workers (offers are keyed by request id)
    service = None if not block_bytes else KvByteService(plane.sim_host, plane.sim_faults)  # type: ignore[union-attr]

    def make(node: NodeConfig, worker_id: str, k: int, callbacks: WorkerCallbacks) -> WorkerHandle:
        nonlocal clock
        if clock is None:
            clock = ScaledClock(cfg.simulation.speedup)
        preempt = knobs_from(cfg.routing)
        engine = (SimulatedEngine(worker_id, node, preempt=preempt) if eos_token_id is None
                  else SimulatedEngine(worker_id, node, eos_token_id=eos_token_id, preempt=preempt))
        worker = LocalWorker(engine, clock, callbacks, cfg.control_plane.heartbeat_interval)
        if service is None:
            return worker
        assert plane is not None
        return KvBytesWorker(worker, service, block_bytes, plane, callbacks.clock)

    return make


def fleet_plane(cfg: Config) -> KvTransferConfig | None:
    """The fleet's transfer plane config when simulated workers hand KV to others, else None: its prefill
    groups' (which agree) when they prefill for others, else cache migration's own link
    (``routing.migration.link``: its copies are the same two halves, a source's job and a target's pull)."""
    for n in cfg.execution_group.nodes:
        if n.kv_cache_transfer.enabled and n.engine == "simulated":
            return n.kv_cache_transfer
    mc = cfg.routing.migration
    if mc.enabled and mc.link.enabled and any(n.engine == "simulated" for n in cfg.execution_group.nodes):
        return mc.link
    return None


def sim_block_bytes(plane: KvTransferConfig, block_size: int) -> int:
    """Payload bytes per block simulated workers move (0: none; default: what the plane charges)."""
    return plane.bytes_per_token * block_size if plane.sim_block_bytes is None else plane.sim_block_bytes


def worker_factories(cfg: Config, eos_token_id: int | None) -> dict[str, WorkerFactory]:
    """Every engine kind a node group may name (``execution_group.nodes[].engine``)."""
    return {
        "simulated": simulated_factory(cfg, eos_token_id),
        "vllm": engine_factory(cfg),
        "sglang": sglang_factory(cfg),
        "openai": openai_factory(cfg),
    }


def handle_builder(cfg: Config, node: NodeConfig, worker_id: str,
                   endpoint: int) -> Callable[[WorkerCallbacks], WorkerHandle]:
    """How a worker process builds its worker (``thunderagent worker``): the factory of the node group's engine
    kind (the simulated engine, or a real engine's adapter; the tokenizer is the frontend's business)."""
    factory = worker_factories(cfg, None).get(node.engine)  # simulated: the byte vocabulary's EOS
    if factory is None:
        raise ValueError(f"engine kind {node.engine!r} has no worker factory: it cannot run as a NATS worker yet")
    if node.engine != "simulated" and not 0 <= endpoint < node.count:
        raise ValueError(f"--endpoint {endpoint} out of range: node group has {node.count} endpoints")
    return lambda cb: factory(node, worker_id, endpoint, cb)
