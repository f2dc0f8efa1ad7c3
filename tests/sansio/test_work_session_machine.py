"""The worker-session machines, pure (no loop, no clock read): `WorkSessionMachine` and the
run machine's session layer (`_run_sessions`). AFFINITY.md "Worker sessions"."""

from __future__ import annotations

import pytest

from stepd.sansio.definition import parse_definition
from stepd.sansio.errors import Fenced, IllegalTransition
from stepd.sansio.events import AttemptCompleted, AttemptOffered, Runnable, SessionChanged
from stepd.sansio.record import RunRecord
from stepd.sansio.run import RunMachine
from stepd.sansio.session_spec import Reacquire, work_session_id
from stepd.sansio.work_session import (
    TRANSITIONS,
    Acquired,
    Close,
    FreeSlot,
    NotifyRun,
    Released,
    Renew,
    Tick,
    WorkSessionMachine,
    WorkSessionRecord,
    WorkSessionStatus,
)

LEASE, TTL = 1_000, 10_000


def machine(reacquire: Reacquire = Reacquire.SAME_REQUIREMENTS) -> WorkSessionMachine:
    return WorkSessionMachine.create("ws_r_1.gpu", "r_1", "gpu", lease_ms=LEASE, ttl_ms=TTL,
                                     max_concurrent=1, reacquire=reacquire, now=0)


def test_renew_extends_the_holder_never_the_ttl() -> None:
    m = machine()
    assert m.handle(Acquired("w_a"), 0) == [NotifyRun("acquired", "w_a", 1)]
    for now in range(500, TTL, 500):  # renewed every half lease, up to the TTL
        m.handle(Renew("w_a"), now)
        assert m.record.expires_at == TTL
        assert m.record.lease_until is not None and m.record.lease_until <= TTL
        assert m.next_deadline() == min(now + LEASE, TTL)
        assert m.handle(Tick(), now) == [] and m.status is WorkSessionStatus.HELD
    effects = m.handle(Tick(), TTL)
    assert m.status is WorkSessionStatus.EXPIRED
    assert effects == [FreeSlot("w_a"), NotifyRun("expired", None, 1)]
    assert m.next_deadline() is None


def test_a_lost_holder_is_replaced_keeping_the_ttl() -> None:
    m = machine()
    m.handle(Acquired("w_a"), 100)
    assert m.handle(Tick(), 100 + LEASE - 1) == []  # its authority still runs
    effects = m.handle(Tick(), 100 + LEASE)
    assert effects == [FreeSlot("w_a"), NotifyRun("lost", "w_a", 1, reacquire=True)]
    assert m.status is WorkSessionStatus.PENDING and m.record.lost_holders == ["w_a"]
    with pytest.raises(Fenced):
        m.handle(Renew("w_a"), 1_200)  # the lost holder comes back: fenced
    m.handle(Acquired("w_b"), 2_000)
    assert (m.record.holder, m.record.generation, m.record.expires_at) == ("w_b", 2, TTL)


def test_reacquire_never_ends_the_session_lost() -> None:
    m = machine(Reacquire.NEVER)
    m.handle(Acquired("w_a"), 0)
    assert m.handle(Released("w_a"), 10) == [FreeSlot("w_a"),
                                             NotifyRun("lost", "w_a", 1, reacquire=False)]
    assert m.status is WorkSessionStatus.LOST and m.record.ended == "holder_lost"


def test_illegal_or_refused_events_change_nothing() -> None:
    m = machine()
    before = m.record.to_dict()
    m.handle(Acquired("w_a"), 0)
    held = m.record.to_dict()
    with pytest.raises(IllegalTransition):
        m.handle(Acquired("w_b"), 0)  # held already
    assert held != before
    with pytest.raises(Fenced):
        m.handle(Renew("w_b"), 5)
    with pytest.raises(Fenced):
        m.handle(Released("w_b"), 5)
    assert m.record.to_dict() == held
    m.handle(Close(), 6)
    closed = m.record.to_dict()
    for event in (Tick(), Close()):
        assert m.handle(event, 7) == []
    with pytest.raises(Fenced):
        m.handle(Renew("w_a"), 8)
    assert m.record.to_dict() == closed
    assert WorkSessionRecord.from_dict(closed).to_dict() == closed
    declared = {status for status, _ in TRANSITIONS}
    assert declared == set(WorkSessionStatus)


DEF = parse_definition({
    "name": "g",
    "sessions": {"gpu": {"requirements": {"gpu": "a100"}, "max_concurrent": 2}},
    "steps": [{"id": "a", "kind": "task", "body": "a", "session": "gpu"},
              {"id": "fan", "kind": "for_each", "items": [1, 2, 3, 4], "body": "f",
               "session": "gpu"}],
})


def test_the_run_pins_session_steps_to_the_holder_and_fences_anyone_else() -> None:
    m, tr = RunMachine.start(run_id="r_1", definition=DEF, input={}, now_ms=0)
    sid = work_session_id("r_1", "gpu")
    (spec,) = [s for fx in tr.effects if isinstance(fx, Runnable) for s in fx.attempts]
    assert (spec.session, spec.pinned) == (sid, None)  # no holder yet: it waits
    with pytest.raises(Fenced):
        m.handle(AttemptOffered("a", None, "l_1", "w_a"), 1)
    tr = m.handle(SessionChanged("gpu", sid, "acquired", "w_a", 1), 2)
    (spec,) = [s for fx in tr.effects if isinstance(fx, Runnable) for s in fx.attempts]
    assert spec.pinned == "w_a"
    assert m.handle(SessionChanged("gpu", sid, "acquired", "w_a", 1), 3).effects == []
    with pytest.raises(Fenced):
        m.handle(AttemptOffered("a", None, "l_1", "w_b"), 4)
    tr = m.handle(AttemptOffered("a", None, "l_1", "w_a"), 5)
    assert tr.lease is not None and tr.lease["session"] == {
        "session_id": sid, "name": "gpu", "generation": 1, "lease_ms": 30_000}
    assert RunRecord.from_dict(m.record.to_dict()).sessions == m.record.sessions


def test_a_session_for_each_slots_at_most_max_concurrent() -> None:
    m, _ = RunMachine.start(run_id="r_1", definition=DEF, input={}, now_ms=0)
    sid = work_session_id("r_1", "gpu")
    m.handle(SessionChanged("gpu", sid, "acquired", "w_a", 1), 1)
    m.handle(AttemptOffered("a", None, "l_1", "w_a"), 2)
    tr = m.handle(AttemptCompleted("a", None, 1, output={}), 3)
    specs = [s for fx in tr.effects if isinstance(fx, Runnable) for s in fx.attempts]
    assert [s.item_index for s in specs] == [0, 1]  # 4 items, max_concurrent 2
    assert all(s.pinned == "w_a" for s in specs)


def test_never_fails_the_run_and_expiry_fails_it_only_when_needed() -> None:
    sid = work_session_id("r_1", "gpu")
    m, _ = RunMachine.start(run_id="r_1", definition=DEF, input={}, now_ms=0)
    m.handle(SessionChanged("gpu", sid, "acquired", "w_a", 1), 1)
    m.handle(SessionChanged("gpu", sid, "lost", "w_a", 1, reacquire=False), 2)
    assert m.record.error is not None and m.record.error["reason"] == "session_lost"
    m, _ = RunMachine.start(run_id="r_1", definition=DEF, input={}, now_ms=0)
    m.handle(SessionChanged("gpu", sid, "expired", None, 0), 1)
    assert m.record.error is not None and m.record.error["reason"] == "session_expired"


def test_a_definition_without_sessions_keeps_its_wire_form() -> None:
    plain = parse_definition({"name": "p", "steps": [{"id": "a", "kind": "task", "body": "a"}]})
    assert "sessions" not in plain.to_json()
    assert "session" not in plain.to_json()["steps"][0]
