"""Local steps, the pure half: which local steps follow a task step, and their records.

AFFINITY.md "Local steps": a task step marked ``"local": true`` runs inside the
worker that holds the task step before it, with no round trip. Two wire shapes
cross the protocol, both decided in docs/affinity.md:

* the *plan*, in the parent's lease (``lease.local_steps``, with the run's
  input as ``lease.run_input``), built by `local_plan` from the definition
  alone, so the daemon and the SDK agree on it without sharing any state;
* the *records*, in the parent's ``complete`` (``local_steps``), parsed by
  `parse_records` into `LocalRecord` values the run machine journals.

Nothing here does I/O; the daemon (run machine) and the SDK both import it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .definition import END, Definition, TaskStep
from .errors import Invalid

__all__ = ["MAX_LOCAL_STEPS", "LocalAttempt", "LocalRecord", "local_plan", "local_span_id",
           "parse_records"]

#: The most local steps one parent's completion may carry: a chain longer than
#: this runs its rest as ordinary leases (the plan stops there).
MAX_LOCAL_STEPS: Final = 32

_RECORD_KEYS: Final = frozenset({"step_id", "input", "retry", "timeout_ms", "total_timeout_ms",
                                 "attempts", "progress", "output", "error", "state_patch",
                                 "usage", "spans"})
_ATTEMPT_KEYS: Final = frozenset({"attempt", "started_ms", "ended_ms", "output", "error"})


@dataclass(frozen=True, slots=True)
class LocalAttempt:
    """One attempt of a local body as the worker reports it (times on the worker's clock)."""

    attempt: int
    started_ms: int
    ended_ms: int
    output: Any = None
    error_class: str | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class LocalRecord:
    """One local step run to its end inside the worker: what the daemon journals."""

    step_id: str
    input: Any
    attempts: tuple[LocalAttempt, ...]
    output: Any = None
    error_class: str | None = None
    message: str = ""
    progress: Any = None
    state_patch: dict[str, Any] | None = None
    retry: Any = None
    timeout_ms: int | None = None
    total_timeout_ms: int | None = None
    #: The body's usage and spans, as a ``complete`` carries them (validated and
    #: priced by the daemon before the run machine sees them: `stepd.sansio.pricing`).
    usage: dict[str, Any] | None = None
    spans: tuple[dict[str, Any], ...] = ()


def local_span_id(lease_id: str, step_id: str) -> str:
    """The span id (16 hex digits) of local step `step_id` run under parent lease `lease_id`.

    Derived, not stored: the lease plan hands it to the worker (so a local body's
    spans name it as their parent) and the trace builder finds the same id from
    the journal. Unique per lease: a plan never holds a step twice.
    """
    return hashlib.sha256(f"{lease_id}/local/{step_id}".encode()).hexdigest()[:16]


def _following(definition: Definition, step: TaskStep) -> int | None:
    """The index the run goes to after `step` when its output does not jump."""
    target = step.next
    if target is None:
        index = definition.index_of(step.id) + 1
        return index if index < len(definition.steps) else None
    if target == END:
        return None
    return definition.index_of(target)


def local_plan(definition: Definition, step_id: str) -> list[dict[str, Any]]:
    """The local steps that follow task step `step_id` (its lease's ``local_steps``).

    The chain follows each step's static ``_next_step`` (or the next step) while
    the step there is a local task step; it stops at anything else, at a step
    already in the chain (a loop), and after `MAX_LOCAL_STEPS`. A local step or
    a for_each item never carries a plan: only an ordinary task step does.

    Returns:
        One entry per step in order: ``step_id``, ``body``, ``input`` (the
        template, rendered by the worker), ``retry``, ``timeout_ms``,
        ``total_timeout_ms``, ``cost_units``. Empty when none follows.
    """
    step = definition.step(step_id)
    if not isinstance(step, TaskStep) or step.local:
        return []
    plan: list[dict[str, Any]] = []
    seen = {step.id}
    index = _following(definition, step)
    while index is not None and len(plan) < MAX_LOCAL_STEPS:
        nxt = definition.steps[index]
        if not isinstance(nxt, TaskStep) or not nxt.local or nxt.id in seen:
            break
        seen.add(nxt.id)
        wire = nxt.to_json()
        plan.append({"step_id": nxt.id, "body": nxt.body, "input": wire["input"],
                     "retry": wire["retry"], "timeout_ms": nxt.timeout_ms,
                     "total_timeout_ms": nxt.total_timeout_ms, "cost_units": nxt.cost_units})
        index = _following(definition, nxt)
    return plan


# --- the records ---------------------------------------------------------------------


def _int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Invalid("must be an integer >= 0", field=field)
    return value


def _error(value: Any, field: str) -> tuple[str, str]:
    if not isinstance(value, Mapping):
        raise Invalid('must be {"class": ..., "message": ...}', field=field)
    unknown = set(value) - {"class", "message"}
    if unknown:
        raise Invalid(f"unknown field {min(unknown)!r}", field=field)
    cls = value.get("class")
    if not isinstance(cls, str) or not cls or len(cls) > 128:
        raise Invalid("must be a non-empty string", field=f"{field}.class")
    message = value.get("message", "")
    if not isinstance(message, str):
        raise Invalid("must be a string", field=f"{field}.message")
    return cls, message


def _attempt(raw: Any, field: str, expected: int) -> LocalAttempt:
    if not isinstance(raw, Mapping):
        raise Invalid("must be an object", field=field)
    unknown = set(raw) - _ATTEMPT_KEYS
    if unknown:
        raise Invalid(f"unknown field {min(unknown)!r}", field=field)
    number = _int(raw.get("attempt"), f"{field}.attempt")
    if number != expected:
        raise Invalid(f"must be {expected}: attempts are numbered 1, 2, ... in order",
                      field=f"{field}.attempt")
    started = _int(raw.get("started_ms", 0), f"{field}.started_ms")
    ended = _int(raw.get("ended_ms", started), f"{field}.ended_ms")
    if raw.get("error") is not None:
        if "output" in raw and raw["output"] is not None:
            raise Invalid("an attempt has an output or an error, not both", field=field)
        cls, message = _error(raw["error"], f"{field}.error")
        return LocalAttempt(number, started, ended, None, cls, message)
    return LocalAttempt(number, started, ended, raw.get("output"))


def _record(raw: Any, field: str) -> LocalRecord:
    if not isinstance(raw, Mapping):
        raise Invalid("must be an object", field=field)
    unknown = set(raw) - _RECORD_KEYS
    if unknown:
        raise Invalid(f"unknown field {min(unknown)!r}", field=field)
    step_id = raw.get("step_id")
    if not isinstance(step_id, str) or not step_id:
        raise Invalid("must be a step id", field=f"{field}.step_id")
    attempts_raw = raw.get("attempts")
    if not isinstance(attempts_raw, list) or not attempts_raw:
        raise Invalid("must be a non-empty array", field=f"{field}.attempts")
    attempts = tuple(_attempt(a, f"{field}.attempts[{i}]", i + 1)
                     for i, a in enumerate(attempts_raw))
    for i, a in enumerate(attempts[:-1]):
        if a.error_class is None:
            raise Invalid("only the last attempt may succeed", field=f"{field}.attempts[{i}]")
    last = attempts[-1]
    usage = raw.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise Invalid("must be an object or null", field=f"{field}.usage")
    spans = raw.get("spans")
    if spans is not None and (not isinstance(spans, list)
                              or not all(isinstance(x, dict) for x in spans)):
        raise Invalid("must be an array of objects", field=f"{field}.spans")
    body_spans = tuple(spans or ())
    patch = raw.get("state_patch")
    if patch is not None and not isinstance(patch, dict):
        raise Invalid("must be an object or null", field=f"{field}.state_patch")
    error = raw.get("error")
    if error is not None:
        cls, message = _error(error, f"{field}.error")
        if last.error_class is None:
            raise Invalid("the terminal error must be the last attempt's", field=f"{field}.error")
        if patch:
            raise Invalid("a failed local step patches no state", field=f"{field}.state_patch")
        return LocalRecord(step_id, raw.get("input"), attempts, None, cls, message,
                           raw.get("progress"), None, raw.get("retry"), raw.get("timeout_ms"),
                           raw.get("total_timeout_ms"), usage, body_spans)
    if last.error_class is not None:
        raise Invalid("the last attempt failed: the record needs its terminal error",
                      field=f"{field}.error")
    output = raw.get("output", last.output)
    if output != last.output:
        raise Invalid("the terminal output must be the last attempt's", field=f"{field}.output")
    return LocalRecord(step_id, raw.get("input"), attempts, output, None, "",
                       raw.get("progress"), patch, raw.get("retry"), raw.get("timeout_ms"),
                       raw.get("total_timeout_ms"), usage, body_spans)


def parse_records(raw: Any, *, field: str = "local_steps") -> tuple[LocalRecord, ...]:
    """Validate a completion's ``local_steps`` (AFFINITY.md "Local steps").

    Each record names its step, lists its attempts numbered from 1 (every one
    but the last failed), and ends in exactly one terminal outcome: ``output``
    (the last attempt's) or ``error`` (the last attempt's error). Whether the
    steps are the ones the run goes on to is the run machine's check.

    Raises:
        Invalid: naming the field (``local_steps[1].attempts[0].attempt``).
    """
    if not isinstance(raw, list):
        raise Invalid("must be an array", field=field)
    if len(raw) > MAX_LOCAL_STEPS:
        raise Invalid(f"at most {MAX_LOCAL_STEPS} local steps per completion", field=field)
    return tuple(_record(r, f"{field}[{i}]") for i, r in enumerate(raw))
