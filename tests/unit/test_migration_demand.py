"""Cache migration's demand shared between NATS frontends (``Migrator.shared_demand`` / ``peer_demand``,
``control/migration_peers.py``): the planning frontend ranks and thresholds prefixes on its own requests plus
the others' reports, decayed from their arrival, for the prefixes it tracks itself; stale reports stop counting;
a report that names another frontend than its subject is not taken."""

from __future__ import annotations

import pytest

from unit.fake_bus import FakeBus
from unit.test_cache_migration import BS, FLEET, A, B, setup
from thunderagent.bus.nats import BusMsg
from thunderagent.bus.wire import Subjects, encode
from thunderagent.bus.wire_migration import MigrationDemand, decode_migration_demand
from thunderagent.config import KvTransferConfig, MigrationConfig, RoutingConfig
from thunderagent.control.migration_peers import MigrationPeers
from thunderagent.engine.timing import PolynomialTiming
from thunderagent.kv.index import KvIndex
from thunderagent.transfer.migration import PEER_DEMAND_TTL_S, SHARED_PREFIXES, Migrator
from thunderagent.transfer.plane import TransferPlane


def knobs(**mig: object) -> tuple[Migrator, KvIndex]:
    """``setup``'s fleet and index with migration knobs set."""
    _, index = setup()
    r = RoutingConfig(migration=MigrationConfig(enabled=True, link=KvTransferConfig(enabled=True, bandwidth_gbps=200.0),
                                                **mig))  # type: ignore[arg-type]
    return Migrator(r, TransferPlane(r.migration.link), PolynomialTiming(), BS), index


def observe(mig, hashes: list[int], n: int, now: float) -> None:  # noqa: ANN001
    for i in range(n):
        mig.observe(hashes + [90_000 + i], len(hashes), now)


def test_the_others_reports_add_to_the_demand_of_the_prefixes_tracked_here():
    mig, _ = setup()  # demand_half_life_s: the config's default
    hl = mig.cfg.demand_half_life_s
    observe(mig, A, 1, 0.0)
    assert mig.demand(A[-1], 0.0) == 1.0 and mig.demand_from(0.0) == []
    mig.peer_demand("fb", [(A[-1], 4.0), (B[-1], 9.0)], 0.0)  # B: not tracked here (no blocks, no tokens to copy)
    assert mig.demand(A[-1], 0.0) == 5.0 and mig.demand(B[-1], 0.0) == 0.0
    assert mig.demand(A[-1], hl) == pytest.approx(2.5)  # both halve with the half-life
    mig.peer_demand("fc", [(A[-1], 2.0)], hl)  # arrived later: decays from its arrival
    assert mig.demand(A[-1], hl) == pytest.approx(4.5) and mig.demand_from(hl) == ["fb", "fc"]
    mig.peer_demand("fb", [], hl)  # a newer report replaces the last: fb has none now
    assert mig.demand(A[-1], hl) == pytest.approx(2.5)
    # a frontend not heard for PEER_DEMAND_TTL_S no longer counts
    late = hl + PEER_DEMAND_TTL_S + 1
    assert mig.demand_from(late) == []
    assert mig.demand(A[-1], late) == pytest.approx(0.5 ** (late / hl))  # its own request alone


def test_min_demand_and_ranking_weigh_the_fleets_demand():
    """One request here is under min_demand 2; with another frontend's 3 the prefix is copied."""
    mig, index = knobs(min_demand=2.0)
    observe(mig, A, 1, 0.0)
    mig.tick(FLEET, index, 0.0)
    assert mig.tick(FLEET, index, 0.3) == []  # 1 < 2: not planned (nothing refused: under the threshold)
    mig.peer_demand("fb", [(A[-1], 3.0)], 0.4)
    (m,) = mig.tick(FLEET, index, 0.5)  # the next look
    assert m.key == A[-1] and m.demand > 3.0


def test_a_frontend_reports_its_most_demanded_prefixes_only():
    mig, _ = knobs(max_prefixes=200)
    for k in range(SHARED_PREFIXES + 10):
        observe(mig, [10_000 + 100 * k + j for j in range(40)], 1 + k % 3, 0.0)  # 2,560 tokens each
    shared = mig.shared_demand(0.0)
    assert len(shared) == SHARED_PREFIXES and [d for _, d in shared] == sorted((d for _, d in shared), reverse=True)
    assert shared[0][1] == 3.0


async def test_the_bus_side_reports_every_look_and_takes_only_the_others_reports():
    mig, _ = setup()
    observe(mig, A, 2, 0.0)
    bus, subjects = FakeBus(), Subjects()
    peers = MigrationPeers(bus, subjects, "fa", mig)  # type: ignore[arg-type]
    await peers.start(lambda: 1.0)
    peers.share()
    ((subject, body, _),) = [p for p in bus.published if p[0].endswith(".demand")]
    assert subject == "ta.frontend.fa.demand"
    decay = 0.5 ** (1.0 / mig.cfg.demand_half_life_s)
    assert decode_migration_demand(body) == MigrationDemand("fa", [(A[-1], 2.0 * decay)])
    handler = bus.subs["ta.frontend.*.demand"]
    await handler(BusMsg("ta.frontend.fb.demand", encode(MigrationDemand("fb", [(A[-1], 5.0)]))))
    await handler(BusMsg("ta.frontend.fa.demand", body))  # our own, echoed: not counted twice
    await handler(BusMsg("ta.frontend.fc.demand", encode(MigrationDemand("fb", [(A[-1], 50.0)]))))  # forged origin
    await handler(BusMsg("ta.frontend.fd.demand", b"\x01garbage"))
    assert mig.demand_from(1.0) == ["fb"] and peers.ignored == 2
    assert mig.demand(A[-1], 1.0) == pytest.approx(2.0 * decay + 5.0)
    await peers.stop()
