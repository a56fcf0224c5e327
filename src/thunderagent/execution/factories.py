"""Worker factories by engine kind: how a node group's workers are built, in a frontend process
(``serve``) or in a worker process (``thunderagent worker``)."""

from __future__ import annotations

from thunderagent.config import Config, NodeConfig
from thunderagent.engine.preemption import knobs_from
from thunderagent.engine.simulated import SimulatedEngine
from thunderagent.execution.handle import WorkerCallbacks, WorkerFactory, WorkerHandle
from thunderagent.execution.local import LocalWorker, ScaledClock
from thunderagent.execution.openai import openai_factory
from thunderagent.execution.sglang import sglang_factory
from thunderagent.execution.vllm import engine_factory


def simulated_factory(cfg: Config, eos_token_id: int | None) -> WorkerFactory:
    """Simulated engines driven in this process; all of them share one scaled clock (started with
    the first worker, inside the running event loop). ``eos_token_id`` None: the engine's default
    (the byte tokenizer's)."""
    clock: ScaledClock | None = None

    def make(node: NodeConfig, worker_id: str, k: int, callbacks: WorkerCallbacks) -> WorkerHandle:
        nonlocal clock
        if clock is None:
            clock = ScaledClock(cfg.simulation.speedup)
        preempt = knobs_from(cfg.routing)
        engine = (SimulatedEngine(worker_id, node, preempt=preempt) if eos_token_id is None
                  else SimulatedEngine(worker_id, node, eos_token_id=eos_token_id, preempt=preempt))
        return LocalWorker(engine, clock, callbacks, cfg.control_plane.heartbeat_interval)

    return make


def worker_factories(cfg: Config, eos_token_id: int | None) -> dict[str, WorkerFactory]:
    """Every engine kind a node group may name (``execution_group.nodes[].engine``)."""
    return {
        "simulated": simulated_factory(cfg, eos_token_id),
        "vllm": engine_factory(cfg),
        "sglang": sglang_factory(cfg),
        "openai": openai_factory(cfg),
    }
