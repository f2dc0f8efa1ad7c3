"""The Python builder for workflow definitions (WORKFLOWS.md "Python SDK shape").

::

    support = (
        stepd.Workflow("support", version="support.v2")
        .then(classify)                                    # step id = body name
        .then(draft, retry=stepd.Retry(max_attempts=5), timeout="2m")
        .for_each("${state.tasks}", execute_task, into="results", max_parallel=4)
        .wait("approved", timeout="1h", into="approval")
        .then(send, delivery="at_most_once")
        .budget(max_transitions=20, max_cost_units=40)
    )

The builder writes the wire form (docs/definitions.md) and validates each step
at the call that adds it, so a mistake points at the line that made it. Its
`Workflow.definition` goes through `parse_definition`, the daemon's own parser,
so the builder cannot produce a definition the daemon would refuse, and the
`definition_hash` it reports is the one the daemon computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, TypeVar, overload

from stepd._workflow_draft import BodyFn, WorkflowDraft
from stepd.sansio.definition import (
    BUDGET_NAMES,
    MAX_NAME_BYTES,
    Delivery,
    RetryPolicy,
    parse_budgets,
    parse_retry,
)
from stepd.sansio.durations import Duration, parse_duration
from stepd.sansio.errors import Invalid
from stepd.sansio.session_spec import parse_sessions

__all__ = ["BodyConfig", "Retry", "Workflow", "body", "body_config"]

_F = TypeVar("_F", bound=BodyFn)

_BODY_ATTR: Final = "__stepd_body__"


@dataclass(frozen=True, slots=True)
class BodyConfig:
    """SDK configuration a body carries, set by `body`.

    Attributes:
        name: the body name workers register and leases carry; None means the
            callable's ``__name__``.
        cost_units: the cost units steps running this body count by default
            (a positive integer), or None for the ordinary default of 1.
    """

    name: str | None = None
    cost_units: int | None = None


@overload
def body(fn: _F, /) -> _F: ...


@overload
def body(
    fn: None = None, /, *, name: str | None = None, cost_units: int | None = None
) -> Callable[[_F], _F]: ...


def body(
    fn: _F | None = None, /, *, name: str | None = None, cost_units: int | None = None
) -> _F | Callable[[_F], _F]:
    """Declare a step body's SDK configuration: ``@stepd.body`` or ``@stepd.body(...)``.

    The callable is returned unchanged (it stays a plain function you can call
    and test); the configuration rides on it as an attribute.

    Args:
        fn: the body, when used without arguments.
        name: the body name, if not the function's ``__name__``.
        cost_units: what one run of this body costs (WORKFLOWS.md "Budgets": a
            body may declare a higher *positive* value; only a step definition's
            own ``cost_units=`` may set 0).

    Raises:
        Invalid: ``name`` is not a non-empty string, or ``cost_units`` is not an
            integer >= 1 (``field`` is ``name`` / ``cost_units``).
    """
    if name is not None and (
        not isinstance(name, str)
        or name == ""
        or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
    ):
        raise Invalid(
            f"must be a non-empty string of at most {MAX_NAME_BYTES} bytes, got {name!r}",
            field="name",
        )
    if cost_units is not None and (
        isinstance(cost_units, bool) or not isinstance(cost_units, int) or cost_units < 1
    ):
        raise Invalid(
            f"a body may declare only an integer >= 1, got {cost_units!r} "
            "(only a step's own cost_units= may be 0)",
            field="cost_units",
        )
    config = BodyConfig(name=name, cost_units=cost_units)

    def decorate(target: _F) -> _F:
        if not callable(target):
            raise Invalid(f"@stepd.body decorates a callable, got {target!r}")
        setattr(target, _BODY_ATTR, config)
        return target

    return decorate(fn) if fn is not None else decorate


def body_config(fn: BodyFn) -> BodyConfig:
    """The configuration `body` set on ``fn``, or the defaults if none."""
    config = getattr(fn, _BODY_ATTR, None)
    return config if isinstance(config, BodyConfig) else BodyConfig()


def Retry(
    max_attempts: int = 3,
    initial_backoff: Duration = 200,
    backoff_factor: float = 2.0,
    max_backoff: Duration = "30s",
    retry_on: Iterable[str] = (),
) -> RetryPolicy:
    """A retry policy, with durations in any form `parse_duration` takes.

    Args:
        max_attempts: attempts in total, the first included (>= 1).
        initial_backoff: delay before the second attempt (>= 0).
        backoff_factor: each later delay is the previous times this (>= 1.0).
        max_backoff: cap on any delay (>= 0).
        retry_on: error classes retried besides ``retryable``.

    Returns:
        The validated `RetryPolicy`.

    Raises:
        Invalid: a value out of range; ``field`` is ``retry.<wire name>``.
    """
    classes: Any = retry_on if isinstance(retry_on, str) else list(retry_on)
    return parse_retry(
        {
            "max_attempts": max_attempts,
            "initial_backoff_ms": parse_duration(
                initial_backoff, field="retry.initial_backoff", allow_zero=True
            ),
            "backoff_factor": backoff_factor,
            "max_backoff_ms": parse_duration(
                max_backoff, field="retry.max_backoff", allow_zero=True
            ),
            "retry_on": classes,
        },
        field="retry",
    )


class Workflow(WorkflowDraft):
    """A chainable builder of one workflow definition.

    Every adding method returns the builder itself. A step is validated when it
    is added (``Invalid`` names ``steps[<n>].<field>`` and the workflow);
    references to steps added later (``next=``, ``${steps.<id>}``) are checked
    by `definition`.

    What it has gathered, the door a step comes in by and what the worker reads
    are `WorkflowDraft`'s; this class turns each call's arguments into a part.

    Args:
        name: the workflow name runs are started by.
        version: the application's label (``"support.v2"``), or None.

    Raises:
        Invalid: ``name`` or ``version`` is not a non-empty string.
    """

    __slots__ = ()

    # --- adding steps -----------------------------------------------------------

    def then(
        self,
        body: BodyFn | str,
        *,
        id: str | None = None,
        input: Any = "${input}",
        retry: RetryPolicy | None = None,
        timeout: Duration | None = None,
        delivery: Delivery | str = Delivery.AT_LEAST_ONCE,
        cost_units: int | None = None,
        next: str | None = None,
        session: str | None = None,
        local: bool = False,
        total_timeout: Duration | None = None,
    ) -> Workflow:
        """Add a task step: one body on one worker, with retries.

        Args:
            body: the body callable (its body name is `body`'s ``name=`` or its
                ``__name__``) or a body name.
            id: the step id; defaults to the body name.
            input: the body's input, a JSON value that may hold templates.
            retry: a `Retry` policy; None for the defaults.
            timeout: how long one attempt may run (a duration); None for no limit
                beyond the lease.
            delivery: ``"at_least_once"`` or ``"at_most_once"``.
            cost_units: this step's cost units (>= 0); None takes the body's
                declared value, else 1.
            next: the step to go to after this one (a step id or ``"$end"``).
            session: a worker session declared with `session` (its steps all go
                to the worker holding it; docs/affinity.md).
            local: run this step inside the worker that ran the task step before
                it, with no round trip (AFFINITY.md "Local steps"; only on a
                worker started with ``local_steps=True``, else an ordinary lease).
            total_timeout: a local step's limit over all its attempts.

        Raises:
            Invalid: a bad argument, a duplicate step id, or another callable
                already registered under the same body name.
        """
        index = len(self._steps)
        body_name, fn = self._body(body, index)
        raw: dict[str, Any] = {
            "id": body_name if id is None else id,
            "kind": "task",
            "body": body_name,
            "input": input,
            "delivery": _delivery(delivery),
            "cost_units": self._cost_units(cost_units, fn),
        }
        self._task_options(raw, retry, timeout, next, index)
        if session is not None:
            raw["session"] = session
        if local or total_timeout is not None:
            raw["local"] = local
            raw["total_timeout_ms"] = self._duration(total_timeout, index, "total_timeout")
        return self._add(raw, body_name, fn)

    def for_each(
        self,
        items: Any,
        body: BodyFn | str,
        *,
        id: str | None = None,
        into: str | None = None,
        max_parallel: int | None = None,
        input: Any = "${item}",
        retry: RetryPolicy | None = None,
        timeout: Duration | None = None,
        delivery: Delivery | str = Delivery.AT_LEAST_ONCE,
        cost_units: int | None = None,
        next: str | None = None,
        session: str | None = None,
    ) -> Workflow:
        """Add a for_each step: one attempt of ``body`` per item of ``items``.

        Args:
            items: a template naming a list (``"${state.tasks}"``) or a list.
            body: as in `then`.
            id: the step id; defaults to the body name.
            into: the state key the list of item outputs is written to.
            max_parallel: at most this many items at once (>= 1); None for no limit.
            input: each item's input; defaults to the item (``"${item}"``, and
                ``${item_index}`` is the item's 0-based index).
            retry, timeout, delivery, cost_units, next, session: as in `then`, per
                item (``cost_units`` counts once per item; a session's
                ``max_concurrent`` bounds the items in flight).

        Raises:
            Invalid: as in `then`.
        """
        index = len(self._steps)
        body_name, fn = self._body(body, index)
        raw: dict[str, Any] = {
            "id": body_name if id is None else id,
            "kind": "for_each",
            "body": body_name,
            "items": items,
            "into": into,
            "max_parallel": max_parallel,
            "input": input,
            "delivery": _delivery(delivery),
            "cost_units": self._cost_units(cost_units, fn),
        }
        self._task_options(raw, retry, timeout, next, index)
        if session is not None:
            raw["session"] = session
        return self._add(raw, body_name, fn)

    def wait(
        self,
        event: str,
        *,
        id: str | None = None,
        timeout: Duration | None = None,
        into: str | None = None,
        next: str | None = None,
    ) -> Workflow:
        """Add a wait step: the run waits for a signal named ``event``.

        Args:
            event: the signal name.
            id: the step id; defaults to the event name.
            timeout: fail the run with ``wait_timeout`` after this long; None waits
                for ever (the run's deadline still applies).
            into: the state key the signal's payload is written to.
            next: as in `then`.

        Raises:
            Invalid: a bad argument or a duplicate step id.
        """
        index = len(self._steps)
        raw: dict[str, Any] = {
            "id": event if id is None else id,
            "kind": "wait",
            "event": event,
            "timeout_ms": self._duration(timeout, index, "timeout"),
            "into": into,
            "_next_step": next,
        }
        return self._add(raw, None, None)

    def sleep(
        self,
        duration: Duration,
        *,
        id: str | None = None,
        next: str | None = None,
    ) -> Workflow:
        """Add a sleep step: a durable timer.

        Args:
            duration: how long (0 is allowed).
            id: the step id; defaults to the first free of ``sleep``, ``sleep_2``,
                ``sleep_3``...
            next: as in `then`.

        Raises:
            Invalid: a bad duration or a duplicate step id.
        """
        index = len(self._steps)
        if id is None:
            id = "sleep"
            counter = 1
            while id in self._ids:
                counter += 1
                id = f"sleep_{counter}"
        raw: dict[str, Any] = {
            "id": id,
            "kind": "sleep",
            "duration_ms": self._duration(duration, index, "duration", allow_zero=True),
            "_next_step": next,
        }
        return self._add(raw, None, None)

    def start_workflows(
        self,
        workflow: str | Workflow,
        items: Any,
        *,
        id: str | None = None,
        version: str | None = None,
        wait: bool = True,
        into: str | None = None,
        next: str | None = None,
    ) -> Workflow:
        """Add a start_workflows step: one child run of ``workflow`` per item.

        Args:
            workflow: the child workflow's name, or its builder.
            items: the children's inputs: a template naming a list, or a list.
            id: the step id; defaults to the child workflow's name.
            version: the child version to start; None starts the most recently
                registered one, except that a `Workflow` given as ``workflow``
                pins its own version.
            wait: complete only when every child has, collecting their results
                in item order.
            into: the state key the results are written to.
            next: as in `then`.

        Raises:
            Invalid: a bad argument or a duplicate step id.
        """
        if isinstance(workflow, Workflow):
            name = workflow.name
            if version is None:
                version = workflow.version
        else:
            name = workflow
        raw: dict[str, Any] = {
            "id": name if id is None else id,
            "kind": "start_workflows",
            "workflow": name,
            "items": items,
            "version": version,
            "wait": wait,
            "into": into,
            "_next_step": next,
        }
        return self._add(raw, None, None)

    # --- whole-definition options ------------------------------------------------

    def budget(self, **limits: int | None) -> Workflow:
        """Set run budgets by name (WORKFLOWS.md "Budgets"); None lifts a limit.

        Calls accumulate: a later value for the same budget replaces the earlier.

        Raises:
            Invalid: a name that is not one of the five budgets (``field``
                ``budgets.<name>``), or a limit that is not an integer >= 0.
        """
        merged = {**self._budgets, **limits}
        try:
            parse_budgets(merged)
        except Invalid as exc:
            if exc.field is not None and exc.field.startswith("budgets."):
                key = exc.field[len("budgets.") :]
                if key not in BUDGET_NAMES:
                    raise Invalid(
                        f"unknown budget {key!r}; expected one of {', '.join(BUDGET_NAMES)}",
                        field=exc.field,
                        definition=self._name,
                    ) from None
            raise exc.with_location(definition=self._name) from None
        self._budgets = merged
        self._cached = None
        return self

    def session(self, name: str, *, requirements: dict[str, Any] | None = None,
                queue: str | None = None, lease_ms: int | None = None,
                ttl_ms: int | None = None, max_concurrent: int | None = None,
                reacquire: str | None = None) -> Workflow:
        """Declare a worker session (the definition's ``sessions`` block; AFFINITY.md):
        steps given ``session=name`` run on one worker whose resources match
        ``requirements``. Omitted options take the daemon's defaults.

        Raises:
            Invalid: a bad option (``field`` ``sessions.<name>.<option>``).
        """
        spec: dict[str, Any] = {"requirements": dict(requirements or {})}
        for key, value in (("queue", queue), ("lease_ms", lease_ms), ("ttl_ms", ttl_ms),
                           ("max_concurrent", max_concurrent), ("reacquire", reacquire)):
            if value is not None:
                spec[key] = value
        try:
            parse_sessions({**self._sessions, name: spec})
        except Invalid as exc:
            raise exc.with_location(definition=self._name) from None
        self._sessions[name] = spec
        self._cached = None
        return self

    def deadline(self, duration: Duration | None) -> Workflow:
        """Bound each run's total duration (``deadline_ms``); None removes the bound.

        Raises:
            Invalid: not a positive duration.
        """
        if duration is None:
            self._deadline_ms = None
        else:
            try:
                self._deadline_ms = parse_duration(duration, field="deadline")
            except Invalid as exc:
                raise exc.with_location(definition=self._name) from None
        self._cached = None
        return self

    # --- arguments into parts ---------------------------------------------------------

    def _body(self, body: BodyFn | str, index: int) -> tuple[str, BodyFn | None]:
        if isinstance(body, str):
            return body, None
        if not callable(body):
            raise self._fail(
                f"must be a callable or a body name, got {body!r}", f"steps[{index}].body"
            )
        name = body_config(body).name or getattr(body, "__name__", None)
        if not isinstance(name, str) or not name or name == "<lambda>":
            raise self._fail(
                f"{body!r} has no usable name; decorate it with @stepd.body(name=...)",
                f"steps[{index}].body",
            )
        return name, body

    def _cost_units(self, explicit: int | None, fn: BodyFn | None) -> int:
        if explicit is not None:
            return explicit  # the step parser checks it (>= 0)
        if fn is not None:
            declared = body_config(fn).cost_units
            if declared is not None:
                return declared
        return 1

    def _task_options(
        self,
        raw: dict[str, Any],
        retry: RetryPolicy | None,
        timeout: Duration | None,
        next: str | None,
        index: int,
    ) -> None:
        if retry is not None:
            if not isinstance(retry, RetryPolicy):
                raise self._fail(
                    f"must be a stepd.Retry(...) policy, got {retry!r}", f"steps[{index}].retry"
                )
            raw["retry"] = retry.to_json()
        raw["timeout_ms"] = self._duration(timeout, index, "timeout")
        raw["_next_step"] = next


def _delivery(value: Delivery | str) -> Any:
    return value.value if isinstance(value, Delivery) else value
