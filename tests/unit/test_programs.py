"""The agent-program table: states, steps, placement, release and idle expiry (pure)."""

from __future__ import annotations

import pytest

from thunderagent.scheduler.programs import EVERYONE, Program, ProgramState, ProgramTable, program_key
from thunderagent.scheduler.queue import QueueFull


def test_a_program_reasons_while_a_request_runs_and_acts_between_them() -> None:
    t = ProgramTable(idle_ttl_s=60.0)
    p = t.request_started("agent-1", 10.0)
    assert p.state is ProgramState.REASONING and p.in_flight == 1
    t.request_placed("agent-1", "worker-2")
    t.request_finished("agent-1", 1500, 12.0, completed=True)
    assert (p.state, p.steps, p.context_tokens, p.worker, p.last_change) == (ProgramState.ACTING, 1, 1500, "worker-2", 12.0)
    t.request_started("agent-1", 20.0)  # the tool returned: next step
    t.request_started("agent-1", 20.5)  # a parallel sub-request
    t.request_finished("agent-1", 1800, 21.0, completed=True)
    assert p.state is ProgramState.REASONING and p.in_flight == 1  # one still running
    t.request_finished("agent-1", 0, 22.0, completed=False)  # cut off: not a step
    assert (p.state, p.steps, p.context_tokens) == (ProgramState.ACTING, 2, 1800)
    assert t.by_state() == {"reasoning": 0, "acting": 1, "paused": 0}
    assert t.snapshot(30.0) == [{"id": "agent-1", "tenant": None, "state": "acting", "worker": "worker-2", "steps": 2, "in_flight": 0,
                                 "context_tokens": 1800, "age_s": 20.0, "in_state_s": 8.0, "pinned": None,
                                 "pause_cycles": 0, "pause_after_turn": False}]


def test_release_and_idle_expiry_terminate_programs() -> None:
    t = ProgramTable(idle_ttl_s=60.0)
    for pid, at in (("a", 0.0), ("b", 0.0), ("c", 0.0)):
        t.request_started(pid, at)
    t.request_finished("a", 10, 1.0, completed=True)
    t.request_finished("b", 10, 30.0, completed=True)  # "c" keeps reasoning: never expires
    assert t.expire(60.9) == [] and t.expire(61.0) == ["a"]
    assert t.release("b") and not t.release("b") and t.get("b") is None
    t.request_finished("b", 10, 62.0, completed=True)  # a late end of a released program: ignored
    assert len(t) == 1 and t.get("c").state is ProgramState.REASONING
    with pytest.raises(ValueError):
        ProgramTable(0)


def _scan(t: ProgramTable, now: float, tenant: str | None = EVERYONE) -> tuple[dict[str, int], list[str]]:
    """What the table answered by scanning every program (before it kept counts and an idle heap)."""
    counts = {"reasoning": 0, "acting": 0, "paused": 0}
    for p in t:
        if tenant == EVERYONE or p.tenant == tenant:
            counts[p.state.value] += 1
    idle = [p.program_id for p in t if p.state is not ProgramState.REASONING and not p.in_flight
            and now - p.last_change >= t.idle_ttl_s]
    return counts, idle


def _victims(t: ProgramTable, tenant: str | None) -> set[str]:
    """By a scan: the programs a new program of ``tenant`` may evict from a full table (the idlest of
    each tenant with the highest count, the new one counted, among tenants with an idle program)."""
    held: dict[str | None, int] = {}
    idlest: dict[str | None, Program] = {}
    for p in t:
        held[p.tenant] = held.get(p.tenant, 0) + 1
        if p.state is not ProgramState.REASONING and not p.in_flight:
            if p.tenant not in idlest or (p.idle_since, p.seq) < (idlest[p.tenant].idle_since, idlest[p.tenant].seq):
                idlest[p.tenant] = p
    if not idlest:
        return set()
    top = max(held[x] + (x == tenant) for x in idlest)
    if tenant in idlest and held[tenant] + 1 == top:
        return {idlest[tenant].program_id}  # on a tie the newcomer's tenant pays
    return {p.program_id for x, p in idlest.items() if held[x] == top}


def test_state_counts_and_expiry_match_a_scan_of_the_table_under_random_operations() -> None:
    """Counts kept per state and the idle heap answer exactly what a full scan answers, after every
    step of random sequences (starts, ends, cancels, pauses with and without a held request,
    resumes, releases, sweeps), stale heap entries and re-created ids included; programs of three
    owners (keys off's None and two tenants) sharing ids, each owner's counts and listing its own.
    Half the seeds bound the table: every eviction takes the idlest program of a tenant holding the
    most (counting the new program) among those with one idle, as a scan finds it."""
    import random

    evictions = 0
    for seed in range(20):
        rng = random.Random(seed)
        t = ProgramTable(idle_ttl_s=5.0, max_programs=7 if seed % 2 else None)
        now = 0.0
        for _ in range(600):
            now += rng.choice((0.0, 0.1, 0.5, 2.0))
            tenant = rng.choice((None, "acme", "zeta", "umbrella"))
            pid = program_key(tenant, f"p{rng.randrange(6)}")
            prog = t.get(pid)
            op = rng.random()
            if op < 0.35:
                before = {p.program_id: p for p in t}
                expected = _victims(t, tenant) if prog is None and len(t) >= (t.max_programs or 1e9) else None
                t.request_started(pid, now, prompt_tokens=rng.randrange(1, 100), tenant=tenant)
                gone = set(before) - {p.program_id for p in t}
                assert gone == (set() if expected is None else expected & gone) and len(gone) == (1 if expected else 0)
                evictions += len(gone)
            elif op < 0.6 and prog is not None and prog.in_flight:
                t.request_finished(pid, 10, now, completed=rng.random() < 0.8)
            elif op < 0.7 and prog is not None and prog.state is not ProgramState.PAUSED:
                if prog.state is ProgramState.REASONING:
                    prog.pause_after_turn = True  # the pacer marks it: pauses when its turn ends
                else:
                    t.pause(prog, now)
            elif op < 0.8 and prog is not None and prog.state is ProgramState.PAUSED:
                t.resume(prog, "w0", now)
            elif op < 0.85:
                t.release(pid)
            else:
                counts, idle = _scan(t, now)
                assert t.expire(now) == idle
            counts, _ = _scan(t, now)
            assert t.by_state() == counts
            for who in (None, "acme", "zeta", "umbrella"):
                mine, total = t.listing(now, tenant=who)
                assert t.by_state(who) == _scan(t, now, who)[0] and total == len(mine)
                assert {(m["tenant"], m["id"]) for m in mine} == {(p.tenant, p.client_id) for p in t if p.tenant == who}
            assert t.heap_entries() <= 4 * len(t) + 1025 + 17 * 4  # the sweep's heap and each tenant's
    assert evictions > 100  # the bounded seeds do evict


def test_past_max_programs_a_new_program_evicts_the_one_idle_longest() -> None:
    t = ProgramTable(idle_ttl_s=600.0, max_programs=3)
    for pid, start, end in (("a", 0.0, 5.0), ("b", 1.0, 2.0), ("c", 3.0, 4.0)):
        t.request_started(pid, start)
        t.request_finished(pid, 10, end, completed=True)
    t.request_started("c", 6.0)  # c reasons again: its idle entry (4.0) is stale now
    t.request_started("d", 7.0)  # full: b has been idle longest (since 2.0)
    assert [p.program_id for p in t] == ["a", "c", "d"] and t.evicted == 1
    t.request_started("e", 8.0)  # then a (since 5.0); c and d have requests in flight
    assert [p.program_id for p in t] == ["c", "d", "e"] and t.evicted == 2
    t.request_started("f", 9.0)  # nobody idle: a program in flight is never forgotten, the table grows
    assert len(t) == 4 and t.evicted == 2
    assert t.by_state() == {"reasoning": 4, "acting": 0, "paused": 0}
    t.request_finished("d", 10, 10.0, completed=True)
    t.request_started("g", 11.0)  # d is the only idle one
    assert [p.program_id for p in t] == ["c", "e", "f", "g"] and t.evicted == 3
    with pytest.raises(ValueError, match="max_programs"):
        ProgramTable(60.0, max_programs=0)


def _keys(t: ProgramTable, tenant: str) -> list[str]:
    return sorted(p.program_id for p in t if p.tenant == tenant)


def _idle_program(t: ProgramTable, tenant: str, program_id: str, at: float) -> None:
    key = program_key(tenant, program_id)
    t.request_started(key, at, tenant=tenant)
    t.request_finished(key, 10, at, completed=True)


def test_tenants_picking_the_same_program_id_get_separate_programs() -> None:
    t = ProgramTable(idle_ttl_s=600.0)
    a, z = program_key("acme", "agent-1"), program_key("zeta", "agent-1")
    assert (a, z, program_key(None, "agent-1")) == ("acme/agent-1", "zeta/agent-1", "agent-1")
    t.request_started(a, 1.0, tenant="acme")
    t.request_started(z, 2.0, tenant="zeta")
    t.request_finished(z, 900, 3.0, completed=True)
    assert (t.get(a).state, t.get(a).steps, t.get(z).state, t.get(z).steps) == (ProgramState.REASONING, 0, ProgramState.ACTING, 1)
    assert t.release(z) and t.get(z) is None and t.get(a).in_flight == 1 and t.get("agent-1") is None
    assert t.listing(4.0, tenant="zeta") == ([], 0)
    assert [(m["tenant"], m["id"]) for m in t.listing(4.0)[0]] == [("acme", "agent-1")]
    with pytest.raises(ValueError, match="not tenant 'zeta'"):
        t.request_started(a.replace("acme", "acmex"), 5.0, tenant="zeta")


def test_a_key_is_never_parsed_for_a_tenant() -> None:
    """Ids from elsewhere may hold the separator (a trace's subagent sessions: ``conversation/agent``):
    without a tenant given they are a program of no tenant, shown whole."""
    t = ProgramTable(idle_ttl_s=600.0, max_programs=2)
    for k, sid in enumerate(("conv-1/agent-0", "conv-1/agent-1", "conv-2")):
        t.request_started(sid, float(k))
        t.request_finished(sid, 10, float(k), completed=True)
    assert [(m["tenant"], m["id"]) for m in t.listing(5.0)[0]] == [(None, "conv-1/agent-1"), (None, "conv-2")]
    assert t.by_state(None)["acting"] == 2 and t.evicted == 1


def test_a_full_table_evicts_from_the_tenant_holding_the_most() -> None:
    """Max-min fair eviction: a flood of new ids from one tenant evicts only its own programs once it
    holds the most; a tenant that then starts programs takes its places from the flood."""
    t = ProgramTable(idle_ttl_s=600.0, max_programs=10)
    for i in range(3):
        _idle_program(t, "acme", f"a{i}", float(i))  # idle longest of all
    for i in range(100):  # the flood: each one idle right after its start
        _idle_program(t, "flood", f"f{i}", 10.0 + i)
    assert t.evicted == 93 and t.by_state("acme") == {"reasoning": 0, "acting": 3, "paused": 0}
    assert t.take_evictions() == {"flood": 93} and t.take_evictions() == {}  # drained
    assert sorted(p.program_id for p in t if p.tenant == "flood") == [f"flood/f{i}" for i in range(93, 100)]
    for i in range(4):  # zeta takes its places from the flood's idlest while the flood holds the most
        _idle_program(t, "zeta", f"z{i}", 200.0 + i)
    assert [len(t.listing(300.0, tenant=x)[0]) for x in ("acme", "flood", "zeta")] == [3, 4, 3]
    assert _keys(t, "flood") == [f"flood/f{i}" for i in range(96, 100)]  # z3 tied with it: zeta paid (z0)
    assert _keys(t, "zeta") == ["zeta/z1", "zeta/z2", "zeta/z3"]
    _idle_program(t, "acme", "a3", 300.0)  # acme at 4 with the new one, tied with flood: acme pays
    assert _keys(t, "acme") == ["acme/a1", "acme/a2", "acme/a3"]
    for key in ("flood/f97", "flood/f98", "flood/f99", "zeta/z1", "zeta/z2", "zeta/z3"):
        t.request_started(key, 301.0)  # busy now: never evicted
    # zeta would hold 4 with z6, tied with flood: zeta is preferred but has none idle, flood's f96 goes
    t.request_started(program_key("zeta", "z6"), 302.0, tenant="zeta")
    assert _keys(t, "flood") == ["flood/f97", "flood/f98", "flood/f99"]
    _idle_program(t, "zeta", "z7", 303.0)  # zeta at 5, none idle; flood none idle: acme's a1
    t.request_started(program_key("flood", "f100"), 304.0, tenant="flood")  # zeta holds the most (5): its one idle, z7
    assert (_keys(t, "acme"), _keys(t, "flood")) == (["acme/a2", "acme/a3"], ["flood/f100", "flood/f97", "flood/f98", "flood/f99"])
    assert _keys(t, "zeta") == ["zeta/z1", "zeta/z2", "zeta/z3", "zeta/z6"]
    assert len(t) == 10 and t.evicted == 101 and t.take_evictions() == {"flood": 4, "zeta": 2, "acme": 2}


def test_a_program_cycling_between_steps_keeps_the_idle_heap_bounded() -> None:
    t = ProgramTable(idle_ttl_s=600.0)
    for i in range(5000):  # each step ends idle: one heap entry per step, all but the last stale
        t.request_started("agent", float(i))
        t.request_finished("agent", 10, i + 0.5, completed=True)
    assert t.heap_entries() <= 4 * len(t) + 1025 + 17
    assert t.expire(5000.0) == [] and t.expire(4999.5 + 600.0) == ["agent"] and len(t) == 0


@pytest.mark.parametrize("paced", [False, True])
def test_a_program_keeps_its_prompts_blocks_only_for_the_pacer(paced: bool) -> None:
    """The pacer's accounts read a program's latest block hashes; without pacing an idle program
    keeps no prompt alive (a long agent context is ~40 bytes per block)."""
    import random

    from thunderagent.config import PacingConfig, RoutingConfig, SchedulerConfig
    from thunderagent.kv.index import KvIndex
    from thunderagent.router.router import KvRouter
    from thunderagent.scheduler.dispatch import Dispatcher
    from thunderagent.types import LoadReport, WorkerState

    index = KvIndex(prediction_ttl=60.0)
    index.add_worker("w0")
    d = Dispatcher(KvRouter(RoutingConfig(seed=1), index, random.Random(1)), 16,
                   SchedulerConfig(enabled=False, pacing=PacingConfig(enabled=paced)))
    w = WorkerState("w0", 16, 8192, 64, LoadReport("w0", 0.0, 0, 0, 0, 0, 0, 0, 1000), "both", 4)
    req = d.prepare("r1", list(range(64)), 4)
    assert d.submit(req, "", [w], 1.0, program="agent") is not None
    prog = d.programs.get("agent")
    assert prog is not None and prog.context_tokens == 64
    assert list(prog.blocks) == (req.block_hashes if paced else [])


def test_a_tenant_past_its_program_cap_evicts_its_own_idlest_or_is_refused() -> None:
    """``tenant_limits.<tenant>.max_programs``: acme (cap 2) replaces its own idlest program, and with
    both busy a third is refused (429 code too_many_programs) with nothing changed; "*" caps the
    tenants not named (zeta at 3); globex, named without a cap, is not bounded by "*"."""
    t = ProgramTable(idle_ttl_s=600.0, tenant_caps=({"acme": 2, "globex": None}, 3))
    _idle_program(t, "acme", "a0", 0.0)
    _idle_program(t, "acme", "a1", 1.0)
    _idle_program(t, "zeta", "z0", 1.5)
    _idle_program(t, "acme", "a2", 2.0)  # evicts a0, its own idlest
    assert _keys(t, "acme") == ["acme/a1", "acme/a2"] and _keys(t, "zeta") == ["zeta/z0"]
    assert t.take_evictions() == {"acme": 1}
    for key in ("acme/a1", "acme/a2"):
        t.request_started(key, 3.0)  # both busy
    with pytest.raises(QueueFull) as exc:
        t.request_started(program_key("acme", "a3"), 4.0, tenant="acme")
    assert exc.value.code == "too_many_programs" and exc.value.retry_after == 1.0
    assert "max_programs: 2" in str(exc.value)
    assert _keys(t, "acme") == ["acme/a1", "acme/a2"] and len(t) == 3 and t.take_evictions() == {}
    t.request_started("acme/a1", 5.0)  # a known program's request is never refused
    t.request_finished("acme/a2", 10, 6.0, completed=True)  # a2 idle again: a3 replaces it
    t.request_started(program_key("acme", "a3"), 7.0, tenant="acme")
    assert _keys(t, "acme") == ["acme/a1", "acme/a3"]
    for i in range(1, 5):
        _idle_program(t, "zeta", f"z{i}", 10.0 + i)
    assert _keys(t, "zeta") == ["zeta/z2", "zeta/z3", "zeta/z4"]
    for i in range(6):
        _idle_program(t, "globex", f"g{i}", 20.0 + i)
    assert len(_keys(t, "globex")) == 6 and t.take_evictions() == {"acme": 1, "zeta": 2}
    t.request_started("anon-1", 30.0)  # programs of no tenant (keys off) have no cap


def test_a_program_cap_counts_the_tenants_busy_programs_at_the_other_frontends() -> None:
    """Shared over NATS (``peer_programs``: the other frontends' reports): acme (cap 3) with 2 busy
    programs elsewhere has room for one here; past it its idle programs here are evicted, as many as it
    takes, and with none left to evict a new one is refused, naming both counts."""
    t = ProgramTable(idle_ttl_s=600.0, tenant_caps=({"acme": 3}, None))
    elsewhere = {"acme": 2}
    t.peer_programs = lambda tenant, now: elsewhere.get(tenant, 0)
    _idle_program(t, "acme", "a0", 0.0)  # 0 here + 2 elsewhere: room
    assert t.busy("acme") == 0 and t.busy("globex") == 0
    _idle_program(t, "acme", "a1", 1.0)  # 1 + 2: at the cap, a0 goes
    assert _keys(t, "acme") == ["acme/a1"] and t.take_evictions() == {"acme": 1}
    t.request_started("acme/a1", 2.0)  # busy here
    assert t.busy("acme") == 1
    with pytest.raises(QueueFull) as exc:
        t.request_started(program_key("acme", "a2"), 3.0, tenant="acme")
    assert "holds 1 agent programs here and 2 at the other frontends" in str(exc.value)
    assert exc.value.code == "too_many_programs" and _keys(t, "acme") == ["acme/a1"]
    elsewhere["acme"] = 3  # the others alone fill the cap: nothing here can make room, nothing is evicted
    t.request_finished("acme/a1", 10, 4.0, completed=True)
    with pytest.raises(QueueFull):
        t.request_started(program_key("acme", "a3"), 5.0, tenant="acme")
    assert _keys(t, "acme") == ["acme/a1"] and t.take_evictions() == {}
    elsewhere["acme"] = 0  # their programs ended (or their reports stopped)
    _idle_program(t, "acme", "a4", 6.0)
    _idle_program(t, "acme", "a5", 7.0)  # 3 here, all idle
    elsewhere["acme"] = 2  # 3 + 2: three of them go to make room for a6
    t.request_started(program_key("acme", "a6"), 8.0, tenant="acme")
    assert _keys(t, "acme") == ["acme/a6"] and t.take_evictions() == {"acme": 3}
