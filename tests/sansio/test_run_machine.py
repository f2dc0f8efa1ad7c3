"""The run machine, without an event loop: every transition, budget and timer.

Each test drives `RunMachine` with events and explicit times, and checks the
journal, the effects and the record. No clock, no storage, no actors.
"""

from __future__ import annotations

from typing import Any

import pytest

from stepd.sansio.definition import Definition, parse_definition
from stepd.sansio.errors import Fenced, IllegalTransition, Invalid, RunTerminal
from stepd.sansio.events import (
    AttemptCompleted,
    AttemptFailed,
    AttemptLost,
    AttemptOffered,
    AttemptOrphaned,
    AttemptRevived,
    AttemptStarted,
    AttemptUnservable,
    Cancel,
    CancelChildren,
    ChildFinished,
    EndLeases,
    NotifyParent,
    RunEnded,
    Runnable,
    SignalReceived,
    StartChildren,
    Tick,
    Transition,
    Withdraw,
)
from stepd.sansio.record import RunRecord
from stepd.sansio.run import MAX_IMMEDIATE_STEPS, RunMachine, mermaid
from stepd.sansio.status import RunStatus

# --------------------------------------------------------------------------- helpers


def defn(steps: list[dict[str, Any]], **extra: Any) -> Definition:
    return parse_definition({"name": extra.pop("name", "wf"), "steps": steps, **extra})


def task(id: str, **kw: Any) -> dict[str, Any]:
    return {"id": id, "kind": "task", "body": kw.pop("body", id), **kw}


def start(d: Definition, input: Any = None, now: int = 0, **kw: Any) -> tuple[RunMachine, Transition]:
    return RunMachine.start(run_id="r_1", definition=d, input=input, now_ms=now, **kw)


def types(tr: Transition) -> list[str]:
    return [e["type"] for e in tr.journal]


def effects(tr: Transition, cls: type) -> list[Any]:
    return [e for e in tr.effects if isinstance(e, cls)]


def runnable(tr: Transition) -> list[tuple[str, int | None, int]]:
    return [(a.step_id, a.item_index, a.attempt) for e in effects(tr, Runnable) for a in e.attempts]


class Driver:
    """Plays the registry and the worker against one machine."""

    def __init__(self, machine: RunMachine) -> None:
        self.m = machine
        self.n = 0

    def offer(self, step: str, item: int | None = None, now: int = 0, worker: str = "w1") -> tuple[str, int]:
        self.n += 1
        lease = f"l{self.n}"
        tr = self.m.handle(AttemptOffered(step, item, lease, worker, "worker-1"), now)
        assert tr.lease is not None
        return lease, tr.lease["fence"]

    def run(self, step: str, output: Any = None, *, item: int | None = None, patch: dict[str, Any] | None = None,
            now: int = 0, usage: dict[str, Any] | None = None) -> Transition:
        _, fence = self.offer(step, item, now)
        self.m.handle(AttemptStarted(step, item, fence), now)
        return self.m.handle(AttemptCompleted(step, item, fence, output, patch, usage), now)

    def fail(self, step: str, cls: str, *, item: int | None = None, now: int = 0, message: str = "boom") -> Transition:
        _, fence = self.offer(step, item, now)
        self.m.handle(AttemptStarted(step, item, fence), now)
        return self.m.handle(AttemptFailed(step, item, fence, cls, message), now)


# --------------------------------------------------------------------------- sequence


def test_steps_run_in_order_and_the_result_is_the_last_output() -> None:
    d = defn([task("a"), task("b", input="${steps.a.n}"), task("c", input="n=${steps.b}")])
    m, tr = start(d, input={"x": 1})
    assert types(tr) == ["run_started", "step_scheduled"]
    assert runnable(tr) == [("a", None, 1)]
    assert m.status is RunStatus.RUNNING
    drv = Driver(m)
    tr = drv.run("a", {"n": 41})
    assert types(tr) == ["step_completed", "step_scheduled"]
    assert runnable(tr) == [("b", None, 1)]
    _, fence = drv.offer("b")
    assert m.record.frame is not None and m.record.frame.slots[0].input == 41
    m.handle(AttemptStarted("b", None, fence), 0)
    tr = m.handle(AttemptCompleted("b", None, fence, 42), 0)
    assert m.record.frame is not None and m.record.frame.slots[0].input == "n=42"
    tr = drv.run("c", "done", now=5)
    assert types(tr) == ["step_completed", "run_completed"]
    assert m.status is RunStatus.COMPLETED
    assert m.record.result == "done"
    assert m.record.steps == {"a": {"n": 41}, "b": 42, "c": "done"}
    assert m.record.transitions == 3 and m.record.cost_units == 3
    assert [e for e in tr.effects if isinstance(e, RunEnded)] == [RunEnded("r_1", "completed")]
    # sequence numbers are contiguous from 1
    assert tr.journal[-1]["seq"] == m.record.seq


def test_offer_builds_the_lease_payload() -> None:
    d = defn([task("a", input={"who": "${input.name}", "k": "${run.id}"}, timeout_ms=500)], version="v1")
    m, _ = start(d, input={"name": "ada"}, correlation={"ticket": "T-1"})
    tr = m.handle(AttemptOffered("a", None, "l_9", "w_1", "box"), 10)
    lease = tr.lease
    assert lease is not None
    assert lease["fence"] == 1 and lease["attempt"] == 1
    assert lease["input"] == {"who": "ada", "k": "r_1"}
    assert lease["version"] == "v1" and lease["definition_hash"] == d.definition_hash
    assert lease["idempotency_key"] == "r_1/a"
    assert lease["correlation"] == {"ticket": "T-1"}
    assert len(lease["trace_id"]) == 32 and len(lease["span_id"]) == 16
    assert lease["timeout_ms"] == 500 and lease["delivery"] == "at_least_once"
    assert types(tr) == ["step_offered"]
    assert tr.journal[0]["worker_id"] == "w_1" and tr.journal[0]["worker_name"] == "box"


def test_a_state_patch_merges_top_level_keys() -> None:
    d = defn([task("a"), task("b")])
    m, _ = start(d)
    drv = Driver(m)
    drv.run("a", None, patch={"x": {"deep": 1}, "y": 2})
    tr = drv.run("b", None, patch={"x": {"other": 3}})
    assert m.record.state == {"x": {"other": 3}, "y": 2}
    assert m.record.state_bytes == len(b'{"x":{"other":3},"y":2}')
    assert "state_patched" in types(tr)


def test_state_patch_must_be_an_object_and_nothing_changes() -> None:
    m, _ = start(defn([task("a")]))
    drv = Driver(m)
    _, fence = drv.offer("a")
    before = m.record.to_dict()
    with pytest.raises(Invalid) as exc:
        m.handle(AttemptCompleted("a", None, fence, 1, state_patch=[1, 2]), 0)  # type: ignore[arg-type]
    assert exc.value.field == "state_patch"
    assert m.record.to_dict() == before


# --------------------------------------------------------------------------- templates


def test_an_unresolvable_template_fails_the_run_naming_the_path() -> None:
    m, tr = start(defn([task("a", input="${input.missing.deep}")]), input={})
    assert m.status is RunStatus.FAILED
    assert m.record.error is not None
    assert m.record.error["reason"] == "template"
    assert "input.missing" in m.record.error["message"]
    assert m.record.error["step_id"] == "a"
    failed = [e for e in tr.journal if e["type"] == "step_failed"]
    assert failed and failed[0]["error_class"] == "template"
    assert runnable(tr) == []


def test_a_template_failure_reported_by_a_worker_is_not_retried() -> None:
    m, _ = start(defn([task("a")]))
    Driver(m).fail("a", "template", message="path x")
    assert m.status is RunStatus.FAILED and m.record.error["reason"] == "template"  # type: ignore[index]


# --------------------------------------------------------------------------- retries


def test_retryable_failures_back_off_exponentially_then_fail() -> None:
    d = defn([task("a", retry={"max_attempts": 3, "initial_backoff_ms": 200, "backoff_factor": 2.0})])
    m, _ = start(d)
    drv = Driver(m)
    tr = drv.fail("a", "retryable", now=1000)
    assert types(tr) == ["step_failed"]
    assert runnable(tr) == []
    assert m.next_deadline() == 1200
    assert types(m.handle(Tick(), 1199)) == []
    tr = m.handle(Tick(), 1200)
    assert types(tr) == ["timer_fired"]
    assert runnable(tr) == [("a", None, 2)]
    tr = drv.fail("a", "retryable", now=1300)
    assert m.next_deadline() == 1700  # 200 * 2
    tr = m.handle(Tick(), 1700)
    assert runnable(tr) == [("a", None, 3)]
    tr = drv.fail("a", "retryable", now=2000, message="upstream 503")
    assert m.status is RunStatus.FAILED
    assert m.record.error == {"reason": "step_failed", "step_id": "a",
                              "message": "retryable: upstream 503 (attempt 3 of 3)"}


def test_backoff_is_capped_by_max_backoff() -> None:
    d = defn([task("a", retry={"max_attempts": 10, "initial_backoff_ms": 1000, "backoff_factor": 10.0,
                               "max_backoff_ms": 5000})])
    m, _ = start(d)
    drv = Driver(m)
    drv.fail("a", "retryable", now=0)
    assert m.next_deadline() == 1000
    m.handle(Tick(), 1000)
    drv.fail("a", "retryable", now=1000)
    assert m.next_deadline() == 6000


def test_retry_on_lists_typed_classes_others_are_not_retried() -> None:
    d = defn([task("a", retry={"retry_on": ["rate_limited"], "initial_backoff_ms": 0})])
    m, _ = start(d)
    tr = Driver(m).fail("a", "rate_limited")
    assert runnable(tr) == [("a", None, 2)]  # zero backoff: queued at once
    tr = Driver(m).fail("a", "bad_input", message="no")
    assert m.status is RunStatus.FAILED
    assert m.record.error["message"] == "bad_input: no"  # type: ignore[index]


def test_fatal_is_never_retried() -> None:
    m, _ = start(defn([task("a", retry={"max_attempts": 5})]))
    Driver(m).fail("a", "fatal")
    assert m.status is RunStatus.FAILED


def test_step_timeout_fences_the_lease_and_retries() -> None:
    d = defn([task("a", timeout_ms=1000, retry={"initial_backoff_ms": 0})])
    m, _ = start(d)
    drv = Driver(m)
    lease, fence = drv.offer("a", now=0)
    m.handle(AttemptStarted("a", None, fence), 100)
    assert m.next_deadline() == 1100
    tr = m.handle(Tick(), 1100)
    assert effects(tr, EndLeases) == [EndLeases((lease,), "fenced")]
    assert runnable(tr) == [("a", None, 2)]
    with pytest.raises(Fenced):
        m.handle(AttemptCompleted("a", None, fence, "late"), 1200)


def test_at_most_once_timeout_is_not_retried() -> None:
    d = defn([task("a", timeout_ms=10, delivery="at_most_once", retry={"max_attempts": 3})])
    m, _ = start(d)
    _, fence = Driver(m).offer("a")
    m.handle(AttemptStarted("a", None, fence), 0)
    m.handle(Tick(), 10)
    assert m.status is RunStatus.FAILED


# --------------------------------------------------------------------------- leases lost


def test_lost_at_least_once_spends_an_attempt_then_fails_lease_lost() -> None:
    m, _ = start(defn([task("a", retry={"max_attempts": 2})]))
    drv = Driver(m)
    _, fence = drv.offer("a")
    m.handle(AttemptOrphaned("a", None, fence), 5)
    tr = m.handle(AttemptLost("a", None, fence, started=False), 10)
    assert types(tr) == ["step_recovered"]
    assert runnable(tr) == [("a", None, 2)]
    _, fence = drv.offer("a")
    m.handle(AttemptLost("a", None, fence, started=True), 20)
    assert m.status is RunStatus.FAILED and m.record.error["reason"] == "lease_lost"  # type: ignore[index]


def test_lost_at_most_once_started_fails_never_reruns() -> None:
    m, _ = start(defn([task("a", delivery="at_most_once", retry={"max_attempts": 5})]))
    drv = Driver(m)
    _, fence = drv.offer("a")
    m.handle(AttemptStarted("a", None, fence), 0)
    tr = m.handle(AttemptLost("a", None, fence, started=True), 10)
    assert runnable(tr) == []
    assert m.status is RunStatus.FAILED
    failed = [e for e in tr.journal if e["type"] == "step_failed"]
    assert failed[0]["error_class"] == "lost"


def test_lost_at_most_once_never_started_is_reoffered_same_attempt() -> None:
    m, _ = start(defn([task("a", delivery="at_most_once", retry={"max_attempts": 1})]))
    drv = Driver(m)
    _, fence = drv.offer("a")
    tr = m.handle(AttemptLost("a", None, fence, started=False), 10)
    assert runnable(tr) == [("a", None, 1)]
    _, fence2 = drv.offer("a")
    assert fence2 == fence + 1


def test_orphaned_and_revived_are_journaled() -> None:
    m, _ = start(defn([task("a")]))
    _, fence = Driver(m).offer("a")
    assert types(m.handle(AttemptOrphaned("a", None, fence), 1)) == ["step_orphaned"]
    assert types(m.handle(AttemptRevived("a", None, fence), 2)) == ["step_revived"]


def test_unservable_requeues_without_spending_an_attempt_and_excludes_the_worker() -> None:
    m, _ = start(defn([task("a", retry={"max_attempts": 1})]))
    drv = Driver(m)
    _, fence = drv.offer("a", worker="w_old")
    tr = m.handle(AttemptUnservable("a", None, fence, "w_old", "no such body"), 0)
    assert types(tr) == ["step_unservable"]
    (spec,) = [a for e in effects(tr, Runnable) for a in e.attempts]
    assert spec.attempt == 1 and spec.excluded_workers == ("w_old",)
    # and through `fail` with class unservable
    _, fence = drv.offer("a", worker="w_older")
    tr = m.handle(AttemptFailed("a", None, fence, "unservable", ""), 0)
    (spec,) = [a for e in effects(tr, Runnable) for a in e.attempts]
    assert spec.attempt == 1 and spec.excluded_workers == ("w_old", "w_older")
    assert m.status is RunStatus.RUNNING


def test_a_worker_that_answered_unservable_is_never_offered_the_slot_again() -> None:
    # A session may still hold a copy of the slot from before the unservable
    # answer; the run refuses the offer, it does not trust the copy.
    m, _ = start(defn([task("a")]))
    _, fence = Driver(m).offer("a", worker="w_old")
    m.handle(AttemptUnservable("a", None, fence, "w_old", "no such body"), 0)
    before = m.record.to_dict()
    with pytest.raises(Fenced, match="unservable"):
        m.handle(AttemptOffered("a", None, "l_again", "w_old"), 1)
    assert m.record.to_dict() == before
    assert m.handle(AttemptOffered("a", None, "l_other", "w_new"), 1).lease is not None


# --------------------------------------------------------------------------- fences


def test_a_stale_fence_is_rejected_and_changes_nothing() -> None:
    m, _ = start(defn([task("a", retry={"initial_backoff_ms": 0})]))
    drv = Driver(m)
    _, old = drv.offer("a")
    m.handle(AttemptLost("a", None, old, started=False), 1)
    _, new = drv.offer("a")
    assert new == old + 1
    before = m.record.to_dict()
    for ev in (AttemptStarted("a", None, old), AttemptCompleted("a", None, old, 1),
               AttemptFailed("a", None, old, "fatal"), AttemptLost("a", None, old, True)):
        with pytest.raises(Fenced):
            m.handle(ev, 2)
    assert m.record.to_dict() == before


def test_an_attempt_event_for_another_step_is_fenced() -> None:
    m, _ = start(defn([task("a"), {"id": "w", "kind": "wait", "event": "go"}]))
    drv = Driver(m)
    _, fence = drv.offer("a")
    m.handle(AttemptCompleted("a", None, fence, 1), 0)
    assert m.status is RunStatus.WAITING
    with pytest.raises(Fenced):
        m.handle(AttemptCompleted("a", None, fence, 1), 0)


def test_fences_keep_growing_across_loop_visits() -> None:
    d = defn([task("a")], budgets={"max_transitions": 5})
    m, _ = start(d)
    drv = Driver(m)
    fences = []
    for _ in range(3):
        _, fence = drv.offer("a")
        fences.append(fence)
        m.handle(AttemptCompleted("a", None, fence, {"_next_step": "a"}), 0)
    assert fences == [1, 2, 3]
    assert m.record.visits["a"] == 4


def test_events_not_in_the_table_raise_illegal_transition_and_change_nothing() -> None:
    m, _ = start(defn([task("a")]))
    before = m.record.to_dict()
    with pytest.raises(IllegalTransition):
        m.handle("not an event", 0)  # type: ignore[arg-type]
    assert m.record.to_dict() == before


def test_attempt_events_on_a_terminal_run_are_run_terminal() -> None:
    m, _ = start(defn([task("a")]))
    _, fence = Driver(m).offer("a")
    m.handle(Cancel(), 0)
    before = m.record.to_dict()
    for ev in (AttemptCompleted("a", None, fence, 1), AttemptStarted("a", None, fence),
               SignalReceived("x"), Cancel()):
        with pytest.raises(RunTerminal):
            m.handle(ev, 1)
    assert m.record.to_dict() == before
    assert types(m.handle(Tick(), 10_000)) == []


# --------------------------------------------------------------------------- jumps


def test_next_step_jumps_and_end() -> None:
    d = defn([task("a"), task("b"), task("c")])
    m, _ = start(d)
    drv = Driver(m)
    tr = drv.run("a", {"_next_step": "c"})
    assert runnable(tr) == [("c", None, 1)]
    tr = drv.run("c", {"_next_step": "$end", "v": 1})
    assert m.status is RunStatus.COMPLETED
    assert m.record.result == {"_next_step": "$end", "v": 1}
    assert "b" not in m.record.steps


def test_static_next_step_and_dynamic_override() -> None:
    d = defn([task("a", _next_step="c"), task("b"), task("c", _next_step="$end"), task("d")])
    m, _ = start(d)
    drv = Driver(m)
    tr = drv.run("a", 1)
    assert runnable(tr) == [("c", None, 1)]
    drv.run("c", {"_next_step": "b"})
    assert runnable(drv.run("b", 2)) == [("c", None, 1)]
    drv.run("c", 3)
    assert m.status is RunStatus.COMPLETED and m.record.result == 3


@pytest.mark.parametrize("target", ["nowhere", 5, None, "", ["a"]])
def test_a_bad_jump_refuses_the_completion_and_changes_nothing(target: object) -> None:
    """Unknown step or not a string: one rule, Invalid naming output._next_step."""
    m, _ = start(defn([task("a")]))
    before = m.record.to_dict()
    with pytest.raises(Invalid) as info:
        Driver(m).run("a", {"_next_step": target})
    assert info.value.field == "output._next_step"
    assert m.status is RunStatus.RUNNING
    after = m.record.to_dict()
    after.pop("updated_at", None), before.pop("updated_at", None)
    # `run` offers and starts the attempt; the refused completion adds nothing after that.
    assert after["input_tokens"] == before["input_tokens"] and after["steps"] == {}


def test_a_loop_is_bounded_by_max_transitions() -> None:
    d = defn([task("a"), task("b")], budgets={"max_transitions": 5})
    m, _ = start(d)
    drv = Driver(m)
    step = "a"
    for _ in range(5):
        drv.run(step, {"_next_step": "b" if step == "a" else "a"})
        step = "b" if step == "a" else "a"
        assert m.status is RunStatus.RUNNING
    tr = drv.run(step, {"_next_step": "a"})
    assert m.status is RunStatus.FAILED
    assert m.record.error == {"reason": "budget_exceeded", "budget": "max_transitions", "step_id": step,
                              "message": "max_transitions exceeded: 6 > 5"}
    assert types(tr) == ["step_completed", "budget_exceeded", "run_failed"]
    assert m.record.transitions == 5


def test_a_loop_of_steps_that_never_wait_is_stopped() -> None:
    d = defn([{"id": "fan", "kind": "for_each", "items": [], "body": "x", "_next_step": "fan"}])
    m, _tr = start(d)
    assert m.status is RunStatus.FAILED
    assert str(MAX_IMMEDIATE_STEPS) in m.record.error["message"]  # type: ignore[index]


# --------------------------------------------------------------------------- budgets


def test_max_cost_units_counts_completed_steps_cost() -> None:
    d = defn([task("a", cost_units=3), task("free", cost_units=0), task("b", cost_units=3)],
             budgets={"max_cost_units": 5})
    m, _ = start(d)
    drv = Driver(m)
    drv.run("a", 1)
    drv.run("free", 1)
    assert m.record.cost_units == 3
    tr = drv.run("b", 1, patch={"ignored": True})
    assert m.status is RunStatus.FAILED
    assert m.record.error["budget"] == "max_cost_units"  # type: ignore[index]
    assert m.record.state == {} and m.record.cost_units == 3  # the breaching completion applies nothing
    assert next(e for e in tr.journal if e["type"] == "budget_exceeded")["value"] == 6


def test_max_state_bytes_is_checked_on_each_state_change() -> None:
    d = defn([task("a"), task("b")], budgets={"max_state_bytes": 20})
    m, _ = start(d)
    drv = Driver(m)
    drv.run("a", 1, patch={"k": "12345"})  # {"k":"12345"} = 13 bytes
    assert m.record.state_bytes == 13
    drv.run("b", 1, patch={"k": "1234567890123"})  # 21 bytes
    assert m.status is RunStatus.FAILED
    assert m.record.error["budget"] == "max_state_bytes"  # type: ignore[index]
    assert m.record.state == {"k": "12345"}


def test_a_breach_fails_the_run_without_retry_and_ends_live_leases() -> None:
    d = defn([{"id": "f", "kind": "for_each", "items": "${input}", "body": "b", "cost_units": 1}],
             budgets={"max_cost_units": 1})
    m, _ = start(d, input=[1, 2])
    drv = Driver(m)
    _l1, f1 = drv.offer("f", 0)
    _l2, f2 = drv.offer("f", 1)
    m.handle(AttemptCompleted("f", 0, f1, "x"), 0)
    tr = m.handle(AttemptCompleted("f", 1, f2, "y"), 0)
    assert m.status is RunStatus.FAILED
    assert m.record.error["budget"] == "max_cost_units"  # type: ignore[index]
    assert runnable(tr) == []


# --------------------------------------------------------------------------- for_each


def test_for_each_collects_outputs_in_item_order_despite_out_of_order_completion() -> None:
    d = defn([{"id": "fan", "kind": "for_each", "items": "${input.xs}", "body": "sq", "into": "squares",
               "max_parallel": 2}, task("after", input="${state.squares}")])
    m, tr = start(d, input={"xs": [1, 2, 3, 4]})
    assert runnable(tr) == [("fan", 0, 1), ("fan", 1, 1)]
    specs = [a for e in effects(tr, Runnable) for a in e.attempts]
    assert [s.idempotency_key for s in specs] == ["r_1/fan/0", "r_1/fan/1"]
    drv = Driver(m)
    _, f0 = drv.offer("fan", 0)
    _, f1 = drv.offer("fan", 1)
    tr = m.handle(AttemptCompleted("fan", 1, f1, 4), 0)  # item 1 first
    assert runnable(tr) == [("fan", 2, 1)]  # one slot freed: the next item
    _, f2 = drv.offer("fan", 2)
    tr = m.handle(AttemptCompleted("fan", 2, f2, 9), 0)
    assert runnable(tr) == [("fan", 3, 1)]
    _, f3 = drv.offer("fan", 3)
    m.handle(AttemptCompleted("fan", 3, f3, 16), 0)
    assert m.status is RunStatus.RUNNING
    tr = m.handle(AttemptCompleted("fan", 0, f0, 1), 0)
    assert m.record.steps["fan"] == [1, 4, 9, 16]
    assert m.record.state["squares"] == [1, 4, 9, 16]
    assert runnable(tr) == [("after", None, 1)]
    assert m.record.frame is not None and m.record.frame.slots[0].input == [1, 4, 9, 16]
    assert m.record.transitions == 1  # a for_each counts once
    assert m.record.cost_units == 4  # cost per item


def test_for_each_item_inputs_render_item_and_index() -> None:
    d = defn([{"id": "fan", "kind": "for_each", "items": ["a", "b"], "body": "x",
               "input": {"v": "${item}", "i": "${item_index}", "s": "${item}-${item_index}"}}])
    m, _tr = start(d)
    assert m.record.frame is not None
    assert [s.input for s in m.record.frame.slots] == [{"v": "a", "i": 0, "s": "a-0"},
                                                      {"v": "b", "i": 1, "s": "b-1"}]


def test_for_each_over_budget_schedules_nothing() -> None:
    d = defn([task("a"), {"id": "fan", "kind": "for_each", "items": "${steps.a}", "body": "x"}],
             budgets={"max_for_each_items": 3})
    m, _ = start(d)
    tr = Driver(m).run("a", [1, 2, 3, 4])
    assert runnable(tr) == []
    assert m.status is RunStatus.FAILED
    assert m.record.error["budget"] == "max_for_each_items"  # type: ignore[index]


def test_for_each_with_no_items_completes_with_an_empty_list() -> None:
    d = defn([{"id": "fan", "kind": "for_each", "items": [], "body": "x", "into": "out"}])
    m, _ = start(d)
    assert m.status is RunStatus.COMPLETED and m.record.result == [] and m.record.state == {"out": []}


def test_for_each_items_that_are_not_a_list_fail_with_template() -> None:
    m, _ = start(defn([{"id": "fan", "kind": "for_each", "items": "${input}", "body": "x"}]), input=5)
    assert m.status is RunStatus.FAILED and m.record.error["reason"] == "template"  # type: ignore[index]


def test_for_each_item_failure_retries_that_item_only() -> None:
    d = defn([{"id": "fan", "kind": "for_each", "items": [1, 2], "body": "x",
               "retry": {"initial_backoff_ms": 10}}])
    m, _ = start(d)
    drv = Driver(m)
    drv.fail("fan", "retryable", item=1, now=0)
    tr = m.handle(Tick(), 10)
    assert runnable(tr) == [("fan", 1, 2)]


# --------------------------------------------------------------------------- waits and signals


def test_wait_consumes_a_late_signal_into_state() -> None:
    d = defn([{"id": "approval", "kind": "wait", "event": "approved", "into": "approval"}, task("send")])
    m, tr = start(d)
    assert m.status is RunStatus.WAITING
    assert m.status_view()["waiting_for"] == "approved"
    tr = m.handle(SignalReceived("other", 1), 5)
    assert m.status is RunStatus.WAITING and types(tr) == ["signal_received"]
    tr = m.handle(SignalReceived("approved", {"by": "ann"}), 6)
    assert m.record.state == {"approval": {"by": "ann"}}
    assert m.record.steps["approval"] == {"by": "ann"}
    assert runnable(tr) == [("send", None, 1)]
    assert m.record.signals == [{"name": "other", "payload": 1, "at": 5, "bytes": 1}]


def test_early_signals_are_buffered_in_order_and_the_oldest_is_consumed() -> None:
    d = defn([task("a"), {"id": "w1", "kind": "wait", "event": "go"}, {"id": "w2", "kind": "wait", "event": "go"},
              {"id": "w3", "kind": "wait", "event": "go"}])
    m, _ = start(d)
    m.handle(SignalReceived("go", 1), 1)
    m.handle(SignalReceived("go", 2), 2)
    assert len(m.record.signals) == 2
    tr = Driver(m).run("a", None)
    assert m.record.steps["w1"] == 1 and m.record.steps["w2"] == 2
    assert m.status is RunStatus.WAITING and m.record.frame.step_id == "w3"  # type: ignore[union-attr]
    consumed = [e for e in tr.journal if e["type"] == "step_completed" and "signal" in e]
    assert [(e["step_id"], e["received_at"]) for e in consumed] == [("w1", 1), ("w2", 2)]
    m.handle(SignalReceived("go", 3), 3)
    assert m.status is RunStatus.COMPLETED and m.record.result == 3


def test_wait_timeout_fails_the_run() -> None:
    m, _ = start(defn([{"id": "w", "kind": "wait", "event": "go", "timeout_ms": 1000}]), now=100)
    assert m.next_deadline() == 1100
    assert types(m.handle(Tick(), 1099)) == []
    tr = m.handle(Tick(), 1100)
    assert m.status is RunStatus.FAILED and m.record.error["reason"] == "wait_timeout"  # type: ignore[index]
    assert types(tr) == ["timer_fired", "run_failed"]


def test_a_signal_over_budget_is_refused_and_nothing_is_recorded() -> None:
    d = defn([{"id": "w", "kind": "wait", "event": "go", "into": "payload"}], budgets={"max_state_bytes": 30})
    m, _ = start(d)
    before = m.record.to_dict()
    tr = m.handle(SignalReceived("go", "x" * 100), 5)
    assert tr.refused == ("budget_exceeded", "max_state_bytes")
    assert types(tr) == ["signal_rejected"]
    assert m.status is RunStatus.WAITING
    after = m.record.to_dict()
    assert after["seq"] == before["seq"] + 1  # the rejection itself is journaled
    after["seq"], after["updated_at"] = before["seq"], before["updated_at"]
    assert after == before  # and nothing else moved
    tr = m.handle(SignalReceived("go", "ok"), 6)
    assert tr.refused is None and m.status is RunStatus.COMPLETED


def test_a_signal_whose_transition_breaches_max_transitions_is_refused() -> None:
    d = defn([task("a"), {"id": "w", "kind": "wait", "event": "go"}], budgets={"max_transitions": 1})
    m, _ = start(d)
    Driver(m).run("a", 1)
    tr = m.handle(SignalReceived("go", 1), 1)
    assert tr.refused == ("budget_exceeded", "max_transitions")
    assert m.status is RunStatus.WAITING


def test_a_signal_with_no_name_is_invalid() -> None:
    m, _ = start(defn([{"id": "w", "kind": "wait", "event": "go"}]))
    with pytest.raises(Invalid):
        m.handle(SignalReceived("", 1), 0)


# --------------------------------------------------------------------------- sleep and deadline


def test_sleep_is_a_timer() -> None:
    m, _ = start(defn([{"id": "nap", "kind": "sleep", "duration_ms": 60_000}, task("a")]), now=1_000)
    assert m.status is RunStatus.SLEEPING and m.next_deadline() == 61_000
    assert m.idle()
    tr = m.handle(Tick(), 61_000)
    assert runnable(tr) == [("a", None, 1)]
    assert m.record.transitions == 1


def test_the_run_deadline_times_the_run_out_and_ends_live_leases() -> None:
    m, _ = start(defn([task("a")], deadline_ms=5000), now=0)
    lease, _ = Driver(m).offer("a")
    assert m.next_deadline() == 5000
    tr = m.handle(Tick(), 5000)
    assert m.status is RunStatus.TIMED_OUT and m.record.error["reason"] == "deadline"  # type: ignore[index]
    assert effects(tr, EndLeases) == [EndLeases((lease,), "run_terminal")]
    assert types(tr) == ["timer_fired", "run_timed_out"]


def test_a_start_request_deadline_overrides_the_definition() -> None:
    m, _ = start(defn([task("a")], deadline_ms=5000), deadline_ms=100, now=10)
    assert m.next_deadline() == 110
    with pytest.raises(Invalid) as exc:
        start(defn([task("a")]), deadline_ms=-1)
    assert exc.value.field == "deadline_ms"


# --------------------------------------------------------------------------- cancel


def test_cancel_ends_leases_withdraws_queued_slots_and_refuses_later_calls() -> None:
    d = defn([{"id": "fan", "kind": "for_each", "items": [1, 2], "body": "x"}])
    m, _ = start(d)
    lease, _ = Driver(m).offer("fan", 0)
    tr = m.handle(Cancel("stop"), 7)
    assert m.status is RunStatus.CANCELLED
    assert m.record.error == {"reason": "cancelled", "message": "stop", "step_id": "fan"}
    assert effects(tr, EndLeases) == [EndLeases((lease,), "run_terminal")]
    assert effects(tr, Withdraw) == [Withdraw("r_1", (("fan", 1),))]
    assert types(tr) == ["run_cancelled"]
    with pytest.raises(RunTerminal):
        m.handle(SignalReceived("x"), 8)


# --------------------------------------------------------------------------- children


def _resolver(defs: dict[str, Definition]) -> Any:
    return lambda name, version: defs.get(name)


def test_start_workflows_starts_children_and_collects_results_in_order() -> None:
    child = defn([task("c")], name="child", version="c1")
    d = defn([{"id": "kids", "kind": "start_workflows", "workflow": "child", "items": "${input}",
               "into": "results"}, task("after")], budgets={"max_started_workflows": 3})
    m, tr = start(d, input=[10, 20, 30], resolve=_resolver({"child": child}))
    (sc,) = effects(tr, StartChildren)
    assert [c.input for c in sc.children] == [10, 20, 30]
    ids = [c.run_id for c in sc.children]
    assert ids == ["r_1.kids.0", "r_1.kids.1", "r_1.kids.2"]
    assert sc.definition is child
    assert types(tr).count("child_started") == 3
    assert m.record.started_workflows == 3 and m.idle()
    m.handle(ChildFinished(ids[2], "completed", "c"), 1)
    m.handle(ChildFinished(ids[0], "completed", "a"), 2)
    assert types(m.handle(ChildFinished(ids[0], "completed", "a"), 2)) == []  # repeated: ignored
    tr = m.handle(ChildFinished(ids[1], "completed", "b"), 3)
    assert m.record.state["results"] == ["a", "b", "c"]
    assert runnable(tr) == [("after", None, 1)]


def test_a_failed_child_fails_the_parent_and_cancels_its_siblings() -> None:
    child = defn([task("c")], name="child")
    d = defn([{"id": "kids", "kind": "start_workflows", "workflow": "child", "items": [1, 2]}])
    m, tr = start(d, resolve=_resolver({"child": child}))
    ids = [c.run_id for c in effects(tr, StartChildren)[0].children]
    tr = m.handle(ChildFinished(ids[0], "failed", error={"message": "bad"}), 1)
    assert m.status is RunStatus.FAILED
    assert "bad" in m.record.error["message"]  # type: ignore[index]
    assert effects(tr, CancelChildren) == [CancelChildren((ids[1],))]


def test_max_started_workflows_is_checked_before_any_child_is_created() -> None:
    child = defn([task("c")], name="child")
    d = defn([{"id": "kids", "kind": "start_workflows", "workflow": "child", "items": [1, 2, 3]}],
             budgets={"max_started_workflows": 2})
    m, tr = start(d, resolve=_resolver({"child": child}))
    assert effects(tr, StartChildren) == []
    assert m.status is RunStatus.FAILED and m.record.error["budget"] == "max_started_workflows"  # type: ignore[index]
    assert m.record.started_workflows == 0


def test_start_workflows_without_wait_completes_with_the_child_ids() -> None:
    child = defn([task("c")], name="child")
    d = defn([{"id": "kids", "kind": "start_workflows", "workflow": "child", "items": [1], "wait": False}])
    m, _tr = start(d, resolve=_resolver({"child": child}))
    assert m.status is RunStatus.COMPLETED and m.record.result == ["r_1.kids.0"]


def test_an_unknown_child_workflow_fails_the_step() -> None:
    d = defn([{"id": "kids", "kind": "start_workflows", "workflow": "nope", "items": [1]}])
    m, tr = start(d, resolve=_resolver({}))
    assert effects(tr, StartChildren) == []
    assert m.status is RunStatus.FAILED and "nope" in m.record.error["message"]  # type: ignore[index]


def test_a_child_notifies_its_parent_when_it_ends() -> None:
    child = defn([task("c")], name="child")
    m, _ = RunMachine.start(run_id="r_1.kids.0", definition=child, input=1, now_ms=0,
                            parent={"run_id": "r_1", "step_id": "kids"})
    tr = Driver(m).run("c", 5)
    assert effects(tr, NotifyParent) == [NotifyParent("r_1", "r_1.kids.0")]
    assert m.status_view()["parent_run_id"] == "r_1"


# --------------------------------------------------------------------------- record and view


def test_the_record_round_trips_and_a_rebuilt_machine_continues_identically() -> None:
    d = defn([{"id": "fan", "kind": "for_each", "items": [1, 2, 3], "body": "x", "max_parallel": 2,
               "retry": {"initial_backoff_ms": 50}},
              {"id": "w", "kind": "wait", "event": "go", "timeout_ms": 100}, task("z")])
    m, _ = start(d)
    drv = Driver(m)
    drv.fail("fan", "retryable", item=0, now=1)
    _, f1 = drv.offer("fan", 1)
    m.handle(SignalReceived("early", 1), 2)
    copy = RunMachine(RunRecord.from_dict(m.record.to_dict()), d)
    assert copy.record.to_dict() == m.record.to_dict()
    for machine in (m, copy):
        machine.handle(Tick(), 51)
        machine.handle(AttemptCompleted("fan", 1, f1, "one"), 52)
    assert copy.record.to_dict() == m.record.to_dict()


def test_status_view_has_every_field_of_the_spec() -> None:
    d = defn([task("a")], version="v2", budgets={"max_transitions": 20})
    m, _ = start(d, input={"q": 1}, idempotency_key="k1", correlation={"c": 1}, now=1_700_000_000_000)
    Driver(m).run("a", {"r": 1}, patch={"s": 1}, usage={"input_tokens": 10, "output_tokens": 5, "cost_usd": 0.25},
                  now=1_700_000_000_500)
    v = m.status_view()
    assert set(v) >= {"run_id", "workflow", "status", "definition_version", "definition_hash",
                      "idempotency_key", "correlation", "input", "state", "result", "error",
                      "current_steps", "waiting_for", "budget", "usage", "created_at", "updated_at",
                      "parent_run_id"}
    assert v["status"] == "completed" and v["definition_version"] == "v2"
    assert v["budget"]["limits"]["max_transitions"] == 20
    assert v["budget"]["usage"] == {"transitions": 1, "cost_units": 1, "state_bytes": 7, "started_workflows": 0}
    assert v["usage"] == {"input_tokens": 10, "output_tokens": 5, "cost_usd": 0.25}
    assert v["created_at"] == "2023-11-14T22:13:20.000Z"
    assert v["updated_at"] == "2023-11-14T22:13:20.500Z"


def test_the_transition_table_renders_as_a_diagram() -> None:
    text = mermaid()
    assert text.startswith("stateDiagram-v2")
    assert "AttemptCompleted" in text and "waiting" in text
