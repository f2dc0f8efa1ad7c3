"""The run machine's base layer: its state, limits, and what every handler uses.

`RunMachine` (`run.py`) is built in layers, each its own module and class so
no class holds the whole machine: `_RunBase` (state, journal, budgets,
endings) <- `_RunSessions` (`_run_sessions.py`: worker sessions) <-
`_RunSteps` (`_run_steps.py`: entering steps, retries, timers) <-
`_RunLocal` (`_run_local.py`: local steps' lease plan and records) <-
`_RunAttempts` (`_run_attempts.py`: one handler per attempt event: the offer,
the worker's calls, the lease's news) <- `_RunEvents` (`_run_events.py`: one
handler per run-level event: signals, ticks, children, cancel, retry) <-
`RunMachine` (`run.py`: creation, queries, the dispatch table, the status view).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .canonical import state_bytes as canonical_state_bytes
from .definition import (
    Definition,
    ForEachStep,
    Step,
    TaskStep,
)
from .errors import Fenced, IllegalTransition, Invalid, TemplateError
from .events import (
    AttemptSpec,
    CancelChildren,
    EndLeases,
    NotifyParent,
    RunEnded,
    Transition,
    Withdraw,
)
from .record import Frame, RunRecord, Slot, slot_key
from .session_spec import work_session_id
from .status import LIVE_PHASES, ErrorReason, RunStatus, SlotPhase
from .sticky import track
from .templates import MISSING, TemplateContext

Resolver = Callable[[str, "str | None"], "Definition | None"]

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


_ISO: dict[int, str] = {}
_ISO_MAX = 4096
"""The last formatted times: a run's status view formats its ``created_at`` and
``updated_at`` on every read (a start's answer, each long-poll wake-up of its
result), three C calls each; a hit is none. Cleared when full (bounded)."""


def iso_ms(ms: int) -> str:
    """Epoch milliseconds as ISO 8601 UTC with milliseconds (pure: no clock read)."""
    if ms in _ISO:
        return _ISO[ms]
    text = (
        _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )
    if len(_ISO) >= _ISO_MAX:
        _ISO.clear()
    _ISO[ms] = text
    return text


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



class _RunBase:
    """The run machine's state and the helpers every layer uses (journal, budgets, endings)."""

    __slots__ = ("_trace_id", "definition", "max_depth", "record", "resolve")

    def __init__(
        self,
        record: RunRecord,
        definition: Definition,
        resolve: Resolver | None = None,
        *,
        max_depth: int = DEFAULT_MAX_CHILD_DEPTH,
    ) -> None:
        # The cached hash read directly (`definition_hash` is a property: a Python call
        # per machine built, several per run); computed once by the property.
        if (definition._hash or definition.definition_hash) != record.definition_hash:
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
        self._trace_id: str | None = None  # `trace_id`, hashed once per run, not per lease

    @property
    def trace_id(self) -> str:
        """The run's trace id (`trace_id_for`), which every lease of it carries."""
        tid = self._trace_id
        if tid is None:
            tid = self._trace_id = trace_id_for(self.record.run_id)
        return tid

    # ------------------------------------------------------------------ helpers

    def _journal(self, tr: Transition, now: int, type_: str, **fields: Any) -> None:
        self.record.seq += 1
        entry = {"seq": self.record.seq, "type": type_, "at": now}
        for k in fields:  # noqa: PLC0206 - by key: no `items()` call (four entries a step)
            v = fields[k]
            if v is not None:
                entry[k] = v
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
        if TYPE_CHECKING:  # only these have attempts; no isinstance at run time, per offer
            assert isinstance(step, (TaskStep, ForEachStep))
        session = pinned = None
        if step.session is not None:  # AFFINITY.md "Worker sessions": only to the holder
            entry = r.sessions.get(step.session)
            session = work_session_id(r.run_id, step.session)
            if entry is not None and entry["status"] == "held":
                pinned = entry["holder"]
        prefer = until = None
        hold = None if r.sticky is None else r.sticky["hold"]
        if hold is not None and session is None and isinstance(step, TaskStep) \
                and slot.queued_at is not None:
            # AFFINITY.md "Sticky execution": the worker that ran the previous step
            # first, for its sticky_schedule_ms, then anyone (a session's step goes
            # to the session's holder: sessions route, sticky only prefers).
            prefer, until = hold["w"], slot.queued_at + hold["ms"]
        return AttemptSpec(
            run_id=r.run_id,
            workflow=r.workflow,
            version=r.version,
            definition_hash=r.definition_hash,
            step_id=step.id,
            body=step.body,
            item_index=slot.item_index,
            attempt=slot.attempt,
            delivery=step.delivery.text,
            timeout_ms=step.timeout_ms,
            idempotency_key=key,
            excluded_workers=tuple(slot.excluded),
            session=session,
            pinned=pinned,
            prefer=prefer,
            prefer_until=until,
        )

    def _slot(self, step_id: str, item_index: int | None) -> tuple[Frame, Slot]:
        f = self.record.frame
        if f is None or f.step_id != step_id:
            raise Fenced(f"step {step_id!r} is not the run's current step")
        for slot in f.slots:  # `Frame.slot`, inlined: every attempt event looks its slot up
            if slot.item_index == item_index:
                return f, slot
        raise Fenced(f"slot {slot_key(step_id, item_index)} has no attempt in flight")

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
        """The first budget `values` breach, or None. Callers skip it for a definition
        without budgets (`Definition.budgeted`): the common case, on every step."""
        budgets = self.definition.budgets
        for name, value in values.items():
            if value is None:
                continue
            limit = getattr(budgets, name)
            if limit is not None and value > limit:
                return (name, limit, value)
        return None

    def _add_usage(self, usage: Mapping[str, Any] | None) -> None:
        """Add a step's priced usage (a completion's, or a local step's) to the run's totals.

        Saturating: a total past what storage holds would fail every write of
        the run (the transport bounds each report; this bounds the sum).
        """
        if not usage:
            return
        r = self.record
        r.input_tokens = min(r.input_tokens + int(usage.get("input_tokens") or 0),
                             MAX_TOKEN_TOTAL)
        r.output_tokens = min(r.output_tokens + int(usage.get("output_tokens") or 0),
                              MAX_TOKEN_TOTAL)
        cost = r.cost_usd + float(usage.get("cost_usd") or 0.0)
        r.cost_usd = cost if math.isfinite(cost) else r.cost_usd

    def _history_set(self, kind: str, key: str, old: Any, new: Any) -> None:
        """A history entry was written (steps or state): keep the sticky cursor current."""
        sticky = self.record.sticky
        if sticky is not None:
            track(sticky, kind, key, old, new, self.record.seq)

    @staticmethod
    def _size(state: Any) -> int:
        return canonical_state_bytes(state)


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
        tr.effects.append(RunEnded(r.run_id, status.text))
        if r.parent is not None:
            tr.effects.append(NotifyParent(r.parent["run_id"], r.run_id))

