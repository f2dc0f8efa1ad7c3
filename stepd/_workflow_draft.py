"""What a `stepd.Workflow` has gathered, and what is read from it.

The builder's state (its steps so far, budgets, deadline, sessions, and the
callables by body name), the one door a step comes in by (`_add`: it is
checked by the daemon's own step parser, and a refused step leaves the
builder as it was), and the view the worker and the client read once it is
built (`definition`, `to_json`, `definition_hash`, `bodies`). The chainable
vocabulary that turns arguments into steps is `stepd.workflow.Workflow`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

from stepd.sansio.definition import Definition, parse_definition, parse_step
from stepd.sansio.durations import Duration, parse_duration
from stepd.sansio.errors import Invalid

__all__ = ["BodyFn", "WorkflowDraft"]

BodyFn = Callable[..., Any]


class WorkflowDraft:
    """The definition a builder holds: its parts so far, each checked as it came in.

    Args:
        name: the workflow name runs are started by.
        version: the application's label (``"support.v2"``), or None.

    Raises:
        Invalid: ``name`` or ``version`` is not a non-empty string.
    """

    __slots__ = (
        "_bodies",
        "_budgets",
        "_cached",
        "_deadline_ms",
        "_ids",
        "_name",
        "_sessions",
        "_steps",
        "_version",
    )

    def __init__(self, name: str, version: str | None = None) -> None:
        # The daemon's parser checks the name and version; with no steps yet the
        # only other complaint it can have is the empty step list.
        probe: dict[str, Any] = {"name": name, "version": version, "steps": []}
        try:
            parse_definition(probe)
        except Invalid as exc:
            if exc.field != "steps":
                raise
        self._name = name
        self._version = version
        self._steps: list[dict[str, Any]] = []
        self._ids: dict[str, int] = {}
        self._bodies: dict[str, BodyFn] = {}
        self._budgets: dict[str, int | None] = {}
        self._deadline_ms: int | None = None
        self._sessions: dict[str, dict[str, Any]] = {}
        self._cached: Definition | None = None

    def __repr__(self) -> str:
        return f"Workflow({self._name!r}, version={self._version!r}, steps={list(self._ids)!r})"

    # --- what is read from it ---------------------------------------------------------

    @property
    def name(self) -> str:
        """The workflow name."""
        return self._name

    @property
    def version(self) -> str | None:
        """The application's version label, or None."""
        return self._version

    @property
    def definition(self) -> Definition:
        """The definition, validated by the daemon's own parser (cached until changed).

        Raises:
            Invalid: what only the whole definition shows: no steps, a ``next=``
                naming no step, a template naming a step that does not exist.
        """
        if self._cached is None:
            self._cached = parse_definition(self._raw())
        return self._cached

    def to_json(self) -> dict[str, Any]:
        """The wire form with every default filled in (what ``register`` sends).

        Raises:
            Invalid: as `definition`.
        """
        return self.definition.to_json()

    @property
    def definition_hash(self) -> str:
        """The definition's hash, as the daemon computes it.

        Raises:
            Invalid: as `definition`.
        """
        return self.definition.definition_hash

    @property
    def bodies(self) -> dict[str, BodyFn]:
        """Body name -> callable, for the worker (a copy; string bodies are absent)."""
        return dict(self._bodies)

    # --- the parts, and the door a step comes in by ------------------------------------

    def _raw(self) -> dict[str, Any]:
        raw: dict[str, Any] = {"name": self._name, "version": self._version, "steps": self._steps}
        if self._budgets:
            raw["budgets"] = self._budgets
        if self._deadline_ms is not None:
            raw["deadline_ms"] = self._deadline_ms
        if self._sessions:
            raw["sessions"] = self._sessions
        return raw

    def _fail(self, message: str, field: str) -> Invalid:
        return Invalid(message, field=field, definition=self._name)

    def _duration(
        self, value: Duration | None, index: int, arg: str, *, allow_zero: bool = False
    ) -> int | None:
        if value is None and not allow_zero:  # an optional timeout left out
            return None
        try:
            return parse_duration(value, field=f"steps[{index}].{arg}", allow_zero=allow_zero)
        except Invalid as exc:
            raise exc.with_location(definition=self._name) from None

    def _add(self, raw: dict[str, Any], body_name: str | None, fn: BodyFn | None) -> Self:
        index = len(self._steps)
        try:
            step = parse_step(raw, index=index)
        except Invalid as exc:
            if exc.field == f"steps[{index}].id" and raw.get("kind") != "sleep":
                raise Invalid(
                    f"{exc.message}; pass id= to name this step",
                    field=exc.field,
                    definition=self._name,
                ) from None
            raise exc.with_location(definition=self._name) from None
        if step.id in self._ids:
            raise self._fail(
                f"duplicate step id {step.id!r} (already used by steps[{self._ids[step.id]}]); "
                "pass id= to give this step another id",
                f"steps[{index}].id",
            )
        if fn is not None and body_name is not None:
            existing = self._bodies.get(body_name)
            if existing is not None and existing is not fn:
                raise self._fail(
                    f"body name {body_name!r} is already bound to {existing!r}; "
                    "give one of them another name with @stepd.body(name=...)",
                    f"steps[{index}].body",
                )
        # Nothing above changed the builder: a refused call leaves it as it was.
        self._steps.append(step.to_json())
        self._ids[step.id] = index
        if fn is not None and body_name is not None:
            self._bodies[body_name] = fn
        self._cached = None
        return self
