"""The run state machine: one run's orchestration logic, sans I/O.

`RunMachine.handle(event, now_ms)` takes one event and the current time and
returns a `Transition` (journal entries and effects); the machine's `record`
is then the run's new durable record. Nothing here awaits, reads a clock,
touches LMDB or a socket (STYLE.md rule 1): the run actor persists the record
and the journal in one transaction, acknowledges, and only then performs the
effects.

The contract is WORKFLOWS.md: step kinds, transitions and `_next_step`,
retries, budgets (checked exactly where its table says), signals buffered in
order, the journal's event names, and the run status view.

Dispatch is a table, `TRANSITIONS`, from (status, event type) to a handler
(STYLE.md rule 2; `python -m stepd.engine.run` prints it as a Mermaid
diagram). An event that the table does not list for the current status raises
`IllegalTransition` and changes nothing. Events that name a stale attempt
(a fence that is no longer current) raise `Fenced`; events that reach a
terminal run raise `RunTerminal` (the 409 reasons of PROTOCOL.md), also
without changing anything.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable
from typing import Any

from .canonical import state_bytes as canonical_state_bytes
from .definition import (
    MAX_DURATION_MS,
    Definition,
    Delivery,
    ForEachStep,
    SleepStep,
    StartWorkflowsStep,
    Step,
    TaskStep,
    WaitStep,
)
from .errors import Fenced, IllegalTransition, Invalid, RunTerminal, TemplateError

Resolver = Callable[[str, "str | None"], "Definition | None"]
from .events import (
    AttemptCompleted,
    AttemptFailed,
    AttemptLost,
    AttemptOffered,
    AttemptOrphaned,
    AttemptReleased,
    AttemptRevived,
    AttemptSpec,
    AttemptStarted,
    AttemptUnservable,
    Begin,
    Cancel,
    CancelChildren,
    ChildFinished,
    ChildSpec,
    EndLeases,
    Event,
    InternalFailure,
    NotifyParent,
    RunEnded,
    Runnable,
    SignalReceived,
    StartChildren,
    Tick,
    Transition,
    Withdraw,
)
from .record import Frame, RunRecord, Slot, slot_key
from .status import LIVE_PHASES, ErrorReason, RunStatus, SlotPhase
from .templates import MISSING, TemplateContext, render

END = "$end"

#: Steps one event may enter without waiting on anything (a `_next_step` loop
#: of sleeps-free, task-free steps would otherwise spin forever).
MAX_IMMEDIATE_STEPS = 1000

#: Signals a run keeps buffered before it refuses more (bounded memory).
MAX_BUFFERED_SIGNALS = 1000

#: The largest payload one signal may carry, as canonical JSON (1 MiB). Bigger
#: data belongs in the application's own store, the signal carrying a reference.
MAX_SIGNAL_BYTES = 1 << 20

#: The payload bytes a run keeps buffered at most (8 MiB): with the count above
#: this bounds what signals sent to a run that never waits for them can cost.
MAX_BUFFERED_SIGNAL_BYTES = 8 << 20

#: How deep child runs may nest by default (a run started through the API is
#: depth 0); the daemon's `--max-child-depth` sets it.
DEFAULT_MAX_CHILD_DEPTH = 10

#: The longest run id (child ids grow with depth): LMDB keys hold 511 bytes,
#: and the journal's keys add 9 to the run id.
MAX_RUN_ID_BYTES = 400

#: A run's token totals saturate here (2**62), well inside what storage holds.
MAX_TOKEN_TOTAL = 1 << 62

#: Error classes a step retries without listing them in `retry_on`.
ALWAYS_RETRIED = frozenset({"retryable", "timeout"})


def trace_id_for(run_id: str) -> str:
    """The run's trace id: stable, so every attempt's span joins one trace."""
    return hashlib.sha256(run_id.encode()).hexdigest()[:32]


def span_id_for(lease_id: str) -> str:
    return hashlib.sha256(lease_id.encode()).hexdigest()[:16]


def child_run_id(parent_run_id: str, step_id: str, visit: int, index: int) -> str:
    """Deterministic child ids: replaying a parent's transition recreates the same children."""
    suffix = "" if visit == 1 else f"@{visit}"
    return f"{parent_run_id}.{step_id}{suffix}.{index}"


class RunMachine:
    """One run's logic. Holds the record and the pinned definition; nothing else."""

    __slots__ = ("record", "definition", "resolve", "max_depth")

    def __init__(
        self,
        record: RunRecord,
        definition: Definition,
        resolve: Resolver | None = None,
        *,
        max_depth: int = DEFAULT_MAX_CHILD_DEPTH,
    ) -> None:
        if definition.definition_hash != record.definition_hash:
            raise ValueError(
                f"run {record.run_id} pins definition {record.definition_hash}, "
                f"given {definition.definition_hash}"
            )
        self.record = record
        self.definition = definition
        #: Looks up the definition a `start_workflows` step names (an in-memory
        #: catalog lookup: pure). None: no child workflow can be started.
        self.resolve = resolve
        #: The daemon-wide bound on nesting: a run at this depth may not start
        #: children (its `start_workflows` fails the run, `max_child_depth`).
        self.max_depth = max_depth

    # ------------------------------------------------------------------ creation

    @classmethod
    def start(
        cls,
        *,
        run_id: str,
        definition: Definition,
        input: Any,
        now_ms: int,
        correlation: Any = None,
        idempotency_key: str | None = None,
        deadline_ms: int | None = None,
        parent: dict[str, Any] | None = None,
        resolve: Resolver | None = None,
        depth: int = 0,
        begin: bool = True,
        max_depth: int = DEFAULT_MAX_CHILD_DEPTH,
    ) -> tuple[RunMachine, Transition]:
        """Create a run and enter its first step (unless `begin` is False: see `Begin`).

        Raises:
            Invalid: `deadline_ms` is not a positive integer.
        """
        if deadline_ms is not None and (
            not isinstance(deadline_ms, int) or isinstance(deadline_ms, bool)
            or not 0 < deadline_ms <= MAX_DURATION_MS
        ):
            raise Invalid(f"must be an integer from 1 to {MAX_DURATION_MS} (milliseconds)",
                          field="deadline_ms")
        deadline = deadline_ms if deadline_ms is not None else definition.deadline_ms
        record = RunRecord(
            run_id=run_id,
            workflow=definition.name,
            version=definition.version,
            definition_hash=definition.definition_hash,
            input=input,
            created_at=now_ms,
            correlation=correlation,
            idempotency_key=idempotency_key,
            parent=parent,
            updated_at=now_ms,
            deadline_at=None if deadline is None else now_ms + deadline,
            depth=depth,
            begun=begin,
        )
        machine = cls(record, definition, resolve, max_depth=max_depth)
        tr = Transition()
        machine._journal(
            tr,
            now_ms,
            "run_started",
            workflow=definition.name,
            version=definition.version,
            definition_hash=definition.definition_hash,
            idempotency_key=idempotency_key,
            parent_run_id=None if parent is None else parent["run_id"],
        )
        if begin:
            machine._run_steps_from(0, tr, now_ms)
        return machine, tr

    # ------------------------------------------------------------------ queries

    @property
    def status(self) -> RunStatus:
        return self.record.status

    def next_deadline(self) -> int | None:
        """The earliest time (ms) at which `Tick` has something to do, or None."""
        r = self.record
        if r.status.terminal:
            return None
        due: list[int] = []
        if r.deadline_at is not None:
            due.append(r.deadline_at)
        f = r.frame
        if f is not None:
            if f.due_at is not None:
                due.append(f.due_at)
            for s in f.slots:
                if s.phase is SlotPhase.BACKOFF and s.not_before is not None:
                    due.append(s.not_before)
                elif s.phase is SlotPhase.STARTED and s.timeout_at is not None:
                    due.append(s.timeout_at)
        return min(due) if due else None

    def runnable(self) -> list[AttemptSpec]:
        """Queued slots, for the registry (also after a restart)."""
        f = self.record.frame
        if f is None or self.record.status.terminal:
            return []
        step = self.definition.step(f.step_id)
        return [self._spec(step, f, s) for s in f.slots if s.phase is SlotPhase.QUEUED]

    def live_leases(self) -> list[tuple[str, Slot]]:
        """(lease id, slot) of every offered or started attempt."""
        f = self.record.frame
        if f is None:
            return []
        return [(s.lease_id, s) for s in f.slots if s.phase in LIVE_PHASES and s.lease_id]

    def current_fence(self, step_id: str, item_index: int | None) -> int:
        return self.record.fences.get(slot_key(step_id, item_index), 0)

    def idle(self) -> bool:
        """True when nothing but a timer, a signal or a child can move this run.

        Such a run may be passivated: its actor stops and the durable timer
        index (or the signal, or the child's notification) brings it back.
        """
        r = self.record
        if r.status.terminal:
            return True
        if not r.begun:
            return False  # its actor must enter the first step
        f = r.frame
        if f is None:
            return True
        return not any(s.phase in LIVE_PHASES or s.phase is SlotPhase.QUEUED for s in f.slots)

    # ------------------------------------------------------------------ dispatch

    def handle(self, event: Event, now_ms: int) -> Transition:
        """Apply one event.

        Raises:
            IllegalTransition: the event is not allowed in the current status.
            RunTerminal: the run is over (for events a caller may retry).
            Fenced: the event names an attempt that is no longer current.
            Invalid: the event carries a malformed value (e.g. a state patch
                that is not an object).
        In every raising case, nothing changed.
        """
        key = (self.record.status, type(event))
        entry = TRANSITIONS.get(key)
        if entry is None:
            if self.record.status.terminal and type(event) in _TERMINAL_CONFLICTS:
                raise RunTerminal(f"run {self.record.run_id} is {self.record.status.value}")
            raise IllegalTransition(
                f"{type(event).__name__} is not allowed when run {self.record.run_id} "
                f"is {self.record.status.value}"
            )
        handler: Callable[[RunMachine, Any, int], Transition] = getattr(RunMachine, entry[0])
        tr = handler(self, event, now_ms)
        self.record.updated_at = now_ms
        return tr

    # ------------------------------------------------------------------ handlers

    def _on_offered(self, ev: AttemptOffered, now: int) -> Transition:
        f, slot = self._slot(ev.step_id, ev.item_index)
        if slot.phase is not SlotPhase.QUEUED:
            raise Fenced(f"slot {slot_key(ev.step_id, ev.item_index)} is {slot.phase.value}, not queued")
        step = self.definition.step(f.step_id)
        tr = Transition()
        key = slot_key(ev.step_id, ev.item_index)
        fence = self.record.fences.get(key, 0) + 1
        self.record.fences[key] = fence
        slot.fence = fence
        slot.phase = SlotPhase.OFFERED
        slot.lease_id = ev.lease_id
        slot.worker_id = ev.worker_id
        self._journal(
            tr, now, "step_offered", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=fence, lease_id=ev.lease_id,
            worker_id=ev.worker_id, worker_name=ev.worker_name,
        )
        spec = self._spec(step, f, slot)
        tr.lease = {
            "lease_id": ev.lease_id,
            "fence": fence,
            "run_id": self.record.run_id,
            "workflow": self.record.workflow,
            "version": self.record.version,
            "definition_hash": self.record.definition_hash,
            "step_id": ev.step_id,
            "body": spec.body,
            "attempt": slot.attempt,
            "item_index": ev.item_index,
            "delivery": spec.delivery,
            "input": slot.input,
            "steps": dict(self.record.steps),
            "state": dict(self.record.state),
            "correlation": self.record.correlation,
            "idempotency_key": spec.idempotency_key,
            "trace_id": trace_id_for(self.record.run_id),
            "span_id": span_id_for(ev.lease_id),
            "timeout_ms": spec.timeout_ms,
        }
        return tr

    def _on_started(self, ev: AttemptStarted, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        tr = Transition()
        if slot.phase is SlotPhase.STARTED:
            return tr  # a repeated `started` changes nothing
        step = self.definition.step(f.step_id)
        slot.phase = SlotPhase.STARTED
        timeout = getattr(step, "timeout_ms", None)
        slot.timeout_at = None if timeout is None else now + timeout
        self._journal(
            tr, now, "step_started", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            worker_id=slot.worker_id,
        )
        return tr

    def _on_completed(self, ev: AttemptCompleted, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        patch = ev.state_patch
        if patch is not None and not isinstance(patch, dict):
            raise Invalid("must be an object", field="state_patch")
        step = self.definition.step(f.step_id)
        jump = _jump_of(ev.output) if isinstance(step, TaskStep) else None
        if jump is not None and jump != END:
            try:
                self.definition.index_of(jump)
            except KeyError:
                raise Invalid(f"{jump!r} is not a step of {self.definition.name!r}",
                              field="output._next_step") from None
        tr = Transition()
        r = self.record
        if ev.usage:
            # Saturating: a total past what storage holds would fail every write of
            # the run (the transport bounds each report; this bounds the sum).
            r.input_tokens = min(r.input_tokens + int(ev.usage.get("input_tokens") or 0),
                                 MAX_TOKEN_TOTAL)
            r.output_tokens = min(r.output_tokens + int(ev.usage.get("output_tokens") or 0),
                                  MAX_TOKEN_TOTAL)
            cost = r.cost_usd + float(ev.usage.get("cost_usd") or 0.0)
            r.cost_usd = cost if math.isfinite(cost) else r.cost_usd
        self._journal(
            tr, now, "step_completed", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            worker_id=slot.worker_id, usage=ev.usage or None,
            spans=list(ev.spans) if ev.spans else None,
        )
        slot.phase = SlotPhase.DONE
        if isinstance(step, TaskStep):
            f.slots.remove(slot)
            nxt = self._finish_step(
                step, ev.output, tr, now, patch=patch, cost_delta=slot.cost_units, jump=jump,
            )
            if nxt is not None:
                self._run_steps_from(nxt, tr, now)
            return tr
        assert isinstance(step, ForEachStep)
        # One item of a for_each: its cost and patch count now ("on each completion").
        breach = self._check(
            max_cost_units=r.cost_units + slot.cost_units,
            max_state_bytes=None if not patch else self._size({**r.state, **patch}),
        )
        if breach is not None:
            self._breach(breach, step.id, tr, now)
            return tr
        r.cost_units += slot.cost_units
        if patch:
            r.state = {**r.state, **patch}
            r.state_bytes = self._size(r.state)
            self._journal(tr, now, "state_patched", step_id=step.id, item_index=ev.item_index,
                          keys=sorted(patch))
        assert ev.item_index is not None
        f.slots.remove(slot)
        f.outputs[ev.item_index] = ev.output
        f.done += 1
        if f.done == f.total:
            nxt = self._finish_step(step, list(f.outputs), tr, now, into_value=list(f.outputs))
            if nxt is not None:
                self._run_steps_from(nxt, tr, now)
            return tr
        self._fill_for_each(step, f, tr, now)
        return tr

    def _on_failed(self, ev: AttemptFailed, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        if ev.error_class == "unservable":
            return self._on_unservable(AttemptUnservable(
                ev.step_id, ev.item_index, ev.fence, slot.worker_id or "", ev.message), now)
        tr = Transition()
        self._journal(
            tr, now, "step_failed", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            worker_id=slot.worker_id, error_class=ev.error_class, message=ev.message,
        )
        self._attempt_failed(f, slot, ev.error_class, ev.message, tr, now)
        return tr

    def _on_lost(self, ev: AttemptLost, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        step = self.definition.step(f.step_id)
        tr = Transition()
        self._journal(
            tr, now, "step_recovered", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            started=ev.started,
        )
        delivery = getattr(step, "delivery", Delivery.AT_LEAST_ONCE)
        if delivery is Delivery.AT_MOST_ONCE:
            if ev.started:
                # PROTOCOL.md "Expiry and recovery": never re-run; the step fails `lost`.
                self._journal(tr, now, "step_failed", step_id=ev.step_id,
                              item_index=ev.item_index, attempt=slot.attempt, fence=ev.fence,
                              error_class="lost",
                              message="at_most_once attempt lost after it started")
                self._fail_run(ErrorReason.LEASE_LOST,
                               "at_most_once attempt lost after it started", step.id, tr, now)
                return tr
            self._requeue(step, f, slot, tr, attempt=slot.attempt, now=now)
            return tr
        retry = _retry_of(step)
        if slot.attempt >= retry.max_attempts:
            self._fail_run(
                ErrorReason.LEASE_LOST,
                f"lease lost on attempt {slot.attempt} of {retry.max_attempts}", step.id, tr, now,
            )
            return tr
        self._requeue(step, f, slot, tr, attempt=slot.attempt + 1, now=now)
        return tr

    def _on_orphaned(self, ev: AttemptOrphaned, now: int) -> Transition:
        return self._journal_only("step_orphaned", ev, now)

    def _on_revived(self, ev: AttemptRevived, now: int) -> Transition:
        return self._journal_only("step_revived", ev, now)

    def _journal_only(self, type_: str, ev: AttemptOrphaned | AttemptRevived, now: int) -> Transition:
        """Lease timing news: journaled against the live attempt, nothing else changes."""
        _, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        tr = Transition()
        self._journal(tr, now, type_, step_id=ev.step_id, item_index=ev.item_index,
                      attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
                      worker_id=slot.worker_id)
        return tr

    def _on_released(self, ev: AttemptReleased, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        if slot.phase is not SlotPhase.OFFERED:
            raise Fenced(f"lease {slot.lease_id} has started: it cannot be released")
        step = self.definition.step(f.step_id)
        tr = Transition()
        self._journal(tr, now, "step_recovered", step_id=ev.step_id, item_index=ev.item_index,
                      attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
                      started=False, released=True)
        self._requeue(step, f, slot, tr, attempt=slot.attempt, now=now)  # never ran: no budget spent
        return tr

    def _on_unservable(self, ev: AttemptUnservable, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        step = self.definition.step(f.step_id)
        tr = Transition()
        self._journal(
            tr, now, "step_unservable", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            worker_id=ev.worker_id, message=ev.message,
        )
        if ev.worker_id not in slot.excluded:
            slot.excluded.append(ev.worker_id)
        self._requeue(step, f, slot, tr, attempt=slot.attempt, now=now)  # no retry budget spent
        return tr

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
            trial = RunMachine(copy.deepcopy(r), self.definition, self.resolve,
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
        self._journal(tr, now, "step_scheduled", step_id=step.id, kind=step.kind.value,
                      visit=visit)
        if isinstance(step, TaskStep):
            try:
                rendered = render(step.input, self._ctx())
            except TemplateError as exc:
                return self._template_failure(step, exc, tr, now)
            f.slots.append(Slot(item_index=None, input=rendered, cost_units=step.cost_units,
                                queued_at=now))
            r.status = RunStatus.RUNNING
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
        for i, item in enumerate(items):
            try:
                inputs.append(render(step.input, self._ctx(item=item, item_index=i)))
            except TemplateError as exc:
                return self._template_failure(step, exc, tr, now)
        f.total = len(items)
        f.pending = inputs
        f.outputs = [None] * len(items)
        if not items:
            return self._finish_step(step, [], tr, now, into_value=[])
        r.status = RunStatus.RUNNING
        self._fill_for_each(step, f, tr, now)
        return None

    def _fill_for_each(self, step: ForEachStep, f: Frame, tr: Transition, now: int) -> None:
        """Slot pending items up to `max_parallel`, in item order."""
        cap = step.max_parallel if step.max_parallel is not None else f.total
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
        r.status = RunStatus.RUNNING
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
        if not isinstance(step, TaskStep):
            # Tasks journal their completion with the attempt; the other kinds here.
            self._journal(tr, now, "step_completed", step_id=step.id, **(note or {}))
        into = getattr(step, "into", None)
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
        )
        if breach is not None:
            self._breach(breach, step.id, tr, now)
            return None
        r.transitions += 1
        r.cost_units += cost_delta
        if changed:
            keys = sorted(set(patch or ()) | ({into} if into is not None and into_value is not MISSING else set()))
            r.state = new_state
            r.state_bytes = size
            self._journal(tr, now, "state_patched", step_id=step.id, keys=keys)
        r.steps[step.id] = output
        r.result = output
        r.frame = None
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

    # ------------------------------------------------------------------ endings

    def _template_failure(self, step: Step, exc: TemplateError, tr: Transition, now: int) -> int | None:
        """Fail the run with reason `template`; returns None (no next step) for `_enter`."""
        message = f"template path {exc.path!r}: {exc}"
        self._journal(tr, now, "step_failed", step_id=step.id, error_class="template",
                      message=message, path=exc.path)
        self._fail_run(ErrorReason.TEMPLATE, message, step.id, tr, now)
        return None

    def _breach(self, breach: tuple[str, int, int], step_id: str, tr: Transition, now: int) -> None:
        name, limit, value = breach
        self._journal(tr, now, "budget_exceeded", budget=name, limit=limit, value=value,
                      step_id=step_id)
        self._fail_run(ErrorReason.BUDGET_EXCEEDED,
                       f"{name} exceeded: {value} > {limit}", step_id, tr, now, budget=name)

    def _fail_run(
        self, reason: ErrorReason, message: str, step_id: str | None, tr: Transition, now: int,
        *, budget: str | None = None,
    ) -> None:
        error: dict[str, Any] = {"reason": reason.value, "message": message, "step_id": step_id}
        if budget is not None:
            error["budget"] = budget
        self._end_run(RunStatus.FAILED, tr, now, error=error)

    def _end_run(
        self, status: RunStatus, tr: Transition, now: int, *, error: dict[str, Any] | None = None
    ) -> None:
        r = self.record
        f = r.frame
        if f is not None:
            live = tuple(s.lease_id for s in f.slots if s.phase in LIVE_PHASES and s.lease_id)
            if live:
                tr.effects.append(EndLeases(live, "run_terminal"))
            queued = tuple((f.step_id, s.item_index) for s in f.slots if s.phase is SlotPhase.QUEUED)
            if queued:
                tr.effects.append(Withdraw(r.run_id, queued))
            running_children = tuple(
                cid for cid, done in zip(f.children, f.finished) if not done
            )
            if running_children:
                tr.effects.append(CancelChildren(running_children))
        r.frame = None
        r.status = status
        r.error = error
        if status is not RunStatus.COMPLETED:
            r.result = None
        event = {
            RunStatus.COMPLETED: "run_completed",
            RunStatus.FAILED: "run_failed",
            RunStatus.CANCELLED: "run_cancelled",
            RunStatus.TIMED_OUT: "run_timed_out",
        }[status]
        if status is RunStatus.COMPLETED:
            self._journal(tr, now, event, result=r.result)
        else:
            self._journal(tr, now, event, error=error)
        tr.effects.append(RunEnded(r.run_id, status.value))
        if r.parent is not None:
            tr.effects.append(NotifyParent(r.parent["run_id"], r.run_id))

    # ------------------------------------------------------------------ helpers

    def _journal(self, tr: Transition, now: int, type_: str, **fields: Any) -> None:
        self.record.seq += 1
        entry = {"seq": self.record.seq, "type": type_, "at": now}
        entry.update({k: v for k, v in fields.items() if v is not None})
        tr.journal.append(entry)

    def _ctx(self, *, item: Any = MISSING, item_index: int | None = None) -> TemplateContext:
        r = self.record
        return TemplateContext(
            input=r.input, state=r.state, steps=r.steps, run_id=r.run_id,
            correlation=r.correlation, item=item, item_index=item_index,
        )

    def _spec(self, step: Step, f: Frame, slot: Slot) -> AttemptSpec:
        r = self.record
        key = f"{r.run_id}/{step.id}"
        if f.visit > 1:
            key += f"#{f.visit}"
        if slot.item_index is not None:
            key += f"/{slot.item_index}"
        assert isinstance(step, (TaskStep, ForEachStep))
        return AttemptSpec(
            run_id=r.run_id,
            workflow=r.workflow,
            version=r.version,
            definition_hash=r.definition_hash,
            step_id=step.id,
            body=step.body,
            item_index=slot.item_index,
            attempt=slot.attempt,
            delivery=step.delivery.value,
            timeout_ms=step.timeout_ms,
            idempotency_key=key,
            excluded_workers=tuple(slot.excluded),
        )

    def _slot(self, step_id: str, item_index: int | None) -> tuple[Frame, Slot]:
        f = self.record.frame
        if f is None or f.step_id != step_id:
            raise Fenced(f"step {step_id!r} is not the run's current step")
        slot = f.slot(item_index)
        if slot is None:
            raise Fenced(f"slot {slot_key(step_id, item_index)} has no attempt in flight")
        return f, slot

    def _live_slot(self, step_id: str, item_index: int | None, fence: int) -> tuple[Frame, Slot]:
        f, slot = self._slot(step_id, item_index)
        if slot.fence != fence or slot.phase not in LIVE_PHASES:
            raise Fenced(
                f"fence {fence} of {slot_key(step_id, item_index)} is stale "
                f"(current {slot.fence}, {slot.phase.value})"
            )
        return f, slot

    def _current_step_id(self) -> str | None:
        f = self.record.frame
        return None if f is None else f.step_id

    def _check(self, **values: int | None) -> tuple[str, int, int] | None:
        budgets = self.definition.budgets
        for name, value in values.items():
            if value is None:
                continue
            limit = getattr(budgets, name)
            if limit is not None and value > limit:
                return (name, limit, value)
        return None

    @staticmethod
    def _size(state: dict[str, Any]) -> int:
        return canonical_state_bytes(state)

    # ------------------------------------------------------------------ status view

    def status_view(self) -> dict[str, Any]:
        """The run status exactly as WORKFLOWS.md "Run status" shows it."""
        r = self.record
        f = r.frame
        return {
            "run_id": r.run_id,
            "workflow": r.workflow,
            "status": r.status.value,
            "definition_version": r.version,
            "definition_hash": r.definition_hash,
            "idempotency_key": r.idempotency_key,
            "correlation": r.correlation,
            "input": r.input,
            "state": r.state,
            "result": r.result,
            "error": r.error,
            "current_steps": [] if f is None or r.status.terminal else [f.step_id],
            "waiting_for": f.event if f is not None and r.status is RunStatus.WAITING else None,
            "budget": {
                "limits": self.definition.budgets.limits(),
                "usage": {
                    "transitions": r.transitions,
                    "cost_units": r.cost_units,
                    "state_bytes": r.state_bytes,
                    "started_workflows": r.started_workflows,
                },
            },
            "usage": {
                "input_tokens": r.input_tokens,
                "output_tokens": r.output_tokens,
                "cost_usd": round(r.cost_usd, 10),
            },
            "created_at": iso_ms(r.created_at),
            "updated_at": iso_ms(r.updated_at),
            "deadline_at": None if r.deadline_at is None else iso_ms(r.deadline_at),
            "parent_run_id": None if r.parent is None else r.parent["run_id"],
        }


def iso_ms(ms: int) -> str:
    """Epoch milliseconds as ISO 8601 UTC with milliseconds (pure: no clock read)."""
    import datetime as _dt

    return (
        _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _jump_of(output: Any) -> str | None:
    """The `_next_step` a task's output asks for, or None.

    One rule for every bad target (not a string, or no such step): the
    completion is refused with a 400 naming ``output._next_step`` and nothing
    of it is applied; the run does not end on a worker's typo.

    Raises:
        Invalid: the key is there but does not hold a string.
    """
    if isinstance(output, dict) and "_next_step" in output:
        target = output["_next_step"]
        if not isinstance(target, str) or not target:
            raise Invalid("must be a step id of the workflow or '$end'", field="output._next_step")
        return target
    return None


def _retry_of(step: Step) -> Any:
    retry = getattr(step, "retry", None)
    if retry is None:
        raise IllegalTransition(f"step {step.id} has no attempts")
    return retry


# --------------------------------------------------------------------------- the table

R, W, S = RunStatus.RUNNING, RunStatus.WAITING, RunStatus.SLEEPING
C, F, X, T = RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMED_OUT
_ACTIVE = (R, W, S)
_TERMINAL = (C, F, X, T)
_NEXT = (R, W, S, C, F)  # entering the next step(s) can end anywhere but cancelled/timed out

#: (status, event type) -> (handler, statuses the run can be in afterwards).
#: A pair that is not here raises IllegalTransition (or RunTerminal, for the
#: events a caller may race with the run's end: `_TERMINAL_CONFLICTS`).
#: `test_run_machine_table.py` drives random event sequences and checks that
#: every observed transition is one this table declares.
TRANSITIONS: dict[tuple[RunStatus, type], tuple[str, tuple[RunStatus, ...]]] = {
    (R, AttemptOffered): ("_on_offered", (R,)),
    (R, AttemptStarted): ("_on_started", (R,)),
    (R, AttemptOrphaned): ("_on_orphaned", (R,)),
    (R, AttemptRevived): ("_on_revived", (R,)),
    (R, AttemptUnservable): ("_on_unservable", (R,)),
    (R, AttemptReleased): ("_on_released", (R,)),
    (R, AttemptCompleted): ("_on_completed", _NEXT),
    (R, AttemptFailed): ("_on_failed", (R, F)),
    (R, AttemptLost): ("_on_lost", (R, F)),
    (R, ChildFinished): ("_on_child_finished", _NEXT),
    (R, SignalReceived): ("_on_signal", (R,)),
    (S, SignalReceived): ("_on_signal", (S,)),
    (W, SignalReceived): ("_on_signal", (W, *_NEXT)),
    (R, Tick): ("_on_tick", (*_NEXT, T)),
    (S, Tick): ("_on_tick", (*_NEXT, T)),
    (W, Tick): ("_on_tick", (W, F, T)),
    (R, Cancel): ("_on_cancel", (X,)),
    (W, Cancel): ("_on_cancel", (X,)),
    (S, Cancel): ("_on_cancel", (X,)),
    (R, Begin): ("_on_begin", (*_NEXT, T)),
    (R, InternalFailure): ("_on_internal_failure", (F,)),
    (W, InternalFailure): ("_on_internal_failure", (F,)),
    (S, InternalFailure): ("_on_internal_failure", (F,)),
    (W, ChildFinished): ("_on_child_ignored", (W,)),
    (S, ChildFinished): ("_on_child_ignored", (S,)),
}
for _s in (W, S):
    # Attempt events for a step the run has left: answered `fenced`, as in
    # RUNNING when the fence is stale.
    for _ev in (AttemptOffered, AttemptStarted, AttemptCompleted, AttemptFailed, AttemptLost,
                AttemptOrphaned, AttemptRevived, AttemptReleased, AttemptUnservable):
        TRANSITIONS[(_s, _ev)] = ("_stale_attempt", ())
for _s in _TERMINAL:
    TRANSITIONS[(_s, Tick)] = ("_on_tick_terminal", (_s,))
    TRANSITIONS[(_s, ChildFinished)] = ("_on_child_ignored", (_s,))
del _s, _ev

#: Events that, on a terminal run, are the caller's race with the run's end
#: rather than a bug: they get `RunTerminal` (409 run_terminal).
_TERMINAL_CONFLICTS = frozenset({
    AttemptOffered, AttemptStarted, AttemptCompleted, AttemptFailed, AttemptLost,
    AttemptOrphaned, AttemptRevived, AttemptReleased, AttemptUnservable, SignalReceived, Cancel,
    InternalFailure,
})


def _stale_attempt(self: RunMachine, ev: Any, now: int) -> Transition:
    raise Fenced(f"step {ev.step_id!r} is not the run's current step")


RunMachine._stale_attempt = _stale_attempt  # type: ignore[attr-defined]


def mermaid() -> str:
    """The transition table as a Mermaid state diagram (docs/run-machine.md).

    One arrow per (status, resulting status), labelled with the events that
    can take that path; events that always raise are left out.
    """
    edges: dict[tuple[str, str], set[str]] = {}
    for (status, ev), (_, outcomes) in TRANSITIONS.items():
        for target in outcomes:
            edges.setdefault((status.value, target.value), set()).add(ev.__name__)
    lines = ["stateDiagram-v2", "    [*] --> running: start"]
    order = {s.value: i for i, s in enumerate(RunStatus)}
    for (src, dst), evs in sorted(edges.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])):
        lines.append(f"    {src} --> {dst}: {', '.join(sorted(evs))}")
    for status in _TERMINAL:
        lines.append(f"    {status.value} --> [*]")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(mermaid())
