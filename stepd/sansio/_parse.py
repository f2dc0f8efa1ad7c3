"""Workflow definitions, the parser: strict, naming the definition and the field.

`stepd.sansio.definition` is the public face; see its docstring.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeVar

from stepd.sansio.errors import Invalid, field_path
from stepd.sansio.session_spec import parse_sessions
from stepd.sansio.templates import iter_templates, parse_template

from ._model import (
    _DEFAULT_RETRY,
    _NO_BUDGETS,
    _STEP_ID,
    BUDGET_NAMES,
    END,
    MAX_NAME_BYTES,
    Budgets,
    Definition,
    Delivery,
    ForEachStep,
    RetryPolicy,
    SleepStep,
    StartWorkflowsStep,
    Step,
    StepKind,
    TaskStep,
    WaitStep,
)

# --- parsing -----------------------------------------------------------------------

_TOP_KEYS: Final = ("name", "version", "steps", "budgets", "deadline_ms", "sessions")
_RETRY_KEYS: Final = (
    "max_attempts",
    "initial_backoff_ms",
    "backoff_factor",
    "max_backoff_ms",
    "retry_on",
)
_STEP_KEYS: Final[Mapping[StepKind, tuple[str, ...]]] = {
    StepKind.TASK: (
        "id",
        "kind",
        "body",
        "input",
        "retry",
        "timeout_ms",
        "delivery",
        "cost_units",
        "_next_step",
        "session",
        "local",
        "total_timeout_ms",
    ),
    StepKind.FOR_EACH: (
        "id",
        "kind",
        "body",
        "items",
        "into",
        "max_parallel",
        "input",
        "retry",
        "timeout_ms",
        "delivery",
        "cost_units",
        "_next_step",
        "session",
    ),
    StepKind.WAIT: ("id", "kind", "event", "timeout_ms", "into", "_next_step"),
    StepKind.SLEEP: ("id", "kind", "duration_ms", "_next_step"),
    StepKind.START_WORKFLOWS: (
        "id",
        "kind",
        "workflow",
        "items",
        "version",
        "wait",
        "into",
        "_next_step",
    ),
}
_STEP_REQUIRED: Final[Mapping[StepKind, tuple[str, ...]]] = {
    StepKind.TASK: ("body",),
    StepKind.FOR_EACH: ("body", "items"),
    StepKind.WAIT: ("event",),
    StepKind.SLEEP: ("duration_ms",),
    StepKind.START_WORKFLOWS: ("workflow", "items"),
}
_KINDS: Final = ", ".join(kind.value for kind in StepKind)
_DELIVERIES: Final = ", ".join(d.value for d in Delivery)


def parse_definition(obj: Any) -> Definition:
    """Validate a definition in wire form and build the `Definition`.

    Strict and total (docs/definitions.md "Validation"): unknown keys at any
    level, missing or mistyped fields (a ``bool`` is not an integer), values out
    of range, bad or duplicate step ids, a ``_next_step`` to a step that does not
    exist, templates that do not parse or name an unknown root or step. Fields
    are checked in wire order, steps in list order, and the first problem is
    raised.

    Args:
        obj: the decoded JSON object (a ``Mapping``); not modified, and nothing of
            it is shared with the result.

    Returns:
        The definition, every default filled in.

    Raises:
        Invalid: the first problem found, with ``definition`` set to the name
            when the name itself is valid, and ``field`` the dotted path
            (``steps[2].retry.max_attempts``, ``budgets.max_cost_units``,
            ``steps[0]._next_step``).
    """
    if not isinstance(obj, Mapping):
        raise Invalid(f"a definition must be a JSON object, got {_show(obj)}")
    raw_name = obj.get("name")
    name = raw_name if _is_name(raw_name) else None
    try:
        return _parse_definition(obj)
    except Invalid as exc:
        if exc.definition is None and name is not None:
            raise exc.with_location(definition=name) from None
        raise


def _parse_definition(obj: Mapping[str, Any]) -> Definition:
    if "name" not in obj:
        raise Invalid("is required", field="name")
    name = _name(obj["name"], "name")
    _check_keys(obj, _TOP_KEYS, "")
    version = _optional_name(obj.get("version"), "version")
    if "steps" not in obj:
        raise Invalid("is required", field="steps")
    raw_steps = obj["steps"]
    if not isinstance(raw_steps, (list, tuple)):
        raise Invalid(f"must be a list of steps, got {_show(raw_steps)}", field="steps")
    if not raw_steps:
        raise Invalid("must hold at least one step", field="steps")
    known_ids = frozenset(
        s["id"] for s in raw_steps if isinstance(s, Mapping) and isinstance(s.get("id"), str)
    )
    steps: list[Step] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_steps):
        step = parse_step(raw, index=index, known_ids=known_ids)
        first = seen.setdefault(step.id, index)
        if first != index:
            raise Invalid(
                f"duplicate step id {step.id!r} (already used by steps[{first}])",
                field=f"steps[{index}].id",
            )
        steps.append(step)
    budgets = parse_budgets(obj["budgets"]) if "budgets" in obj else _NO_BUDGETS
    deadline_ms = _optional_int(obj.get("deadline_ms"), "deadline_ms", minimum=1, maximum=MAX_DURATION_MS)
    sessions = parse_sessions(obj["sessions"]) if "sessions" in obj else {}
    for index, step in enumerate(steps):
        wanted = getattr(step, "session", None)
        if wanted is not None and wanted not in sessions:
            raise Invalid(f"names no session of this definition's sessions block: {wanted!r}",
                          field=f"steps[{index}].session")
    return Definition(
        name=name,
        steps=tuple(steps),
        version=version,
        budgets=budgets,
        deadline_ms=deadline_ms,
        sessions=sessions,
    )


def parse_step(obj: Any, *, index: int, known_ids: frozenset[str] | None = None) -> Step:
    """Validate one step in wire form.

    Used by `parse_definition`, and by the builder to refuse a bad step at the
    call that adds it.

    Args:
        obj: the step object.
        index: its position, for field paths (``steps[<index>].…``).
        known_ids: every step id of the definition, to check ``_next_step`` and
            ``steps.<id>`` template references; None skips those two checks
            (the builder, before the definition is complete).

    Returns:
        The step, every default filled in.

    Raises:
        Invalid: the first problem, ``field`` starting with ``steps[<index>]``;
            ``definition`` is not set.
    """
    where = f"steps[{index}]"
    if not isinstance(obj, Mapping):
        raise Invalid(f"a step must be a JSON object, got {_show(obj)}", field=where)
    if "id" not in obj:
        raise Invalid("is required", field=f"{where}.id")
    step_id = _step_id(obj["id"], f"{where}.id")
    if "kind" not in obj:
        raise Invalid(f"is required; one of {_KINDS}", field=f"{where}.kind")
    kind = _enum(StepKind, obj["kind"], f"{where}.kind", _KINDS)
    _check_keys(obj, _STEP_KEYS[kind], where)
    for key in _STEP_REQUIRED[kind]:
        if key not in obj:
            raise Invalid(f"is required for a {kind.value} step", field=f"{where}.{key}")
    refs = _Refs(known_ids)
    if kind is StepKind.TASK:
        return TaskStep(
            id=step_id,
            body=_name(obj["body"], f"{where}.body"),
            input=refs.json(obj.get("input", "${input}"), f"{where}.input", item=False),
            retry=_retry(obj, where),
            timeout_ms=_optional_int(obj.get("timeout_ms"), f"{where}.timeout_ms", minimum=1, maximum=MAX_DURATION_MS),
            delivery=_delivery(obj, where),
            cost_units=_cost_units(obj, where),
            next=refs.next(obj.get("_next_step"), f"{where}._next_step"),
            session=_optional_name(obj.get("session"), f"{where}.session"),
            **_local_options(obj, where),
        )
    if kind is StepKind.FOR_EACH:
        return ForEachStep(
            id=step_id,
            body=_name(obj["body"], f"{where}.body"),
            items=refs.items(obj["items"], f"{where}.items"),
            into=_optional_name(obj.get("into"), f"{where}.into"),
            max_parallel=_optional_int(obj.get("max_parallel"), f"{where}.max_parallel", minimum=1),
            input=refs.json(obj.get("input", "${item}"), f"{where}.input", item=True),
            retry=_retry(obj, where),
            timeout_ms=_optional_int(obj.get("timeout_ms"), f"{where}.timeout_ms", minimum=1, maximum=MAX_DURATION_MS),
            delivery=_delivery(obj, where),
            cost_units=_cost_units(obj, where),
            next=refs.next(obj.get("_next_step"), f"{where}._next_step"),
            session=_optional_name(obj.get("session"), f"{where}.session"),
        )
    if kind is StepKind.WAIT:
        return WaitStep(
            id=step_id,
            event=_name(obj["event"], f"{where}.event"),
            timeout_ms=_optional_int(obj.get("timeout_ms"), f"{where}.timeout_ms", minimum=1, maximum=MAX_DURATION_MS),
            into=_optional_name(obj.get("into"), f"{where}.into"),
            next=refs.next(obj.get("_next_step"), f"{where}._next_step"),
        )
    if kind is StepKind.SLEEP:
        return SleepStep(
            id=step_id,
            duration_ms=_int(obj["duration_ms"], f"{where}.duration_ms", minimum=0, maximum=MAX_DURATION_MS),
            next=refs.next(obj.get("_next_step"), f"{where}._next_step"),
        )
    return StartWorkflowsStep(
        id=step_id,
        workflow=_name(obj["workflow"], f"{where}.workflow"),
        items=refs.items(obj["items"], f"{where}.items"),
        version=_optional_name(obj.get("version"), f"{where}.version"),
        wait=_bool(obj.get("wait", True), f"{where}.wait"),
        into=_optional_name(obj.get("into"), f"{where}.into"),
        next=refs.next(obj.get("_next_step"), f"{where}._next_step"),
    )


class _Refs:
    """Checks of what a step refers to: jump targets and template paths."""

    __slots__ = ("known_ids",)

    def __init__(self, known_ids: frozenset[str] | None) -> None:
        self.known_ids = known_ids

    def next(self, value: Any, where: str) -> str | None:
        if value is None:
            return None
        if value == END:
            return END
        target = _step_id(value, where, what="a step id or '$end'")
        if self.known_ids is not None and target not in self.known_ids:
            raise Invalid(f"no step has id {target!r} (write '$end' to end the run)", field=where)
        return target

    def json(self, value: Any, where: str, *, item: bool) -> Any:
        """A JSON value whose templates parse and name known roots and steps.

        Args:
            item: whether ``item``/``item_index`` are defined where it renders
                (only a for_each's per-item ``input``).
        """
        copied = _json_value(value, where)
        for template_field, template in iter_templates(copied, where):
            for path in template.paths:
                if path.root in ("item", "item_index") and not item:
                    raise Invalid(
                        f"'${{{path.text}}}': {path.root!r} is only defined in a "
                        "for_each step's input",
                        field=template_field,
                    )
                step_id = path.step_id
                if (
                    step_id is not None
                    and self.known_ids is not None
                    and step_id not in self.known_ids
                ):
                    raise Invalid(
                        f"'${{{path.text}}}': no step has id {step_id!r}", field=template_field
                    )
        return copied

    def items(self, value: Any, where: str) -> Any:
        """A list (elements may hold templates) or one exact template string."""
        if isinstance(value, (list, tuple)):
            return self.json(value, where, item=False)
        if isinstance(value, str) and "$" in value:
            copied = self.json(value, where, item=False)
            if parse_template(value).exact is not None:
                return copied
        raise Invalid(
            f"must be a list or a single template such as '${{state.tasks}}', got {_show(value)}",
            field=where,
        )


def _retry(obj: Mapping[str, Any], where: str) -> RetryPolicy:
    if "retry" not in obj:
        return _DEFAULT_RETRY
    return parse_retry(obj["retry"], field=f"{where}.retry")


def parse_retry(obj: Any, *, field: str = "retry") -> RetryPolicy:
    """Validate a ``retry`` object in wire form; omitted keys take their defaults.

    Args:
        obj: the object (``{"max_attempts": 5}``).
        field: its path, for errors (``steps[1].retry``).

    Raises:
        Invalid: not an object, an unknown key, or a value out of range
            (``max_attempts`` >= 1, backoffs >= 0, ``backoff_factor`` a finite
            number >= 1.0, ``retry_on`` a list of distinct non-empty strings).
    """
    where = field
    if not isinstance(obj, Mapping):
        raise Invalid(f"must be an object, got {_show(obj)}", field=where)
    raw: Mapping[str, Any] = obj
    _check_keys(raw, _RETRY_KEYS, where)
    default = _DEFAULT_RETRY
    max_attempts = _int(
        raw.get("max_attempts", default.max_attempts), f"{where}.max_attempts", minimum=1
    )
    initial = _int(
        raw.get("initial_backoff_ms", default.initial_backoff_ms),
        f"{where}.initial_backoff_ms",
        minimum=0,
        maximum=MAX_DURATION_MS,
    )
    factor = raw.get("backoff_factor", default.backoff_factor)
    if (
        isinstance(factor, bool)
        or not isinstance(factor, (int, float))
        or not math.isfinite(factor)
        or factor < 1.0
    ):
        raise Invalid(
            f"must be a finite number >= 1.0, got {_show(factor)}",
            field=f"{where}.backoff_factor",
        )
    max_backoff = _int(
        raw.get("max_backoff_ms", default.max_backoff_ms), f"{where}.max_backoff_ms", minimum=0,
        maximum=MAX_DURATION_MS,
    )
    retry_on = _retry_on(raw.get("retry_on", []), f"{where}.retry_on")
    return RetryPolicy(
        max_attempts=max_attempts,
        initial_backoff_ms=initial,
        backoff_factor=float(factor),
        max_backoff_ms=max_backoff,
        retry_on=retry_on,
    )


def _retry_on(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise Invalid(f"must be a list of error class names, got {_show(value)}", field=where)
    classes: list[str] = []
    for position, entry in enumerate(value):
        name = _name(entry, f"{where}[{position}]")
        if name in classes:
            raise Invalid(f"duplicate error class {name!r}", field=f"{where}[{position}]")
        classes.append(name)
    return tuple(classes)


def _delivery(obj: Mapping[str, Any], where: str) -> Delivery:
    if "delivery" not in obj:
        return Delivery.AT_LEAST_ONCE
    return _enum(Delivery, obj["delivery"], f"{where}.delivery", _DELIVERIES)


def _cost_units(obj: Mapping[str, Any], where: str) -> int:
    if "cost_units" not in obj:
        return 1
    return _int(obj["cost_units"], f"{where}.cost_units", minimum=0)


def parse_budgets(obj: Any) -> Budgets:
    """Validate a ``budgets`` object in wire form; omitted budgets are unlimited.

    Raises:
        Invalid: not an object, an unknown budget name (``field`` names it:
            ``budgets.max_cost``), or a limit that is not an integer >= 0 or null.
    """
    if not isinstance(obj, Mapping):
        raise Invalid(f"must be an object, got {_show(obj)}", field="budgets")
    _check_keys(obj, BUDGET_NAMES, "budgets")
    limits = {
        name: _optional_int(obj.get(name), f"budgets.{name}", minimum=0) for name in BUDGET_NAMES
    }
    return Budgets(**limits)


# --- field checks --------------------------------------------------------------------


def _check_keys(obj: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise Invalid(
                f"unknown key; expected one of {', '.join(allowed)}",
                field=field_path(where, str(key)),
            )


def _is_name(value: Any) -> bool:
    return (
        isinstance(value, str)
        and value != ""
        and len(value.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
    )


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or value == "":
        raise Invalid(f"must be a non-empty string, got {_show(value)}", field=where)
    if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise Invalid(f"must be at most {MAX_NAME_BYTES} bytes of UTF-8", field=where)
    return value


def _optional_name(value: Any, where: str) -> str | None:
    return None if value is None else _name(value, where)


def _step_id(value: Any, where: str, *, what: str = "a step id") -> str:
    if isinstance(value, str) and value.startswith("$"):
        raise Invalid(
            f"must be {what}; ids may not start with '$' (reserved for '$end'), got {value!r}",
            field=where,
        )
    if not isinstance(value, str) or _STEP_ID.match(value) is None:
        raise Invalid(
            f"must be {what}: a non-empty string of letters, digits, '_' and '-', "
            f"got {_show(value)}",
            field=where,
        )
    if len(value) > MAX_NAME_BYTES:
        raise Invalid(f"must be at most {MAX_NAME_BYTES} characters", field=where)
    return value


#: The longest duration a definition may name (timeouts, sleeps, backoff,
#: deadlines): ten years in milliseconds. Beyond it a due time stops being a
#: date anyone can print, and a deadline that far is a mistake, not a plan.
MAX_DURATION_MS: Final = 10 * 365 * 24 * 3600 * 1000
#: Every other integer fits the storage codec (msgpack: 64 bits).
MAX_INT: Final = 2**63 - 1


def _int(value: Any, where: str, *, minimum: int, maximum: int = MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise Invalid(f"must be an integer >= {minimum}, got {_show(value)}", field=where)
    if value > maximum:
        raise Invalid(f"must be at most {maximum}, got {_show(value)}", field=where)
    return int(value)


def _local_options(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A task's ``local`` and ``total_timeout_ms`` (AFFINITY.md "Local steps").

    A local body may run again when its worker is lost before the daemon
    commits the parent's completion, so ``at_most_once`` cannot be local; the
    total timeout bounds all attempts of one local step and means nothing to
    an ordinary lease, so it needs ``local``. A local step runs in the worker
    of the step before it, never routed, so it cannot belong to a worker
    session (whose steps go to the session's holder).
    """
    local = _bool(obj.get("local", False), f"{where}.local")
    total = _optional_int(obj.get("total_timeout_ms"), f"{where}.total_timeout_ms", minimum=1,
                          maximum=MAX_DURATION_MS)
    if total is not None and not local:
        raise Invalid("needs \"local\": true", field=f"{where}.total_timeout_ms")
    if local and obj.get("delivery") == Delivery.AT_MOST_ONCE.value:
        raise Invalid("a local step may run again after a lost worker: it must be at_least_once",
                      field=f"{where}.delivery")
    if local and obj.get("session") is not None:
        raise Invalid("a local step runs where the step before it ran: it cannot be pinned "
                      "to a worker session's holder", field=f"{where}.session")
    return {"local": local, "total_timeout_ms": total}


def _optional_int(value: Any, where: str, *, minimum: int, maximum: int = MAX_INT) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise Invalid(f"must be an integer >= {minimum} or null, got {_show(value)}", field=where)
    if value > maximum:
        raise Invalid(f"must be at most {maximum}, got {_show(value)}", field=where)
    return int(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false, got {_show(value)}", field=where)
    return value


_E = TypeVar("_E", bound=enum.Enum)


def _enum(cls: type[_E], value: Any, where: str, choices: str) -> _E:
    if isinstance(value, str):
        try:
            return cls(value)
        except ValueError:
            pass
    raise Invalid(f"must be one of {choices}, got {_show(value)}", field=where)


def _json_value(value: Any, where: str) -> Any:
    """A private copy of a JSON value, refusing what JSON cannot carry (naming where)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid(f"must be JSON: {value!r} is not a JSON number", field=where)
        return value
    if isinstance(value, Mapping):
        copied: dict[str, Any] = {}
        for key, child in value.items():
            if not isinstance(key, str):
                raise Invalid(f"must be JSON: object key {key!r} is not a string", field=where)
            copied[key] = _json_value(child, field_path(where, key))
        return copied
    if isinstance(value, (list, tuple)):
        return [_json_value(child, f"{where}[{i}]") for i, child in enumerate(value)]
    raise Invalid(f"must be JSON: {type(value).__name__} is not a JSON type", field=where)


def _show(value: Any) -> str:
    """A short JSON-ish rendering of a bad value for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
