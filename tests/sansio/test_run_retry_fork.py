"""Retry and fork in the run machine, without an event loop.

Retry: a failed run enters its failed step again (a new visit, attempt 1),
budgets and the deadline still apply, and anything but a failed run is
refused with nothing changed. Fork: a new run from the record a run had right
after a completed step, folded from the journal (`stepd.sansio.history`):
checked against snapshots of the source's record taken while it ran.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from stepd.sansio.errors import Invalid, NotRetryable, Unprocessable
from stepd.sansio.events import (
    AttemptCompleted,
    AttemptStarted,
    Cancel,
    Retry,
    SignalReceived,
    Tick,
)
from stepd.sansio.record import RunRecord
from stepd.sansio.run import RunMachine
from stepd.sansio.status import RunStatus

from .test_run_machine import Driver, defn, runnable, start, task, types


def fork(m: RunMachine, journal: list[dict[str, Any]], step: str, now: int = 10_000,
         **kw: Any) -> tuple[RunMachine, Any]:
    return RunMachine.fork(source=m.record, journal=journal, definition=m.definition,
                           from_step=step, run_id="r_fork", now_ms=now, **kw)


class Recorder(Driver):
    """A driver that keeps the whole journal and snapshots the record after each step."""

    def __init__(self, machine: RunMachine, first: list[dict[str, Any]]) -> None:
        super().__init__(self)  # type: ignore[arg-type]  # Driver's calls come through `handle`
        self.machine = machine
        self.journal = list(first)
        self.after: dict[str, dict[str, Any]] = {}

    def handle(self, event: Any, now: int = 0) -> Any:
        tr = self.machine.handle(event, now)
        self.journal.extend(tr.journal)
        for j, e in enumerate(tr.journal):
            if e["type"] == "step_completed" and e.get("item_index") is None:
                patched = j + 1 < len(tr.journal) and tr.journal[j + 1]["type"] == "state_patched"
                r = self.machine.record
                self.after[e["step_id"]] = {
                    "state": copy.deepcopy(r.state), "steps": copy.deepcopy(r.steps),
                    "transitions": r.transitions, "cost_units": r.cost_units,
                    "input_tokens": r.input_tokens, "seq": e["seq"] + patched,
                }
        return tr


# --------------------------------------------------------------------------- retry


def test_a_failed_task_is_entered_again_with_a_fresh_retry_budget() -> None:
    d = defn([task("a"), task("b", retry={"max_attempts": 2, "initial_backoff_ms": 0,
                                          "retry_on": ["flaky"]}), task("c")])
    m, _ = start(d)
    drv = Driver(m)
    drv.run("a", {"n": 1}, patch={"seen": True})
    drv.fail("b", "flaky")
    tr = drv.fail("b", "flaky")
    assert m.status is RunStatus.FAILED and m.record.error is not None
    assert m.record.error["step_id"] == "b"
    tr = m.handle(Retry(), 100)
    assert types(tr) == ["run_retried", "step_scheduled"]
    assert tr.journal[0]["step_id"] == "b" and tr.journal[0]["error"]["reason"] == "step_failed"
    assert tr.journal[1]["visit"] == 2
    assert runnable(tr) == [("b", None, 1)]  # attempt 1: a fresh budget of 2
    assert m.status is RunStatus.RUNNING and m.record.error is None
    assert m.record.state == {"seen": True} and m.record.steps["a"] == {"n": 1}
    drv.fail("b", "flaky", now=101)
    assert m.status is RunStatus.RUNNING  # the second attempt of the new budget follows
    drv.run("b", 2, now=102)
    drv.run("c", 3, now=103)
    assert m.status is RunStatus.COMPLETED and m.record.result == 3
    # the record of a retried run survives its stored form
    assert RunRecord.from_dict(m.record.to_dict()).to_dict() == m.record.to_dict()


@pytest.mark.parametrize("how", ["running", "completed", "cancelled"])
def test_only_a_failed_run_can_be_retried_and_a_refusal_changes_nothing(how: str) -> None:
    m, _ = start(defn([task("a")]))
    if how == "completed":
        Driver(m).run("a", 1)
    elif how == "cancelled":
        m.handle(Cancel("no"), 1)
    before = m.record.to_dict()
    with pytest.raises(NotRetryable, match=f"is {how}: only a failed run") as info:
        m.handle(Retry(), 5)
    assert info.value.reason == "not_retryable" and info.value.budget is None
    assert m.record.to_dict() == before


def test_a_run_failed_on_a_budget_stays_refused_naming_the_budget() -> None:
    m, _ = start(defn([task("a", cost_units=3), task("b", cost_units=3)],
                      budgets={"max_cost_units": 5}))
    drv = Driver(m)
    drv.run("a", 1)
    drv.run("b", 2)
    assert m.status is RunStatus.FAILED and m.record.error is not None
    assert m.record.error["reason"] == "budget_exceeded"
    before = m.record.to_dict()
    with pytest.raises(NotRetryable, match="budget max_cost_units") as info:
        m.handle(Retry(), 5)
    assert info.value.budget == "max_cost_units"
    assert m.record.to_dict() == before


def test_a_run_whose_deadline_passed_is_not_retried() -> None:
    m, _ = start(defn([task("a")], deadline_ms=1000))
    Driver(m).fail("a", "fatal", now=10)
    assert m.status is RunStatus.FAILED
    with pytest.raises(NotRetryable, match="deadline passed"):
        m.handle(Retry(), 1000)
    tr = m.handle(Retry(), 999)  # before it: retried
    assert m.status is RunStatus.RUNNING and runnable(tr) == [("a", None, 1)]
    m.handle(Tick(), 1000)
    assert m.status is RunStatus.TIMED_OUT


def test_a_timed_out_wait_waits_again_and_a_signal_completes_it() -> None:
    m, _ = start(defn([{"id": "gate", "kind": "wait", "event": "go", "timeout_ms": 50,
                        "into": "go"}]))
    m.handle(Tick(), 50)
    assert m.status is RunStatus.FAILED and m.record.error["reason"] == "wait_timeout"
    tr = m.handle(Retry(), 60)
    assert types(tr) == ["run_retried", "step_scheduled"] and m.status is RunStatus.WAITING
    assert m.next_deadline() == 110  # a fresh timeout
    m.handle(SignalReceived("go", {"ok": 1}), 70)
    assert m.status is RunStatus.COMPLETED and m.record.state == {"go": {"ok": 1}}


# --------------------------------------------------------------------------- fork


FLOW = [
    task("plan", cost_units=2),
    {"id": "fan", "kind": "for_each", "items": "${steps.plan.items}", "body": "work",
     "into": "worked", "max_parallel": 2},
    {"id": "gate", "kind": "wait", "event": "go", "into": "go"},
    task("sum"),
]


def drive_flow() -> tuple[RunMachine, Recorder]:
    m, tr = start(defn(FLOW, budgets={"max_transitions": 10}), input={"topic": "x"},
                  correlation="T-1")
    rec = Recorder(m, tr.journal)
    _, fence = rec.offer("plan")
    rec.handle(AttemptStarted("plan", None, fence))
    rec.handle(AttemptCompleted("plan", None, fence, {"items": [1, 2, 3]}, {"planned": 3},
                                {"input_tokens": 10, "output_tokens": 5, "cost_usd": 0.5}), 10)
    for i in range(3):
        _, fence = rec.offer("fan", i)
        rec.handle(AttemptStarted("fan", i, fence))
        rec.handle(AttemptCompleted("fan", i, fence, i * 10, {f"item{i}": True}), 20 + i)
    rec.handle(SignalReceived("go", {"go": "yes"}), 30)
    _, fence = rec.offer("sum")
    rec.handle(AttemptStarted("sum", None, fence))
    rec.handle(AttemptCompleted("sum", None, fence, 60), 40)
    assert m.status is RunStatus.COMPLETED
    return m, rec


@pytest.mark.parametrize("step", ["plan", "fan", "gate"])
def test_a_fork_keeps_the_history_and_the_record_as_they_were_after_the_step(step: str) -> None:
    _, rec = drive_flow()
    then = rec.after[step]
    f, tr = fork(rec.machine, rec.journal, step)
    seq = then["seq"]
    assert tr.journal[:seq] == rec.journal[:seq]  # the history, copied as it was
    assert tr.journal[seq]["type"] == "run_forked"
    assert tr.journal[seq]["from_run_id"] == "r_1" and tr.journal[seq]["from_seq"] == seq
    r = f.record
    assert r.state == then["state"] and r.steps == then["steps"]
    assert (r.transitions, r.cost_units, r.input_tokens) == (
        then["transitions"], then["cost_units"], then["input_tokens"])
    assert r.input == {"topic": "x"} and r.correlation == "T-1" and r.parent is None
    assert r.forked_from == {"run_id": "r_1", "step_id": step, "seq": seq}
    assert f.status_view()["forked_from"] == {"run_id": "r_1", "step_id": step}
    nxt = FLOW[[s["id"] for s in FLOW].index(step) + 1]["id"]
    assert tr.journal[seq + 1]["type"] == "step_scheduled" and tr.journal[seq + 1]["step_id"] == nxt
    assert [e["seq"] for e in tr.journal] == list(range(1, len(tr.journal) + 1))
    assert RunRecord.from_dict(r.to_dict()).to_dict() == r.to_dict()


def test_the_fork_runs_on_to_the_end_with_the_steps_it_kept() -> None:
    m, rec = drive_flow()
    f, tr = fork(m, rec.journal, "gate")
    assert runnable(tr) == [("sum", None, 1)]
    drv = Driver(f)
    _, fence = drv.offer("sum", now=10_001)
    assert fence == 1 and f.record.fences["plan"] == 1  # fences go on from the history
    f.handle(AttemptStarted("sum", None, fence), 10_002)
    f.handle(AttemptCompleted("sum", None, fence, 99), 10_003)
    assert f.status is RunStatus.COMPLETED and f.record.result == 99
    assert f.record.steps["plan"] == {"items": [1, 2, 3]}
    assert f.record.transitions == 4


def test_a_fork_from_the_last_step_completes_at_once() -> None:
    m, rec = drive_flow()
    f, tr = fork(m, rec.journal, "sum")
    assert f.status is RunStatus.COMPLETED and f.record.result == 60
    assert types(tr)[-2:] == ["run_forked", "run_completed"]


def test_a_fork_follows_the_jump_the_step_output_asked_for() -> None:
    m, tr = start(defn([task("a"), task("b"), task("c")]))
    rec = Recorder(m, tr.journal)
    rec.run("a", {"_next_step": "c"})
    _, ftr = fork(m, rec.journal, "a")
    assert runnable(ftr) == [("c", None, 1)]


def test_a_step_that_did_not_complete_is_refused_naming_from_step() -> None:
    m, tr = start(defn([task("a"), task("b", cost_units=5), task("c")],
                       budgets={"max_cost_units": 3}))
    rec = Recorder(m, tr.journal)
    rec.run("a", 1)
    rec.run("b", 2)  # breaches max_cost_units: b did not complete
    assert m.status is RunStatus.FAILED
    for step, why in (("b", "has not completed"), ("c", "has not completed"),
                      ("nope", "is not a step")):
        with pytest.raises(Invalid, match=why) as info:
            fork(m, rec.journal, step)
        assert info.value.field == "from_step"
    f, _ = fork(m, rec.journal, "a")  # the step before the failure forks
    assert f.record.cost_units == 1 and f.status is RunStatus.RUNNING


def test_a_fork_after_a_retry_counts_the_whole_history() -> None:
    d = defn([task("a"), task("b"), task("c")])
    m, tr = start(d)
    rec = Recorder(m, tr.journal)
    rec.run("a", 1, patch={"k": 1})
    rec.fail("b", "fatal")
    rec.handle(Retry(), 5)
    rec.run("b", 2, patch={"k": 2})
    f, ftr = fork(m, rec.journal, "b")
    assert f.record.state == {"k": 2} and f.record.visits == {"a": 1, "b": 2, "c": 1}
    assert f.record.transitions == 2 and runnable(ftr) == [("c", None, 1)]
    assert any(e["type"] == "run_retried" for e in ftr.journal)


def test_a_journal_from_before_outputs_were_kept_cannot_be_forked() -> None:
    m, tr = start(defn([task("a"), task("b")]))
    rec = Recorder(m, tr.journal)
    rec.run("a", 1)
    old = [{k: v for k, v in e.items() if k != "output"} for e in rec.journal]
    with pytest.raises(Unprocessable, match="before stepd kept step outputs"):
        fork(m, old, "a")
