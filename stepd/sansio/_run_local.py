"""The run machine's local-step layer: a parent's lease plan, and its records journaled.

AFFINITY.md "Local steps". A worker that declared ``local_steps`` gets, in the
lease of an ordinary task step, the plan of the local steps that follow it
(`plan_for`). It runs them right after the parent body and reports them in
the parent's ``complete``; `_apply_local` journals each one as ordinary step
history marked ``"execution_mode": "local"`` (scheduled, each attempt started
and failed or completed) in the same transition as the parent's completion,
so one transaction holds both. After that the run's record is past the local
steps: recovery, a restarted daemon or another worker reads the recorded
terminal event and never calls the local body again.

The records must be the steps the run goes on to, in order; anything else is
`Invalid` and, like every raising case of `RunMachine.handle`, changes
nothing (the machine puts its record back). See `_run_base` for the layers.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ._run_base import ALWAYS_RETRIED, END, _jump_of
from ._run_steps import _RunSteps
from .definition import TaskStep
from .errors import Invalid
from .events import Transition
from .local_steps import LocalRecord, local_plan, local_span_id
from .record import Frame, RunRecord
from .status import ErrorReason

#: Journal field that marks history a worker produced without a lease of its own.
EXECUTION_MODE_LOCAL = "local"


class _RunLocal(_RunSteps):
    __slots__ = ()

    def plan_for(self, step_id: str, lease_id: str) -> list[dict[str, Any]]:
        """The lease plan of the local steps after task step `step_id` (empty: none).

        Each entry carries the ``span_id`` of its step's span in the run's trace
        (`local_span_id`): the local body's own spans are its children, as a
        remote body's are the children of its lease's span.
        """
        plan = local_plan(self.definition, step_id)
        r = self.record
        for entry in plan:
            visit = r.visits.get(entry["step_id"], 0) + 1
            key = f"{r.run_id}/{entry['step_id']}"
            entry["idempotency_key"] = key if visit == 1 else f"{key}#{visit}"
            entry["span_id"] = local_span_id(lease_id, entry["step_id"])
        return plan

    def _snapshot(self) -> RunRecord:
        """A copy to put back if the records turn out invalid halfway."""
        return copy.deepcopy(self.record)

    def _restore(self, snapshot: RunRecord) -> None:
        for f in dataclasses.fields(snapshot):
            setattr(self.record, f.name, getattr(snapshot, f.name))

    def _apply_local(self, index: int | None, records: tuple[LocalRecord, ...],
                     parent: dict[str, Any], tr: Transition, now: int) -> int | None:
        """Journal `records` as the steps from `index` on; return where the run goes next.

        `parent` holds the fields every entry repeats (the parent's lease id,
        worker and step). A run that ended with its parent (a budget, ``$end``)
        ignores the records: nothing of them could apply.

        Raises:
            Invalid: a record that is not the step the run goes on to, is not
                a local step, or ends in an error with retry budget unspent.
        """
        r = self.record
        for k, rec in enumerate(records):
            if r.status.terminal:
                return None
            where = f"local_steps[{k}]"
            if index is None:
                raise Invalid("the run does not go on to a step here", field=f"{where}.step_id")
            step = self.definition.steps[index]
            if step.id != rec.step_id:
                raise Invalid(f"the run goes on to {step.id!r}, not {rec.step_id!r}",
                              field=f"{where}.step_id")
            if not isinstance(step, TaskStep) or not step.local:
                raise Invalid(f"step {step.id!r} is not a local task step",
                              field=f"{where}.step_id")
            self._check_budget_spent(step, rec, where)
            visit = r.visits.get(step.id, 0) + 1
            r.visits[step.id] = visit
            r.frame = Frame(step_id=step.id, index=index, visit=visit)
            mark = {"execution_mode": EXECUTION_MODE_LOCAL, **parent}
            self._journal(tr, now, "step_scheduled", step_id=step.id, kind=step.kind.text,
                          visit=visit, **mark)
            # The body's usage and spans ride the step's terminal entry (the completion,
            # or its last failed attempt), as a remote completion's ride step_completed.
            body = {"usage": rec.usage or None, "spans": list(rec.spans) or None}
            last = rec.attempts[-1]
            for a in rec.attempts:
                self._journal(tr, now, "step_started", step_id=step.id, attempt=a.attempt,
                              started_ms=a.started_ms, **mark)
                if a.error_class is not None:
                    self._journal(tr, now, "step_failed", step_id=step.id, attempt=a.attempt,
                                  error_class=a.error_class, message=a.message,
                                  ended_ms=a.ended_ms, **mark,
                                  **(body if a is last else {}))
            self._add_usage(rec.usage)
            if rec.error_class is not None:
                why = f"{rec.error_class}: {rec.message}" if rec.message else rec.error_class
                self._fail_run(ErrorReason.STEP_FAILED, why, step.id, tr, now)
                return None
            jump = _jump_of(rec.output)
            if jump is not None and jump != END:
                try:
                    self.definition.index_of(jump)
                except KeyError:
                    raise Invalid(f"{jump!r} is not a step of {self.definition.name!r}",
                                  field=f"{where}.output._next_step") from None
            self._journal(tr, now, "step_completed", step_id=step.id, attempt=last.attempt,
                          ended_ms=last.ended_ms, input=rec.input, progress=rec.progress, **mark,
                          **body)
            index = self._finish_step(step, rec.output, tr, now, patch=rec.state_patch,
                                      cost_delta=step.cost_units, jump=jump)
        return index

    @staticmethod
    def _check_budget_spent(step: TaskStep, rec: LocalRecord, where: str) -> None:
        """A local step ends in an error only when its retry policy is done with it."""
        retry = step.retry
        if len(rec.attempts) > retry.max_attempts:
            raise Invalid(f"{len(rec.attempts)} attempts, the retry policy allows "
                          f"{retry.max_attempts}", field=f"{where}.attempts")
        if rec.error_class is None:
            return
        retried = rec.error_class in ALWAYS_RETRIED or rec.error_class in retry.retry_on
        if retried and len(rec.attempts) < retry.max_attempts:
            raise Invalid(f"class {rec.error_class!r} is retried and {len(rec.attempts)} of "
                          f"{retry.max_attempts} attempts ran: not a terminal error",
                          field=f"{where}.error")
