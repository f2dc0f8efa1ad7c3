"""Workflow definitions, the model: frozen dataclasses and their wire form.

`stepd.sansio.definition` is the public face (with the parser, `_parse`); see
its docstring.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from stepd.sansio.canonical import filled_definition_hash
from stepd.sansio.enums import IdentityEnum
from stepd.sansio.session_spec import SessionSpec
from stepd.sansio.templates import Renderer, compile_render

END: Final = "$end"
"""The `_next_step` target that ends the run (WORKFLOWS.md "Transitions")."""

MAX_NAME_BYTES: Final = 128
"""Longest step id, name, body, event, ``into`` key or version label, in UTF-8 bytes.

They end up inside storage keys and idempotency keys (``run_id/step_id``); LMDB
keys are at most 511 bytes, so an unbounded id would be refused by storage after
the definition had been accepted.
"""

_STEP_ID = re.compile(r"[A-Za-z0-9_-]+\Z")


class StepKind(IdentityEnum):
    """What a step does (WORKFLOWS.md "Step kinds")."""

    TASK = "task"
    FOR_EACH = "for_each"
    WAIT = "wait"
    SLEEP = "sleep"
    START_WORKFLOWS = "start_workflows"


class Delivery(IdentityEnum):
    """Whether a body may run again after a lost lease.

    ``at_most_once``: the daemon persists ``started`` before answering it and never
    re-offers a started attempt (PROTOCOL.md ``started``).
    """

    AT_LEAST_ONCE = "at_least_once"
    AT_MOST_ONCE = "at_most_once"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a failing body is retried (WORKFLOWS.md "Definition", task options).

    Attributes:
        max_attempts: attempts in total, the first included (>= 1; 1 = no retry).
        initial_backoff_ms: delay before the second attempt (>= 0).
        backoff_factor: each later delay is the previous times this (>= 1.0).
        max_backoff_ms: cap on any delay (>= 0).
        retry_on: error classes retried besides ``retryable`` (the SDK's
            ``Retryable``); any other class is final.
    """

    max_attempts: int = 3
    initial_backoff_ms: int = 200
    backoff_factor: float = 2.0
    max_backoff_ms: int = 30000
    retry_on: tuple[str, ...] = ()

    def backoff_ms(self, attempt: int) -> int:
        """The delay before attempt ``attempt + 1`` after attempt ``attempt`` failed.

        ``min(max_backoff_ms, initial_backoff_ms * backoff_factor ** (attempt - 1))``,
        rounded down to whole milliseconds; a product too large for a float is
        capped like any other.

        Args:
            attempt: the 1-based number of the attempt that failed.

        Raises:
            ValueError: ``attempt`` < 1.
        """
        if attempt < 1:
            raise ValueError(f"attempt is 1-based, got {attempt}")
        try:
            delay = self.initial_backoff_ms * self.backoff_factor ** (attempt - 1)
        except OverflowError:
            return self.max_backoff_ms
        if delay >= self.max_backoff_ms:
            return self.max_backoff_ms
        return int(delay)

    def retries(self, error_class: str) -> bool:
        """Whether a failure of class ``error_class`` is retried (budget permitting)."""
        return error_class == "retryable" or error_class in self.retry_on

    def to_json(self) -> dict[str, Any]:
        """The wire form, every field present."""
        return {
            "max_attempts": self.max_attempts,
            "initial_backoff_ms": self.initial_backoff_ms,
            "backoff_factor": float(self.backoff_factor),
            "max_backoff_ms": self.max_backoff_ms,
            "retry_on": list(self.retry_on),
        }


_DEFAULT_RETRY: Final = RetryPolicy()


@dataclass(frozen=True, slots=True)
class TaskStep:
    """One body on one worker, with retries.

    ``input`` is a JSON value that may hold templates; ``next`` is the static jump
    (wire ``_next_step``): a step id, `END`, or None for "the following step".
    """

    kind: ClassVar[StepKind] = StepKind.TASK

    id: str
    body: str
    input: Any = "${input}"
    retry: RetryPolicy = _DEFAULT_RETRY
    timeout_ms: int | None = None
    delivery: Delivery = Delivery.AT_LEAST_ONCE
    cost_units: int = 1
    next: str | None = None
    session: str | None = None  # a worker session of the definition (docs/affinity.md)
    local: bool = False
    total_timeout_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The wire form, every default present.

        ``session`` appears only when set, ``local`` and ``total_timeout_ms``
        only on a local step, so the ``definition_hash`` of every definition
        without sessions or local steps is what it was before they existed
        (docs/affinity.md).
        """
        out = {
            "id": self.id,
            "kind": self.kind.value,
            "body": self.body,
            "input": _copy_json(self.input),
            "retry": self.retry.to_json(),
            "timeout_ms": self.timeout_ms,
            "delivery": self.delivery.value,
            "cost_units": self.cost_units,
            "_next_step": self.next,
        }
        if self.session is not None:
            out["session"] = self.session
        if self.local:
            out["local"] = True
            out["total_timeout_ms"] = self.total_timeout_ms
        return out


@dataclass(frozen=True, slots=True)
class ForEachStep:
    """One attempt per item of the list at ``items``, outputs collected in order.

    ``items`` is a list (whose elements may hold templates) or an exact template
    string (``"${state.tasks}"``). ``max_parallel`` None means no limit. The task
    options apply to each item; ``input`` defaults to the item.
    """

    kind: ClassVar[StepKind] = StepKind.FOR_EACH

    id: str
    body: str
    items: Any
    into: str | None = None
    max_parallel: int | None = None
    input: Any = "${item}"
    retry: RetryPolicy = _DEFAULT_RETRY
    timeout_ms: int | None = None
    delivery: Delivery = Delivery.AT_LEAST_ONCE
    cost_units: int = 1
    next: str | None = None
    session: str | None = None  # a worker session of the definition (AFFINITY.md)

    def to_json(self) -> dict[str, Any]:
        """The wire form, every default present (``session`` only when set)."""
        out = {
            "id": self.id,
            "kind": self.kind.value,
            "body": self.body,
            "items": _copy_json(self.items),
            "into": self.into,
            "max_parallel": self.max_parallel,
            "input": _copy_json(self.input),
            "retry": self.retry.to_json(),
            "timeout_ms": self.timeout_ms,
            "delivery": self.delivery.value,
            "cost_units": self.cost_units,
            "_next_step": self.next,
        }
        if self.session is not None:
            out["session"] = self.session
        return out


@dataclass(frozen=True, slots=True)
class WaitStep:
    """Waits for a signal named ``event``; its payload is the output and ``state[into]``."""

    kind: ClassVar[StepKind] = StepKind.WAIT

    id: str
    event: str
    timeout_ms: int | None = None
    into: str | None = None
    next: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The wire form, every default present."""
        return {
            "id": self.id,
            "kind": self.kind.value,
            "event": self.event,
            "timeout_ms": self.timeout_ms,
            "into": self.into,
            "_next_step": self.next,
        }


@dataclass(frozen=True, slots=True)
class SleepStep:
    """A durable timer of ``duration_ms`` (0 is allowed: a yield point)."""

    kind: ClassVar[StepKind] = StepKind.SLEEP

    id: str
    duration_ms: int
    next: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The wire form, every default present."""
        return {
            "id": self.id,
            "kind": self.kind.value,
            "duration_ms": self.duration_ms,
            "_next_step": self.next,
        }


@dataclass(frozen=True, slots=True)
class StartWorkflowsStep:
    """Starts one child run of ``workflow`` per item (input = item).

    ``version`` None starts the most recently registered version. With ``wait``
    the step completes when every child has, its output being their results in
    item order (also written to ``state[into]``).
    """

    kind: ClassVar[StepKind] = StepKind.START_WORKFLOWS

    id: str
    workflow: str
    items: Any
    version: str | None = None
    wait: bool = True
    into: str | None = None
    next: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The wire form, every default present."""
        return {
            "id": self.id,
            "kind": self.kind.value,
            "workflow": self.workflow,
            "items": _copy_json(self.items),
            "version": self.version,
            "wait": self.wait,
            "into": self.into,
            "_next_step": self.next,
        }


Step = TaskStep | ForEachStep | WaitStep | SleepStep | StartWorkflowsStep

STEP_TYPES: Final[Mapping[StepKind, type[Step]]] = {
    StepKind.TASK: TaskStep,
    StepKind.FOR_EACH: ForEachStep,
    StepKind.WAIT: WaitStep,
    StepKind.SLEEP: SleepStep,
    StepKind.START_WORKFLOWS: StartWorkflowsStep,
}
"""The step class of each kind."""

BUDGET_NAMES: Final = (
    "max_transitions",
    "max_for_each_items",
    "max_state_bytes",
    "max_cost_units",
    "max_started_workflows",
)
"""The five budgets (WORKFLOWS.md "Budgets"), in the order the status view lists them."""


@dataclass(frozen=True, slots=True)
class Budgets:
    """Per-run limits; None means unlimited, each limit >= 0 (WORKFLOWS.md "Budgets")."""

    max_transitions: int | None = None
    max_for_each_items: int | None = None
    max_state_bytes: int | None = None
    max_cost_units: int | None = None
    max_started_workflows: int | None = None

    def limits(self) -> dict[str, int | None]:
        """Every budget by name, None for unlimited (the status view's ``budget.limits``)."""
        return {
            "max_transitions": self.max_transitions,
            "max_for_each_items": self.max_for_each_items,
            "max_state_bytes": self.max_state_bytes,
            "max_cost_units": self.max_cost_units,
            "max_started_workflows": self.max_started_workflows,
        }


_NO_BUDGETS: Final = Budgets()


@dataclass(frozen=True, slots=True)
class Definition:
    """A validated workflow definition.

    Attributes:
        name: the workflow name runs are started by.
        steps: the steps, in order (non-empty, unique ids).
        version: the application's label (``"research.v2"``); not part of the hash.
        budgets: the run's limits.
        deadline_ms: how long a run may take in total, or None.

    Treat ``input``/``items`` values as read-only: they are plain JSON containers
    inside a frozen object.
    """

    name: str
    steps: tuple[Step, ...]
    version: str | None = None
    budgets: Budgets = _NO_BUDGETS
    deadline_ms: int | None = None
    #: Worker sessions by name (AFFINITY.md "Worker sessions"); empty: none.
    sessions: Mapping[str, SessionSpec] = field(default_factory=dict)
    _index: dict[str, int] = field(init=False, repr=False, compare=False, default_factory=dict)
    _hash: str | None = field(init=False, repr=False, compare=False, default=None)
    #: Whether any budget is set: a run of a definition without one checks none
    #: on each step (set from `budgets`).
    budgeted: bool = field(init=False, repr=False, compare=False, default=False)
    #: Each step's ``input`` rendering, compiled at its first use (`input_renderer`).
    _renderers: dict[str, Renderer] = field(init=False, repr=False, compare=False,
                                            default_factory=dict)

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        for position, step in enumerate(self.steps):
            index.setdefault(step.id, position)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "budgeted",
                           any(v is not None for v in self.budgets.limits().values()))

    def __hash__(self) -> int:
        # The generated hash would hash every step's `input`, which may be a dict.
        # Not `definition_hash` either: `==` compares fields the Python way
        # (1 == 1.0 == True in an input) while the hash of the JSON tells them
        # apart, and equal objects must hash alike. To ask "same structure?",
        # compare `definition_hash` (and `version`).
        return hash((self.name, self.version, tuple(step.id for step in self.steps)))

    def step(self, step_id: str) -> Step:
        """The step with id ``step_id``.

        Raises:
            KeyError: no step has that id.
        """
        return self.steps[self._index[step_id]]

    def input_renderer(self, step_id: str) -> Renderer:
        """How step ``step_id``'s ``input`` renders (`templates.compile_render`): compiled
        once per definition, since every run of it renders the same templates.

        Raises:
            KeyError: no step has that id.
            Invalid: its input holds a malformed template (parsed definitions never do).
        """
        fn = self._renderers.get(step_id)
        if fn is None:
            step = self.steps[self._index[step_id]]
            fn = self._renderers[step_id] = compile_render(getattr(step, "input", None))
        return fn

    def index_of(self, step_id: str) -> int:
        """The 0-based position of step ``step_id``.

        Raises:
            KeyError: no step has that id.
        """
        return self._index[step_id]

    def successor(self, step_id: str) -> str:
        """Where the run goes when step ``step_id`` completes without a dynamic jump.

        Its static ``_next_step`` if set, else the following step, else `END`
        (WORKFLOWS.md "Transitions": steps run in order). A task output's
        ``_next_step`` overrides this at run time.

        Raises:
            KeyError: no step has that id.
        """
        position = self._index[step_id]
        static = self.steps[position].next
        if static is not None:
            return static
        if position + 1 < len(self.steps):
            return self.steps[position + 1].id
        return END

    def to_json(self) -> dict[str, Any]:
        """The wire form with every default filled in, ``version`` included.

        `parse_definition` of the result equals this definition, and the result is
        what `definition_hash` is computed over (without ``version``).
        """
        out: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "steps": [step.to_json() for step in self.steps],
            "budgets": self.budgets.limits(),
            "deadline_ms": self.deadline_ms,
        }
        if self.sessions:  # absent when empty: older definitions keep their hash
            out["sessions"] = {name: spec.to_json() for name, spec in self.sessions.items()}
        return out

    @property
    def definition_hash(self) -> str:
        """SHA-256 hex of the canonical filled JSON without ``version`` (cached).

        WORKFLOWS.md "version and definition_hash".
        """
        cached = self._hash
        if cached is None:
            cached = filled_definition_hash(self.to_json())
            object.__setattr__(self, "_hash", cached)
        return cached




def _copy_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copy_json(child) for key, child in value.items()}
    if isinstance(value, list):
        return [_copy_json(child) for child in value]
    return value

