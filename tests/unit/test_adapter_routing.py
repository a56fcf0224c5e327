"""A LoRA adapter some servers list by name is routed only among them (``Dispatcher.dispatch``); one no worker
lists (a simulated fleet's ``lora_name``) is routed as any request; the registry lists each adapter once."""

from __future__ import annotations

import random

from thunderagent.config import RoutingConfig
from thunderagent.control.registry import WorkerRegistry
from thunderagent.kv.index import KvIndex
from thunderagent.router.router import KvRouter
from thunderagent.scheduler.dispatch import Dispatcher
from thunderagent.types import BlockStored, LoadReport, WorkerInfo, WorkerState

BS = 4
P = list(range(16))


def _fleet(adapters: dict[str, frozenset[str]]) -> tuple[Dispatcher, KvIndex, list[WorkerState]]:
    idx = KvIndex(prediction_ttl=30.0, double_hash=False)  # (events without check hashes count)
    for w in adapters:
        idx.add_worker(w)
    workers = [WorkerState(w, BS, 1024, 8, LoadReport(w, 0.0, 0, 0, 0, 0, 0, 0, 1000), adapters=a)
               for w, a in adapters.items()]
    return Dispatcher(KvRouter(RoutingConfig(double_hash=False), idx, random.Random(0)), BS), idx, workers


def test_an_adapter_goes_only_to_the_workers_listing_it_even_against_the_cache() -> None:
    d, idx, workers = _fleet({"a": frozenset(), "b": frozenset({"sql"}), "c": frozenset({"sql", "math"})})
    req = d.prepare("r1", P, 4, lora_name="sql")
    idx.apply_event(BlockStored("a", 0, tuple(req.block_hashes), None), 0.0)  # the whole prompt cached on a
    got = d.dispatch(req, workers, 1.0)
    assert got.decision.worker_id in ("b", "c") and {c.worker_id for c in got.decision.candidates} == {"b", "c"}
    math = d.dispatch(d.prepare("r2", P, 4, lora_name="math"), workers, 1.0)
    assert math.decision.worker_id == "c" and len(math.decision.candidates) == 1
    # excluded (it could not take it): the adapter's other server
    again = d.dispatch(d.prepare("r3", P, 4, lora_name="sql"), workers, 1.0, exclude=("c",))
    assert again.decision.worker_id == "b"


def test_an_adapter_no_worker_lists_is_routed_as_any_request() -> None:
    d, idx, workers = _fleet({"a": frozenset(), "b": frozenset({"sql"})})
    req = d.prepare("r1", P, 4, lora_name="own-lora")
    idx.apply_event(BlockStored("a", 0, tuple(req.block_hashes), None), 0.0)
    got = d.dispatch(req, workers, 1.0)
    assert got.decision.worker_id == "a" and len(got.decision.candidates) == 2  # the cache decides, as ever


def test_registry_lists_adapters_served_anywhere_and_puts_them_in_routing() -> None:
    reg = WorkerRegistry(1.0, 3)
    for w, a in (("a", ("sql",)), ("b", ("math", "sql"))):
        reg.register(WorkerInfo(w, "both", BS, 1024, 8, 1000, adapters=a), 0.0)
    assert reg.adapters_anywhere() == ["math", "sql"] and reg.adapter("math") == (1, 2)
    assert {w.worker_id: w.adapters for w in reg.routable()} == {"a": frozenset({"sql"}),
                                                                  "b": frozenset({"math", "sql"})}
    reg.deregister("b")  # its adapters leave with it
    assert reg.adapters_anywhere() == ["sql"] and reg.adapter("math") == (0, 1) and reg.adapter("sql") == (1, 1)
    assert reg.adapter("never-listed") == (0, 1)
