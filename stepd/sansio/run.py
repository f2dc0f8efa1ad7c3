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
(STYLE.md rule 2; `python -m stepd.sansio.run` prints it as a Mermaid
diagram). An event that the table does not list for the current status raises
`IllegalTransition` and changes nothing. Events that name a stale attempt
(a fence that is no longer current) raise `Fenced`; events that reach a
terminal run raise `RunTerminal` (the 409 reasons of PROTOCOL.md), also
without changing anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._run_base import (
    ALWAYS_RETRIED,
    DEFAULT_MAX_CHILD_DEPTH,
    END,
    MAX_BUFFERED_SIGNAL_BYTES,
    MAX_BUFFERED_SIGNALS,
    MAX_IMMEDIATE_STEPS,
    MAX_RUN_ID_BYTES,
    MAX_SIGNAL_BYTES,
    MAX_TOKEN_TOTAL,
    Resolver,
    _jump_of,
    child_run_id,
    iso_ms,
    span_id_for,
    trace_id_for,
)
from ._run_events import _RunEvents
from .definition import (
    MAX_DURATION_MS,
    Definition,
    TaskStep,
)
from .errors import Fenced, IllegalTransition, Invalid, RunTerminal
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
    ChildFinished,
    Event,
    InternalFailure,
    Retry,
    SessionChanged,
    SignalReceived,
    Tick,
    Transition,
)
from .history import fork_point
from .record import RunRecord, Slot, slot_key
from .status import LIVE_PHASES, RunStatus, SlotPhase
from .sticky import cursor_of, view_hash

#: A slot in one of these phases moves without a timer, signal or child: queued, offered, started.
_MOVING_PHASES = LIVE_PHASES | {SlotPhase.QUEUED}

__all__ = [
    "ALWAYS_RETRIED",
    "DEFAULT_MAX_CHILD_DEPTH",
    "END",
    "MAX_BUFFERED_SIGNALS",
    "MAX_BUFFERED_SIGNAL_BYTES",
    "MAX_IMMEDIATE_STEPS",
    "MAX_RUN_ID_BYTES",
    "MAX_SIGNAL_BYTES",
    "MAX_TOKEN_TOTAL",
    "TRANSITIONS",
    "Resolver",
    "RunMachine",
    "child_run_id",
    "iso_ms",
    "mermaid",
    "span_id_for",
    "trace_id_for",
]


class RunMachine(_RunEvents):
    """One run's logic. Holds the record and the pinned definition; nothing else.

    Its code is layered over six modules (`_run_base`); this one holds
    creation, the queries, the dispatch and the status view.
    """

    __slots__ = ()

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
        definition_hash = definition.definition_hash  # a property: read once
        record = RunRecord(
            run_id=run_id,
            workflow=definition.name,
            version=definition.version,
            definition_hash=definition_hash,
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
            definition_hash=definition_hash,
            idempotency_key=idempotency_key,
            parent_run_id=None if parent is None else parent["run_id"],
        )
        if begin:
            machine._run_steps_from(0, tr, now_ms)
        return machine, tr


    @classmethod
    def fork(
        cls,
        *,
        source: RunRecord,
        journal: list[dict[str, Any]],
        definition: Definition,
        from_step: str,
        run_id: str,
        now_ms: int,
        idempotency_key: str | None = None,
        resolve: Resolver | None = None,
        max_depth: int = DEFAULT_MAX_CHILD_DEPTH,
    ) -> tuple[RunMachine, Transition]:
        """A new run that starts where `source` was right after the last completion of
        `from_step` (like DBOS's fork): its journal up to there copied (same seqs),
        then ``run_forked``, then the step after `from_step` entered.

        The state, step outputs, visits, fences and budget usage are what they
        were then (`history.fork_point`): budgets count the copied history too.
        Input and correlation are the source's; the deadline is the
        definition's, from now; signals the source had buffered are not
        carried over. The fork is a top-level run (no parent).

        Raises:
            Invalid: (``from_step``) no such step, or it has not completed.
            Unprocessable: the source's journal cannot be forked (see `fork_point`).
        """
        point = fork_point(journal, definition, from_step)
        deadline = definition.deadline_ms
        record = RunRecord(
            run_id=run_id, workflow=source.workflow, version=source.version,
            definition_hash=source.definition_hash, input=source.input, created_at=now_ms,
            correlation=source.correlation, idempotency_key=idempotency_key,
            updated_at=now_ms, deadline_at=None if deadline is None else now_ms + deadline,
            state=point.state, steps=point.steps, result=point.output, visits=point.visits,
            fences=point.fences, transitions=point.transitions, cost_units=point.cost_units,
            started_workflows=point.started_workflows, state_bytes=cls._size(point.state),
            input_tokens=point.input_tokens, output_tokens=point.output_tokens,
            cost_usd=point.cost_usd, seq=point.seq,
            forked_from={"run_id": source.run_id, "step_id": from_step, "seq": point.seq},
        )
        machine = cls(record, definition, resolve, max_depth=max_depth)
        tr = Transition(journal=[dict(e) for e in point.journal])
        machine._journal(tr, now_ms, "run_forked", from_run_id=source.run_id,
                         from_step=from_step, from_seq=point.seq, idempotency_key=idempotency_key)
        step = definition.step(from_step)
        jump = _jump_of(point.output) if isinstance(step, TaskStep) else None
        nxt = machine._continue_after(step, jump, tr, now_ms)
        if nxt is not None:
            machine._run_steps_from(nxt, tr, now_ms)
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

    def history(self, lease_id: str, step_id: str, item_index: int | None,
                fence: int) -> dict[str, Any]:
        """The run's full history and its cursor, for a live lease of it (GET
        /v1/api/steps/{lease}/history; docs/affinity.md "Sticky execution").

        Raises:
            RunTerminal: the run is over.
            Fenced: the lease is no longer the live attempt of its step.
        """
        r = self.record
        if r.status.terminal:
            raise RunTerminal(f"run {r.run_id} is {r.status.value}")
        self._live_slot(step_id, item_index, fence)
        cursor = {"seq": r.seq, "hash": view_hash(r.steps, r.state)} if r.sticky is None \
            else cursor_of(r.sticky)
        return {"cursor": {**cursor, "workflow": r.workflow, "run_id": r.run_id},
                "steps": dict(r.steps), "state": dict(r.state)}

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
        for s in f.slots:  # a loop, not any(genexpr): this runs several times per step
            if s.phase in _MOVING_PHASES:
                return False
        return True


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
        try:  # a subscript, not `get`: no call (three events a step)
            handler = _HANDLERS[(self.record.status, type(event))]
        except KeyError:
            if self.record.status.terminal and type(event) in _TERMINAL_CONFLICTS:
                raise RunTerminal(
                    f"run {self.record.run_id} is {self.record.status.value}") from None
            raise IllegalTransition(
                f"{type(event).__name__} is not allowed when run {self.record.run_id} "
                f"is {self.record.status.value}"
            ) from None
        tr = handler(self, event, now_ms)
        self.record.updated_at = now_ms
        return tr


    # ------------------------------------------------------------------ status view

    def status_view(self) -> dict[str, Any]:
        """The run status exactly as WORKFLOWS.md "Run status" shows it."""
        r = self.record
        f = r.frame
        return {
            "run_id": r.run_id,
            "workflow": r.workflow,
            "status": r.status.text,
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
            "forked_from": None if r.forked_from is None else {
                "run_id": r.forked_from["run_id"], "step_id": r.forked_from["step_id"]},
        }



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
    (R, SessionChanged): ("_on_session_changed", (R, F)),
    (W, SessionChanged): ("_on_session_changed", (W, F)),
    (S, SessionChanged): ("_on_session_changed", (S, F)),
    (W, ChildFinished): ("_on_child_ignored", (W,)),
    (S, ChildFinished): ("_on_child_ignored", (S,)),
    (F, Retry): ("_on_retry", _NEXT),
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
for _s in (R, W, S, C, X, T):
    TRANSITIONS[(_s, Retry)] = ("_retry_refused", ())  # 409 not_retryable: only failed runs
del _s, _ev

#: Events that, on a terminal run, are the caller's race with the run's end
#: rather than a bug: they get `RunTerminal` (409 run_terminal).
_TERMINAL_CONFLICTS = frozenset({
    AttemptOffered, AttemptStarted, AttemptCompleted, AttemptFailed, AttemptLost,
    AttemptOrphaned, AttemptRevived, AttemptReleased, AttemptUnservable, SignalReceived, Cancel,
    InternalFailure, SessionChanged,
})


def _stale_attempt(self: RunMachine, ev: Any, now: int) -> Transition:
    raise Fenced(f"step {ev.step_id!r} is not the run's current step")


RunMachine._stale_attempt = _stale_attempt  # type: ignore[attr-defined]

#: `TRANSITIONS` with each handler looked up once: `handle` runs on every event.
_HANDLERS: dict[tuple[RunStatus, type], Callable[[RunMachine, Any, int], Transition]] = {
    key: getattr(RunMachine, name) for key, (name, _) in TRANSITIONS.items()
}


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

