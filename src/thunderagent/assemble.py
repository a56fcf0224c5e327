"""The object graph, built in one place: the fleet a frontend runs and the handle a worker process runs.

``serve`` (one process): a :class:`~thunderagent.control.fleet.Fleet` with
:class:`~thunderagent.control.membership.StaticMembership` over the config's node groups.
``frontend`` (NATS): the same fleet with
:class:`~thunderagent.control.nats_membership.NatsMembership`. ``worker`` (NATS): the node group's
handle, put on the bus by :class:`~thunderagent.execution.nats_worker.WorkerService`.
"""

from __future__ import annotations

from pathlib import Path

from collections.abc import Callable

from thunderagent.bus.nats import Bus
from thunderagent.config import Config, Policy
from thunderagent.control.fleet import Fleet
from thunderagent.control.membership import StaticMembership
from thunderagent.control.nats_membership import NatsMembership
from thunderagent.execution.factories import worker_factories
from thunderagent.frontend.tokenizer import ByteTokenizer, Tokenizer


def load_tokenizer(cfg: Config) -> Tokenizer:
    """The model's tokenizer when ``cfg.model`` names a model directory (blocking: call it before
    the server starts), else the byte-level tokenizer of the simulated engines."""
    if cfg.model is None:
        return ByteTokenizer()
    from thunderagent.frontend.hf_tokenizer import HfTokenizer

    return HfTokenizer(cfg.model, prefix_cache_bytes=int(cfg.control_plane.tokenizer.prefix_cache_mb * (1 << 20)))


def build_fleet(cfg: Config, tokenizer: Tokenizer, *, policy: Policy | None = None,
                clock: Callable[[], float] | None = None) -> Fleet:
    """The single-process fleet: the config's workers, built here."""
    state = cfg.control_plane.admin_state_file
    membership = StaticMembership(cfg.execution_group, worker_factories(cfg, tokenizer.eos_token_id),
                                  Path(state) if state is not None else None)
    return Fleet(cfg, membership, policy=policy, clock=clock)


def build_nats_fleet(cfg: Config, bus: Bus, *, prefix: str = "ta", policy: Policy | None = None,
                     clock: Callable[[], float] | None = None, **membership_options: float) -> Fleet:
    """A frontend whose workers are discovered on the NATS bus."""
    if cfg.control_plane.admin_state_file is not None:  # (worker processes keep their own cordons; none is added)
        raise ValueError("control_plane.admin_state_file is for `thunderagent serve`: over NATS each worker process "
                         "keeps its cordon, and workers join and leave by themselves")
    return Fleet(cfg, NatsMembership(bus, prefix=prefix, **membership_options), policy=policy, clock=clock)
