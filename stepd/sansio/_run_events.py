"""The run machine's event layer: the run-level events of the table.

What reaches the run itself rather than one attempt of it: a signal, a
timer's tick, a child run's end, its first step (`Begin`), an internal
failure, a cancel, a retry. The attempt events (offers and the worker's calls
on its leases) are `_run_attempts`'. See `_run_base` for how `RunMachine` is
layered; `run.TRANSITIONS` names these handlers.
"""

from __future__ import annotations

import copy

from ._run_attempts import _RunAttempts
from ._run_base import (
    MAX_BUFFERED_SIGNAL_BYTES,
    MAX_BUFFERED_SIGNALS,
    MAX_IMMEDIATE_STEPS,
    MAX_SIGNAL_BYTES,
    iso_ms,
)
from .definition import StartWorkflowsStep
from .errors import Invalid, NotRetryable
from .events import (
    Begin,
    Cancel,
    ChildFinished,
    InternalFailure,
    Retry,
    SignalReceived,
    Tick,
    Transition,
)
from .status import ErrorReason, RunStatus

__all__ = ["_RunEvents"]


class _RunEvents(_RunAttempts):
    __slots__ = ()

    def _on_signal(self, ev: SignalReceived, now: int) -> Transition:
        if not isinstance(ev.name, str) or not ev.name:
            raise Invalid("must be a non-empty string", field="name")
        size = self._size(ev.payload)
        if size > MAX_SIGNAL_BYTES:
            raise Invalid(
                f"is {size} bytes as JSON; a signal's payload may hold at most {MAX_SIGNAL_BYTES} "
                "(max_signal_bytes): store the data elsewhere and signal a reference",
                field="payload")
        r = self.record
        f = r.frame
        if r.status is RunStatus.WAITING and f is not None and f.event == ev.name:
            # Try the transition on a copy: a signal whose transition breaches a
            # budget is refused and nothing of it is kept (WORKFLOWS.md "Budgets").
            trial = type(self)(copy.deepcopy(r), self.definition, self.resolve,
                               max_depth=self.max_depth)
            trial_tr = Transition()
            trial._consume_signal(ev.name, ev.payload, trial_tr, now)
            breach = next((e for e in trial_tr.journal if e["type"] == "budget_exceeded"), None)
            if breach is None:
                self.record = trial.record
                return trial_tr
            tr = Transition(refused=("budget_exceeded", breach["budget"]))
            self._journal(tr, now, "signal_rejected", name=ev.name, reason="budget_exceeded",
                          budget=breach["budget"], step_id=f.step_id)
            return tr
        if len(r.signals) >= MAX_BUFFERED_SIGNALS:
            raise Invalid(
                f"run {r.run_id} already buffers {len(r.signals)} signals that no wait has "
                f"taken, the most a run keeps (max_buffered_signals = {MAX_BUFFERED_SIGNALS})")
        buffered = sum(self._buffered_size(s) for s in r.signals)
        if buffered + size > MAX_BUFFERED_SIGNAL_BYTES:
            raise Invalid(
                f"run {r.run_id} buffers {buffered} bytes of signals that no wait has taken; "
                f"with this {size}-byte payload it would exceed the "
                f"{MAX_BUFFERED_SIGNAL_BYTES} a run keeps (max_buffered_signal_bytes)",
                field="payload")
        tr = Transition()
        r.signals.append({"name": ev.name, "payload": ev.payload, "at": now, "bytes": size})
        self._journal(tr, now, "signal_received", name=ev.name, buffered=True)
        return tr

    def _on_tick(self, ev: Tick, now: int) -> Transition:
        tr = Transition()
        for _ in range(MAX_IMMEDIATE_STEPS):
            if not self._fire_one_due(tr, now):
                break
        return tr

    def _on_tick_terminal(self, ev: Tick, now: int) -> Transition:
        return Transition()

    def _on_child_finished(self, ev: ChildFinished, now: int) -> Transition:
        tr = Transition()
        f = self.record.frame
        if f is None or ev.child_run_id not in f.children:
            return tr  # a child of an earlier step, or a repeated notification
        step = self.definition.step(f.step_id)
        assert isinstance(step, StartWorkflowsStep)
        index = f.children.index(ev.child_run_id)
        if f.finished[index]:
            return tr
        f.finished[index] = True
        if ev.status != RunStatus.COMPLETED.value:
            message = f"child run {ev.child_run_id} ended {ev.status}"
            if ev.error and ev.error.get("message"):
                message += f": {ev.error['message']}"
            self._journal(tr, now, "step_failed", step_id=step.id, item_index=index,
                          error_class="child_failed", message=message)
            self._fail_run(ErrorReason.STEP_FAILED, message, step.id, tr, now)
            return tr
        f.outputs[index] = ev.result
        f.done += 1
        if f.done == f.total:
            results = list(f.outputs)
            nxt = self._finish_step(step, results, tr, now, into_value=results)
            if nxt is not None:
                self._run_steps_from(nxt, tr, now)
        return tr

    def _on_child_ignored(self, ev: ChildFinished, now: int) -> Transition:
        return Transition()

    def _on_begin(self, ev: Begin, now: int) -> Transition:
        tr = Transition()
        if not self.record.begun:
            self.record.begun = True
            self._run_steps_from(0, tr, now)
        return tr

    def _on_internal_failure(self, ev: InternalFailure, now: int) -> Transition:
        tr = Transition()
        self._fail_run(ErrorReason.INTERNAL, ev.message, self._current_step_id(), tr, now)
        return tr

    def _on_cancel(self, ev: Cancel, now: int) -> Transition:
        tr = Transition()
        self._end_run(RunStatus.CANCELLED, tr, now, error={
            "reason": ErrorReason.CANCELLED.value, "message": ev.message,
            "step_id": self._current_step_id(),
        })
        return tr

    def _on_retry(self, ev: Retry, now: int) -> Transition:
        """Enter the failed step again (a new visit: attempt 1 of a fresh retry budget).

        Budgets and the deadline still apply, so a run that failed on a budget
        (a retry would breach it again: the usage stays) or whose deadline has
        passed is refused, and nothing changes.
        """
        r = self.record
        error = r.error or {}
        if error.get("reason") == ErrorReason.BUDGET_EXCEEDED.value:
            budget = error.get("budget")
            raise NotRetryable(
                f"run {r.run_id} failed on its budget {budget} ({error.get('message')}); "
                "budgets still apply to a retry, which would breach it again: start a new "
                "run, or fork this one from an earlier step", budget=budget)
        if r.deadline_at is not None and r.deadline_at <= now:
            raise NotRetryable(f"run {r.run_id}'s deadline passed at {iso_ms(r.deadline_at)}: "
                               "a retry would time out at once")
        step_id = error.get("step_id")
        index = 0 if step_id is None else self.definition.index_of(step_id)
        tr = Transition()
        r.status = RunStatus.RUNNING
        r.error = None
        r.begun = True
        self._journal(tr, now, "run_retried", step_id=self.definition.steps[index].id,
                      error=error or None)
        self._run_steps_from(index, tr, now)
        return tr

    def _retry_refused(self, ev: Retry, now: int) -> Transition:
        raise NotRetryable(f"run {self.record.run_id} is {self.record.status.value}: only a "
                           "failed run can be retried")
