"""Which frontend of a bus acts for the scaling planner (control/leadership.py): exact states and leaders."""

from __future__ import annotations

import pytest

from thunderagent.control.leadership import DEAF_LEASES, FORGET_LEASES, Leadership

LEASE = 0.5  # exact in binary: the boundary cases below compare exact sums


def lead(self_id: str = "b", started: float = 100.0, acts: bool = True) -> Leadership:
    return Leadership(self_id, started, acts, LEASE, now=0.0)


def test_a_frontend_holds_until_it_hears_its_own_beat_then_acts_alone():
    ld = lead()
    assert (ld.state(0.5), ld.acting(0.5)) == ("starting", False)  # it may not know its peers yet
    ld.heard("b", 100.0, True, now=0.5)
    assert (ld.state(0.6), ld.acting(0.6), ld.leader()) == ("alone", True, "b")
    assert ld.summary(0.6) == {"id": "b", "state": "alone", "acting": True, "leader": "b", "frontends": ["b"]}


def test_the_oldest_frontend_that_can_act_leads_and_a_younger_one_never_takes_over():
    ld = lead("b", started=100.0)
    ld.heard("b", 100.0, True, now=1.0)
    ld.heard("a", 200.0, True, now=1.0)  # a smaller id, started later: b stays the leader
    assert (ld.state(1.1), ld.leader()) == ("leader", "b")
    ld.heard("c", 50.0, False, now=1.1)  # older, but its planner cannot act (no command / webhook)
    assert (ld.state(1.2), ld.leader(), ld.acting(1.2)) == ("leader", "b", True)
    ld.heard("d", 99.0, True, now=1.2)  # older and can act: d leads, b follows
    assert (ld.state(1.3), ld.leader(), ld.acting(1.3)) == ("follower", "d", False)
    assert ld.summary(1.3)["frontends"] == ["a", "b", "c", "d"]


def test_equal_start_times_are_broken_by_the_smaller_id():
    ld = lead("b", started=100.0)
    ld.heard("b", 100.0, True, now=1.0)
    ld.heard("a", 100.0, True, now=1.0)
    assert (ld.leader(), ld.acting(1.0)) == ("a", False)
    ld.heard("c", 100.0, True, now=1.0)
    assert ld.leader() == "a"


def test_a_silent_leader_is_replaced_one_lease_after_its_last_beat_measured_on_our_own_beats():
    ld = lead("b", started=100.0)
    ld.heard("a", 50.0, True, now=1.0)
    ld.heard("b", 100.0, True, now=1.0)
    assert ld.acting(1.0) is False
    # a stops beating; b keeps hearing its own beats
    ld.heard("b", 100.0, True, now=1.0 + LEASE)  # exactly a lease: a still counts
    assert (ld.state(1.0 + LEASE), ld.leader()) == ("follower", "a")
    ld.heard("b", 100.0, True, now=1.0 + LEASE + 0.01)
    assert (ld.state(1.6), ld.leader(), ld.acting(1.6)) == ("alone", "b", True)


def test_a_stalled_loop_does_not_declare_its_peers_gone_and_holds():
    ld = lead("b", started=100.0)
    ld.heard("a", 50.0, True, now=1.0)
    ld.heard("b", 100.0, True, now=1.0)
    # our loop stalls for 2 s: nothing was read, a's beats wait unread. We are unsure, not leader.
    assert (ld.state(3.0), ld.acting(3.0), ld.leader()) == ("unsure", False, "a")
    ld.heard("a", 50.0, True, now=3.0)  # the backlog is read: a was alive all along
    ld.heard("b", 100.0, True, now=3.0)
    assert (ld.state(3.0), ld.leader()) == ("follower", "a")


def test_a_frontend_that_never_hears_its_own_beat_acts_alone_and_says_so():
    ld = lead("b")
    ld.heard("a", 50.0, True, now=0.1)  # (an outside beat can arrive; its own never does)
    t = DEAF_LEASES * LEASE
    assert ld.state(t) == "starting"
    assert (ld.state(t + 0.01), ld.acting(t + 0.01)) == ("deaf", True)
    assert ld.summary(t + 0.01)["leader"] is None
    ld.heard("a", 50.0, True, now=5.0)
    ld.heard("b", 100.0, True, now=5.0)  # heard at last: it knows its peers
    assert (ld.state(5.0), ld.acting(5.0)) == ("follower", False)
    # heard once, then silent (a stalled loop, the bus down): it holds however long that lasts
    assert (ld.state(500.0), ld.acting(500.0)) == ("unsure", False)


def test_a_frontend_whose_planner_cannot_act_never_acts_but_reports_the_leader():
    ld = lead("b", acts=False)
    ld.heard("b", 100.0, False, now=1.0)
    assert (ld.state(1.0), ld.acting(1.0), ld.leader()) == ("alone", False, None)
    ld.heard("a", 200.0, True, now=1.0)
    assert (ld.state(1.0), ld.acting(1.0), ld.leader()) == ("follower", False, "a")


def test_long_gone_peers_are_forgotten():
    ld = lead("b")
    ld.heard("a", 50.0, True, now=1.0)
    ld.heard("b", 100.0, True, now=1.0 + FORGET_LEASES * LEASE + 0.01)
    assert ld.live_peers() == [] and ld.summary(1.0 + FORGET_LEASES * LEASE + 0.01)["frontends"] == ["b"]
    assert "a" not in ld._peers  # noqa: SLF001 - the table is bounded


def test_a_lease_must_be_positive():
    with pytest.raises(ValueError, match="lease_s"):
        Leadership("b", 1.0, True, 0.0, now=0.0)


def test_one_frontend_running_cache_migration_plans_the_copies_apart_from_the_planners_leader():
    """``Leadership.copying``: the oldest live frontend that runs cache migration plans its copies (two migrators
    would copy the same hot prefix twice), whoever acts for the planner; one that does not run it never plans;
    starting or unsure, it holds; when the copier goes silent the next oldest takes over a lease later."""
    ld = Leadership("b", 100.0, False, LEASE, now=0.0, copies=True)
    assert not ld.copying(0.1)  # starting: it may not know its peers yet
    ld.heard("b", 100.0, False, now=0.5, copies=True)
    assert ld.copying(0.6) and ld.copier() == "b"  # alone
    ld.heard("a", 50.0, True, now=0.6)  # older, acts for the planner, runs no migration
    assert (ld.leader(), ld.copier(), ld.copying(0.7)) == ("a", "b", True)
    ld.heard("c", 80.0, False, now=0.7, copies=True)  # older and runs it: c plans, b holds
    assert (ld.copier(), ld.copying(0.8), ld.state(0.8)) == ("c", False, "follower")
    ld.heard("b", 100.0, False, now=0.7 + LEASE + 0.01, copies=True)  # c silent past a lease: b again
    assert ld.copier() == "b" and ld.copying(0.7 + LEASE + 0.02)
    assert not ld.copying(0.7 + 3 * LEASE)  # its own beat late: unsure, it holds
    off = Leadership("d", 10.0, True, LEASE, now=0.0)  # runs no migration: never plans
    off.heard("d", 10.0, True, now=0.5)
    assert not off.copying(0.6) and off.copier() is None
