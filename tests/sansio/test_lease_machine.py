"""The lease machine and the 409 precedence, without an event loop."""

from __future__ import annotations

import itertools

import pytest

from stepd.sansio.errors import IllegalTransition
from stepd.sansio.lease import (
    LEASE_TRANSITIONS,
    REASONS,
    LeaseMachine,
    LeaseRecord,
    LeaseStatus,
    Op,
    Orphaned,
    Recover,
    Revived,
    lease_mermaid,
    reject_reason,
)


def record(**kw: object) -> LeaseRecord:
    base = {"lease_id": "l1", "run_id": "r1", "step_id": "s", "item_index": None, "fence": 2, "attempt": 1,
                "worker_id": "w", "worker_name": "n", "delivery": "at_least_once"}
    base.update(kw)
    return LeaseRecord(**base)  # type: ignore[arg-type]


def machine(**kw: object) -> LeaseMachine:
    return LeaseMachine(record(**kw), ttl_ms=30_000, window_ms=5_000, now=0)


def test_expiry_orphans_then_recovers_after_the_window() -> None:
    m = machine()
    assert m.next_deadline() == 30_000
    assert m.tick(29_999) == []
    assert m.tick(30_000) == [Orphaned()]
    assert m.status is LeaseStatus.ORPHANED and m.next_deadline() == 35_000
    assert m.tick(34_999) == []
    assert m.tick(35_000) == [Recover(started=False)]
    assert m.status is LeaseStatus.FENCED and m.next_deadline() is None


def test_a_heartbeat_extends_and_a_late_one_revives() -> None:
    m = machine()
    m.touch(Op.STARTED, 10_000)
    assert m.status is LeaseStatus.STARTED and m.record.started
    m.touch(Op.HEARTBEAT, 20_000)
    assert m.next_deadline() == 50_000
    m.tick(50_000)
    assert m.touch(Op.HEARTBEAT, 52_000) == [Revived()]
    assert m.status is LeaseStatus.STARTED and m.next_deadline() == 82_000


def test_a_zero_window_recovers_at_once() -> None:
    m = LeaseMachine(record(), ttl_ms=10, window_ms=0, now=0)
    assert m.tick(10) == [Orphaned(), Recover(started=False)]


def test_orphaned_is_never_stored() -> None:
    m = machine()
    m.touch(Op.STARTED, 0)
    m.tick(30_000)
    assert m.record.to_dict()["status"] == "started"


def test_illegal_transitions_raise_and_change_nothing() -> None:
    m = machine()
    m.end(LeaseStatus.COMPLETED, 5)
    before = m.record.to_dict()
    with pytest.raises(IllegalTransition):
        m.touch(Op.HEARTBEAT, 6)
    with pytest.raises(IllegalTransition):
        m.end(LeaseStatus.FENCED, 6)
    with pytest.raises(IllegalTransition):
        machine().end(LeaseStatus.STARTED, 1)
    assert m.record.to_dict() == before


def test_rearm_gives_a_full_ttl_from_the_restart() -> None:
    m = machine()
    m.tick(30_000)
    m.rearm(1_000_000)
    assert m.status is LeaseStatus.OFFERED and m.next_deadline() == 1_030_000


@pytest.mark.parametrize(
    "status,started,delivery,terminal,fence,op,expected",
    [
        (LeaseStatus.COMPLETED, True, "at_least_once", True, 9, Op.COMPLETE, "already_applied"),
        (LeaseStatus.FAILED, False, "at_most_once", True, 9, Op.FAIL, "already_applied"),
        (LeaseStatus.FENCED, True, "at_least_once", True, 2, Op.COMPLETE, "fenced"),
        (LeaseStatus.STARTED, True, "at_least_once", True, 3, Op.HEARTBEAT, "fenced"),
        (LeaseStatus.RUN_TERMINAL, False, "at_most_once", True, 2, Op.COMPLETE, "run_terminal"),
        (LeaseStatus.OFFERED, False, "at_most_once", True, 2, Op.COMPLETE, "run_terminal"),
        (LeaseStatus.OFFERED, False, "at_most_once", False, 2, Op.COMPLETE, "not_started"),
        (LeaseStatus.OFFERED, False, "at_most_once", False, 2, Op.FAIL, "not_started"),
        (LeaseStatus.OFFERED, False, "at_most_once", False, 2, Op.HEARTBEAT, None),
        (LeaseStatus.OFFERED, False, "at_least_once", False, 2, Op.COMPLETE, None),
        (LeaseStatus.STARTED, True, "at_most_once", False, 2, Op.COMPLETE, None),
    ],
)
def test_reject_reason_follows_the_precedence(status, started, delivery, terminal, fence, op, expected) -> None:  # type: ignore[no-untyped-def]
    lease = record(status=status, started=started, delivery=delivery)
    assert reject_reason(lease, op, run_terminal=terminal, current_fence=fence) == expected


def test_the_first_applicable_reason_always_wins() -> None:
    """Every combination: the answer is the first reason (in table order) whose condition holds."""
    for status, started, delivery, terminal, newer, op in itertools.product(
        list(LeaseStatus), [False, True], ["at_least_once", "at_most_once"], [False, True], [False, True], list(Op)
    ):
        lease = record(status=status, started=started, delivery=delivery)
        holds = {
            "already_applied": status in (LeaseStatus.COMPLETED, LeaseStatus.FAILED),
            "fenced": status is LeaseStatus.FENCED or newer,
            "run_terminal": status is LeaseStatus.RUN_TERMINAL or terminal,
            "not_started": op in (Op.COMPLETE, Op.FAIL) and delivery == "at_most_once" and not started,
        }
        want = next((r for r in REASONS if holds[r]), None)
        got = reject_reason(lease, op, run_terminal=terminal, current_fence=3 if newer else 2)
        assert got == want, (status, started, delivery, terminal, newer, op)


def test_the_table_renders() -> None:
    text = lease_mermaid()
    assert "orphaned --> fenced: recover" in text
    assert all(dst is None or not dst.live or dst in (LeaseStatus.OFFERED, LeaseStatus.STARTED,
                                                       LeaseStatus.ORPHANED)
               for dst in LEASE_TRANSITIONS.values())
