"""The run machine's stepping layer: entering steps, fan-out, children, retries, timers.

See `_run_base` for how `RunMachine` is layered.
"""

from __future__ import annotations

from typing import Any

from ._run_base import (
    ALWAYS_RETRIED,
    END,
    MAX_IMMEDIATE_STEPS,
    MAX_RUN_ID_BYTES,
    _retry_of,
    child_run_id,
)
from ._run_sessions import _RunSessions
from .definition import (
    Delivery,
    ForEachStep,
    SleepStep,
    StartWorkflowsStep,
    Step,
    TaskStep,
    WaitStep,
)
from .errors import TemplateError
from .events import (
    AttemptSpec,
    ChildSpec,
    EndLeases,
    Runnable,
    StartChildren,
    Transition,
)
from .record import Frame, Slot
from .status import ErrorReason, RunStatus, SlotPhase
from .sticky import MISSING as STICKY_MISSING
from .templates import MISSING, render

# The running status as module names: a lookup on an Enum class costs ~1,400
# instructions on 3.11 (stepd/sansio/lease.py says why); one a step here.
_RUNNING = RunStatus.RUNNING


class _RunSteps(_RunSessions):
    __slots__ = ()

    # ------------------------------------------------------------------ stepping

    def _run_steps_from(self, index: int | None, tr: Transition, now: int) -> None:
        """Enter steps from `index` until one has to wait for something."""
        entered = 0
        while index is not None:
            if entered >= MAX_IMMEDIATE_STEPS:
                self._fail_run(
                    ErrorReason.STEP_FAILED,
                    f"{MAX_IMMEDIATE_STEPS} steps completed without waiting on anything: "
                    "a _next_step loop with no task in it?",
                    self._current_step_id(), tr, now,
                )
                return
            entered += 1
            index = self._enter(index, tr, now)

    def _enter(self, index: int, tr: Transition, now: int) -> int | None:
        """Start one visit of step `index`; return the next index if it finished at once."""
        r = self.record
        step = self.definition.steps[index]
        visit = r.visits.get(step.id, 0) + 1
        r.visits[step.id] = visit
        f = Frame(step_id=step.id, index=index, visit=visit)
        r.frame = f
        self._journal(tr, now, "step_scheduled", step_id=step.id, kind=step.kind.text,
                      visit=visit)
        # Steps are final classes: by exact type, no isinstance per step.
        if (type(step) is TaskStep or type(step) is ForEachStep) and step.session is not None \
                and self._session_unusable(step.session, step.id, tr, now):
            return None
        if type(step) is TaskStep:  # steps are final classes: no isinstance per step
            try:
                rendered = self.definition.input_renderer(step.id)(self._ctx())
            except TemplateError as exc:
                return self._template_failure(step, exc, tr, now)
            f.slots.append(Slot(item_index=None, input=rendered, cost_units=step.cost_units,
                                queued_at=now))
            r.status = _RUNNING
            tr.effects.append(Runnable((self._spec(step, f, f.slots[0]),)))
            return None
        if isinstance(step, ForEachStep):
            return self._enter_for_each(step, f, tr, now)
        if isinstance(step, WaitStep):
            f.event = step.event
            for i, sig in enumerate(r.signals):
                if sig["name"] == step.event:
                    del r.signals[i]
                    return self._finish_step(step, sig["payload"], tr, now,
                                             into_value=sig["payload"],
                                             note={"signal": step.event, "received_at": sig["at"]})
            f.due_at = None if step.timeout_ms is None else now + step.timeout_ms
            r.status = RunStatus.WAITING
            return None
        if isinstance(step, SleepStep):
            # Even a zero sleep goes through a timer: a loop of sleeps then
            # advances one tick at a time instead of spinning in one event.
            f.due_at = now + step.duration_ms
            r.status = RunStatus.SLEEPING
            return None
        assert isinstance(step, StartWorkflowsStep)
        return self._enter_start_workflows(step, f, tr, now)

    def _enter_for_each(self, step: ForEachStep, f: Frame, tr: Transition, now: int) -> int | None:
        r = self.record
        try:
            items = render(step.items, self._ctx())
        except TemplateError as exc:
            return self._template_failure(step, exc, tr, now)
        if not isinstance(items, list):
            return self._template_failure(
                step, TemplateError(f"items must render to a list, got {type(items).__name__}",
                                    path=str(step.items)), tr, now)
        limit = self.definition.budgets.max_for_each_items
        if limit is not None and len(items) > limit:
            # Checked before expanding: no slot of this group is ever scheduled.
            self._breach(("max_for_each_items", limit, len(items)), step.id, tr, now)
            return None
        inputs = []
        renderer = self.definition.input_renderer(step.id)
        for i, item in enumerate(items):
            try:
                inputs.append(renderer(self._ctx(item=item, item_index=i)))
            except TemplateError as exc:
                return self._template_failure(step, exc, tr, now)
        f.total = len(items)
        f.pending = inputs
        f.outputs = [None] * len(items)
        if not items:
            return self._finish_step(step, [], tr, now, into_value=[])
        r.status = _RUNNING
        self._fill_for_each(step, f, tr, now)
        return None

    def _fill_for_each(self, step: ForEachStep, f: Frame, tr: Transition, now: int) -> None:
        """Slot pending items up to `max_parallel`, in item order."""
        cap = self._session_cap(
            step.session, step.max_parallel if step.max_parallel is not None else f.total)
        new: list[AttemptSpec] = []
        while f.next_item < f.total and len(f.slots) < cap:
            i = f.next_item
            slot = Slot(item_index=i, input=f.pending[0], cost_units=step.cost_units, queued_at=now)
            del f.pending[0]
            f.next_item += 1
            f.slots.append(slot)
            new.append(self._spec(step, f, slot))
        if new:
            tr.effects.append(Runnable(tuple(new)))

    def _enter_start_workflows(
        self, step: StartWorkflowsStep, f: Frame, tr: Transition, now: int
    ) -> int | None:
        r = self.record
        try:
            items = render(step.items, self._ctx())
        except TemplateError as exc:
            return self._template_failure(step, exc, tr, now)
        if not isinstance(items, list):
            return self._template_failure(
                step, TemplateError(f"items must render to a list, got {type(items).__name__}",
                                    path=str(step.items)), tr, now)
        limit = self.definition.budgets.max_started_workflows
        total = r.started_workflows + len(items)
        if limit is not None and total > limit:
            # Checked before dispatching the group: no child is created.
            self._breach(("max_started_workflows", limit, total), step.id, tr, now)
            return None
        if items and r.depth >= self.max_depth:
            # The daemon-wide bound on nesting: with `max_started_workflows`, what
            # keeps a workflow that starts itself from growing without end.
            self._breach(("max_child_depth", self.max_depth, r.depth + 1), step.id, tr, now)
            return None
        ids = [child_run_id(r.run_id, step.id, f.visit, i) for i in range(len(items))]
        if ids and len(ids[-1].encode()) > MAX_RUN_ID_BYTES:
            message = (f"the child run ids would be {len(ids[-1].encode())} bytes long, over "
                       f"{MAX_RUN_ID_BYTES}: nest fewer levels or use shorter step ids")
            self._journal(tr, now, "step_failed", step_id=step.id, error_class="child_id_too_long",
                          message=message)
            self._fail_run(ErrorReason.STEP_FAILED, message, step.id, tr, now)
            return None
        if items:
            child_def = None if self.resolve is None else self.resolve(step.workflow, step.version)
            if child_def is None:
                message = f"workflow {step.workflow!r}" + (
                    f" version {step.version!r}" if step.version else "") + " is not registered"
                self._journal(tr, now, "step_failed", step_id=step.id,
                              error_class="unknown_workflow", message=message)
                self._fail_run(ErrorReason.STEP_FAILED, message, step.id, tr, now)
                return None
            tr.effects.append(StartChildren(
                parent_run_id=r.run_id, step_id=step.id, definition=child_def,
                children=tuple(ChildSpec(cid, item) for cid, item in zip(ids, items)),
                correlation=r.correlation, depth=r.depth + 1,
            ))
            for i, cid in enumerate(ids):
                self._journal(tr, now, "child_started", step_id=step.id, item_index=i,
                              child_run_id=cid, workflow=step.workflow,
                              version=child_def.version)
        r.started_workflows = total
        if not step.wait or not items:
            return self._finish_step(step, ids, tr, now, into_value=ids)
        f.total = len(items)
        f.children = ids
        f.finished = [False] * len(ids)
        f.outputs = [None] * len(ids)
        r.status = _RUNNING
        return None

    def _finish_step(
        self,
        step: Step,
        output: Any,
        tr: Transition,
        now: int,
        *,
        patch: dict[str, Any] | None = None,
        into_value: Any = MISSING,
        cost_delta: int = 0,
        jump: str | None = None,
        note: dict[str, Any] | None = None,
    ) -> int | None:
        """Record a step's completion, check budgets, and pick the next step.

        Returns the index of the step to enter next, or None when the run ended
        (completed, or failed on a budget or a bad jump).
        """
        r = self.record
        if type(step) is not TaskStep:  # final classes: no isinstance per step
            # Tasks journal their completion with the attempt; the other kinds here.
            # The output is journaled even when null: the journal alone then
            # holds the run's history (what a fork copies, `RunMachine.fork`).
            self._journal(tr, now, "step_completed", step_id=step.id, **(note or {}))
            tr.journal[-1]["output"] = output
        into = None if type(step) is TaskStep else getattr(step, "into", None)
        new_state = r.state
        if patch:
            new_state = {**new_state, **patch}
        if into is not None and into_value is not MISSING:
            new_state = {**new_state, into: into_value}
        changed = new_state is not r.state
        size = self._size(new_state) if changed else r.state_bytes
        breach = self._check(
            max_transitions=r.transitions + 1,
            max_cost_units=r.cost_units + cost_delta if cost_delta else None,
            max_state_bytes=size if changed else None,
        ) if self.definition.budgeted else None
        if breach is not None:
            self._breach(breach, step.id, tr, now)
            return None
        r.transitions += 1
        r.cost_units += cost_delta
        if changed:
            keys = sorted(set(patch or ()) | ({into} if into is not None and into_value is not MISSING else set()))
            old_state = r.state
            r.state = new_state
            r.state_bytes = size
            self._journal(tr, now, "state_patched", step_id=step.id, keys=keys,
                          values={k: new_state[k] for k in keys})
            if r.sticky is not None:
                for k in keys:
                    self._history_set("state", k, old_state.get(k, STICKY_MISSING), new_state[k])
        if r.sticky is not None:
            self._history_set("steps", step.id, r.steps.get(step.id, STICKY_MISSING), output)
        r.steps[step.id] = output
        r.result = output
        r.frame = None
        return self._continue_after(step, jump, tr, now)

    def _continue_after(self, step: Step, jump: str | None, tr: Transition, now: int) -> int | None:
        """The index of the step after `step` (its `_next_step` jump, its `next`, the one
        below it), or None when the run ended there (completed, or a jump to no step)."""
        target = jump if jump is not None else step.next
        if target is None:
            index = self.definition.index_of(step.id) + 1
            if index < len(self.definition.steps):
                return index
            target = END
        if target == END:
            self._end_run(RunStatus.COMPLETED, tr, now)
            return None
        try:
            return self.definition.index_of(target)
        except KeyError:
            message = f"_next_step {target!r} is not a step of {self.definition.name!r}"
            self._journal(tr, now, "step_failed", step_id=step.id, error_class="invalid_next_step",
                          message=message)
            self._fail_run(ErrorReason.STEP_FAILED, message, step.id, tr, now)
            return None

    def _buffered_size(self, signal: dict[str, Any]) -> int:
        """A buffered signal's payload size (records written before sizes were kept: measured)."""
        size = signal.get("bytes")
        return size if isinstance(size, int) else self._size(signal.get("payload"))

    def _consume_signal(self, name: str, payload: Any, tr: Transition, now: int) -> None:
        f = self.record.frame
        assert f is not None
        step = self.definition.step(f.step_id)
        self._journal(tr, now, "signal_received", name=name, step_id=step.id)
        nxt = self._finish_step(step, payload, tr, now, into_value=payload)
        if nxt is not None:
            self._run_steps_from(nxt, tr, now)


    # ------------------------------------------------------------------ attempts

    def _attempt_failed(
        self, f: Frame, slot: Slot, error_class: str, message: str, tr: Transition, now: int
    ) -> None:
        step = self.definition.step(f.step_id)
        if error_class == "template":
            self._fail_run(ErrorReason.TEMPLATE, message, step.id, tr, now)
            return
        retry = _retry_of(step)
        retried = error_class in ALWAYS_RETRIED or error_class in retry.retry_on
        if error_class == "timeout" and getattr(step, "delivery", None) is Delivery.AT_MOST_ONCE:
            retried = False  # it started: running it again could run it twice
        if retried and slot.attempt < retry.max_attempts:
            delay = retry.backoff_ms(slot.attempt)
            slot.lease_id = None
            slot.worker_id = None
            slot.timeout_at = None
            if delay <= 0:
                self._requeue(step, f, slot, tr, attempt=slot.attempt + 1, now=now)
                return
            slot.phase = SlotPhase.BACKOFF
            slot.not_before = now + delay
            return
        why = f"{error_class}: {message}" if message else error_class
        if retried:
            why = f"{why} (attempt {slot.attempt} of {retry.max_attempts})"
        self._fail_run(ErrorReason.STEP_FAILED, why, step.id, tr, now)

    def _requeue(
        self, step: Step, f: Frame, slot: Slot, tr: Transition, *, attempt: int, now: int
    ) -> None:
        slot.attempt = attempt
        slot.queued_at = now
        slot.phase = SlotPhase.QUEUED
        slot.lease_id = None
        slot.worker_id = None
        slot.not_before = None
        slot.timeout_at = None
        tr.effects.append(Runnable((self._spec(step, f, slot),)))

    def _fire_one_due(self, tr: Transition, now: int) -> bool:
        """Fire the single most urgent due timer; False when nothing is due."""
        r = self.record
        if r.status.terminal:
            return False
        if r.deadline_at is not None and r.deadline_at <= now:
            self._journal(tr, now, "timer_fired", timer="deadline", due_at=r.deadline_at)
            self._end_run(RunStatus.TIMED_OUT, tr, now, error={
                "reason": ErrorReason.DEADLINE.value,
                "message": f"run deadline passed at {r.deadline_at}",
                "step_id": self._current_step_id(),
            })
            return True
        f = r.frame
        if f is None:
            return False
        step = self.definition.step(f.step_id)
        if f.due_at is not None and f.due_at <= now:
            due = f.due_at
            f.due_at = None
            if isinstance(step, SleepStep):
                self._journal(tr, now, "timer_fired", timer="sleep", step_id=step.id, due_at=due)
                nxt = self._finish_step(step, None, tr, now)
                if nxt is not None:
                    self._run_steps_from(nxt, tr, now)
                return True
            assert isinstance(step, WaitStep)
            self._journal(tr, now, "timer_fired", timer="wait_timeout", step_id=step.id,
                          due_at=due)
            self._fail_run(ErrorReason.WAIT_TIMEOUT,
                           f"no {step.event!r} signal within {step.timeout_ms} ms", step.id, tr, now)
            return True
        for slot in f.slots:
            if slot.phase is SlotPhase.BACKOFF and slot.not_before is not None and slot.not_before <= now:
                self._journal(tr, now, "timer_fired", timer="retry", step_id=step.id,
                              item_index=slot.item_index, due_at=slot.not_before)
                self._requeue(step, f, slot, tr, attempt=slot.attempt + 1, now=now)
                return True
            if slot.phase is SlotPhase.STARTED and slot.timeout_at is not None and slot.timeout_at <= now:
                lease_id = slot.lease_id
                self._journal(tr, now, "timer_fired", timer="step_timeout", step_id=step.id,
                              item_index=slot.item_index, due_at=slot.timeout_at)
                timeout_ms = getattr(step, "timeout_ms", None)
                self._journal(tr, now, "step_failed", step_id=step.id, item_index=slot.item_index,
                              attempt=slot.attempt, fence=slot.fence, lease_id=lease_id,
                              worker_id=slot.worker_id, error_class="timeout",
                              message=f"no result within timeout_ms={timeout_ms}")
                if lease_id:
                    tr.effects.append(EndLeases((lease_id,), "fenced"))
                self._attempt_failed(f, slot, "timeout", f"no result within {timeout_ms} ms", tr, now)
                return True
        return False

