"""The worker session machine, sans I/O: credit, claims, slots in hand, leases held, expiry."""

from __future__ import annotations

from stepd.sansio.events import AttemptSpec
from stepd.sansio.session import (
    ANSWER,
    Answer,
    ClaimReady,
    Expire,
    Offer,
    PushCancel,
    PushLease,
    Release,
    Return,
    SessionMachine,
    Subscribe,
    Unsubscribe,
)


def spec(run: str = "r_1", step: str = "a", item: int | None = None) -> AttemptSpec:
    return AttemptSpec(run_id=run, workflow="w", version=None, definition_hash="h", step_id=step,
                       body=step, item_index=item, attempt=1, delivery="at_least_once",
                       timeout_ms=None, idempotency_key=f"{run}/{step}")


def lease(lid: str, run: str = "r_1") -> dict[str, object]:
    return {"lease_id": lid, "run_id": run}


def machine(expiry: int = 1_000) -> SessionMachine:
    return SessionMachine("w_1", expiry_ms=expiry, last_active=0)


def test_push_credit_slots_and_leases() -> None:
    m = machine()
    assert m.grant(2, 1) == []  # no connection: credit means nothing
    assert m.attach(7, 2) == []
    assert m.grant(2, 3) == [Subscribe(2)]
    s = spec()
    assert m.slot(s, None, 4) == [Offer(s, None)]
    assert m.credit == 1 and not m.idle()
    assert m.offered(s, lease("l_1"), 5) == [PushLease(lease("l_1"))]
    assert m.holds("l_1")
    # A slot that moved on gives its credit back to the worker.
    s2 = spec(step="b")
    m.slot(s2, None, 6)
    assert m.offered(s2, None, 7) == [Subscribe(1)]
    assert m.credit == 1


def test_a_lease_ended_early_is_cancelled_on_the_connection() -> None:
    m = machine()
    m.attach(1, 0)
    m.grant(1, 0)
    s = spec()
    m.slot(s, None, 0)
    m.offered(s, lease("l_1"), 0)
    assert m.lease_ended("l_1", "run_terminal", 1) == [PushCancel("l_1", "run_terminal")]
    assert m.lease_ended("l_1", "run_terminal", 1) == []  # once
    m.slot(s, None, 0)
    m.offered(s, lease("l_2"), 0)
    assert m.lease_ended("l_2", None, 1) == []  # completed: nothing to cancel


def test_a_replaced_connection_keeps_the_leases_and_drops_the_credit() -> None:
    m = machine()
    m.attach(1, 0)
    m.grant(3, 0)
    s = spec()
    m.slot(s, None, 0)
    m.offered(s, lease("l_1"), 0)
    assert m.attach(2, 1) == [Unsubscribe()]
    assert m.credit == 0 and m.holds("l_1")
    assert m.detach(1, 2) == []  # the old connection's end changes nothing now
    assert m.attached == 2
    assert m.lease_ended("l_1", "fenced", 3) == [PushCancel("l_1", "fenced")]


def test_a_slot_offered_after_the_connection_left_is_released() -> None:
    m = machine()
    m.attach(1, 0)
    m.grant(1, 0)
    s = spec()
    m.slot(s, None, 0)
    assert m.detach(1, 1) == []  # the credit was used up by the slot
    assert m.offered(s, lease("l_1"), 2) == [Release("l_1")]
    assert not m.holds("l_1")
    assert m.slot(spec(step="z"), None, 3) == [Return((spec(step="z"),))]


def test_a_claim_is_answered_when_its_offers_are_done() -> None:
    m = machine()
    assert m.claim(1, 4, None, 100, 0) == [Subscribe(4, 1, None)]
    a, b = spec(step="a"), spec(step="b")
    assert m.slot(a, 1, 1) == [Offer(a, 1)]
    assert m.slot(b, 1, 1) == [Offer(b, 1)]
    assert m.offered(a, lease("l_a"), 2) == []  # b is still being offered
    assert m.offered(b, None, 2) == [ClaimReady(1)]
    assert m.answer(1) == [Unsubscribe(1), Answer(1, (lease("l_a"),))]
    assert m.claims == {} and m.answer(1) == []


def test_a_claim_whose_slots_all_moved_on_waits_on() -> None:
    m = machine()
    m.claim(1, 2, "r_9", 100, 0)
    s = spec(run="r_9")
    m.slot(s, 1, 1)
    assert m.offered(s, None, 2) == [Subscribe(2, 1, "r_9")]
    assert m.tick(50) == []
    assert m.tick(100) == [Unsubscribe(1), Answer(1, ())]


def test_an_abandoned_claim_releases_what_it_got() -> None:
    m = machine()
    m.claim(1, 2, None, 100, 0)
    s = spec()
    m.slot(s, 1, 1)
    assert m.abandon(1, 2) == [Unsubscribe(1)]
    assert m.offered(s, lease("l_1"), 3) == [Release("l_1")]
    assert m.slot(spec(step="x"), 1, 4) == [Return((spec(step="x"),))]


def test_an_idle_worker_expires_a_busy_one_does_not() -> None:
    m = machine(expiry=1_000)
    assert m.next_deadline() == 1_000
    assert m.tick(999) == []
    assert m.tick(1_000) == [Expire()]
    busy = machine(expiry=1_000)
    busy.attach(1, 0)
    assert busy.next_deadline() is None and busy.tick(5_000) == []
    holder = machine(expiry=1_000)
    holder.claim(1, 1, None, 10, 0)
    s = spec()
    holder.slot(s, 1, 1)
    holder.offered(s, lease("l_1"), 2)
    holder.answer(1)  # answered: the claim is gone, the lease held
    assert holder.tick(5_000) == []
    holder.lease_ended("l_1", None, 6_000)
    assert holder.next_deadline() == 7_000
    holder.touch(6_500)
    assert holder.tick(7_000) == [] and holder.tick(7_500) == [Expire()]
    never = machine(expiry=0)
    assert never.next_deadline() is None and never.tick(10**12) == []


def test_resubscribe_after_a_registry_restart() -> None:
    m = machine()
    m.attach(1, 0)
    m.grant(5, 0)
    m.claim(9, 3, "r_1", 100, 0)
    s = spec()
    m.slot(s, 9, 1)
    assert m.resubscribe() == [Subscribe(5), Subscribe(2, 9, "r_1")]


def test_frames_of_one_lease_wait_for_each_other_only() -> None:
    from stepd.sansio.session import FrameOrder

    order = FrameOrder()
    t1, before1 = order.arrive("l_a")
    t2, before2 = order.arrive("l_a")
    t3, before3 = order.arrive("l_b")
    _, before4 = order.arrive(None)
    assert (before1, before2, before3, before4) == (None, t1, None, None)
    order.done("l_a", t1)
    assert len(order) == 2  # l_a's last frame (t2) is still in flight
    order.done("l_a", t2)
    order.done("l_b", t3)
    assert len(order) == 0
    _, again = order.arrive("l_a")
    assert again is None


def test_a_slot_for_the_answer_uses_neither_credit_nor_a_claim() -> None:
    """`ANSWER`: the lease goes out in the worker's own `complete` (``claim_next``)."""
    m = machine()
    assert m.claim(5, 3, None, 100, 0) == [Subscribe(3, 5, None)]
    s = spec()
    assert m.slot(s, ANSWER, 1) == [Offer(s, ANSWER)]
    assert m.claims[5].pending == 0  # the waiting claim is not touched
    assert m.offered(s, lease("l_1"), 2) == []  # nothing pushed, no claim answered
    assert m.holds("l_1") and m.claims[5].leases == []
    assert m.lease_ended("l_1", None, 3) == [] and not m.holds("l_1")
    # Not on record (the commit failed): nothing to give back.
    s2 = spec(step="b")
    m.slot(s2, ANSWER, 4)
    assert m.offered(s2, None, 5) == []
    assert not m.in_hand
