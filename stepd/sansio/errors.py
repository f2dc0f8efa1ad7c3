"""stepd's error hierarchy, shared by the engine, the daemon and the SDK.

The hierarchy is closed and documented here (STYLE.md rule 15)::

    StepdError                 root of every error stepd raises on purpose
    +-- Invalid                bad input, naming the offending field (HTTP 400)
    +-- TemplateError          a template path that does not resolve at render time
    |                          (the step fails with class ``template``, not retried)
    +-- Conflict               one of PROTOCOL.md's four 409 reasons, as `reason`:
    |   +-- AlreadyApplied     ``already_applied``
    |   +-- Fenced             ``fenced``
    |   +-- RunTerminal        ``run_terminal``
    |   +-- NotStarted         ``not_started``
    |   +-- NotRetryable       ``not_retryable``: a retry the run refuses (it is not
    |                          failed, it failed on a budget, its deadline passed)
    +-- IllegalTransition      an event a state machine's table does not allow in
    |                          the current state; nothing was changed
    +-- NotFound               an unknown run, lease or worker (HTTP 404)
    +-- Unprocessable          a well-formed request the state does not allow, such as
    |                          starting an unknown workflow (HTTP 422)
    +-- Unavailable            the daemon cannot serve this now: shutting down, or an
                               actor is being restarted (HTTP 503); retry

Other modules add their own subclasses of `StepdError` (closed and broken
channels); each keeps to one meaning so the wire reasons stay stable.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

__all__ = [
    "AlreadyApplied",
    "Conflict",
    "Fenced",
    "IllegalTransition",
    "Invalid",
    "NotFound",
    "NotRetryable",
    "NotStarted",
    "RunTerminal",
    "StepdError",
    "TemplateError",
    "Unavailable",
    "Unprocessable",
    "field_path",
]


class StepdError(Exception):
    """Root of stepd's errors."""


class Invalid(StepdError):
    """Bad input, refused before anything is applied.

    Attributes:
        message: what is wrong, without the location (e.g. ``must be an integer >= 1``).
        field: the dotted path of the offending field, e.g.
            ``steps[2].retry.max_attempts``, or None when the input as a whole is bad.
        definition: the definition name when known, so a ``register`` carrying many
            definitions says which one was refused (PROTOCOL.md ``register``: "400
            naming the definition and the field").

    ``str(exc)`` reads ``definition 'support': steps[2].retry.max_attempts: must be
    an integer >= 1``; the parts that are unknown are left out.
    """

    def __init__(
        self, message: str, *, field: str | None = None, definition: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.definition = definition

    def __str__(self) -> str:
        parts = []
        if self.definition is not None:
            parts.append(f"definition {self.definition!r}")
        if self.field is not None:
            parts.append(self.field)
        parts.append(self.message)
        return ": ".join(parts)

    def __repr__(self) -> str:
        return f"Invalid({self.message!r}, field={self.field!r}, definition={self.definition!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles only `args`; keep the keyword-only location too, so an
        # error crossing a process boundary still names its field.
        return (_rebuild_invalid, (self.message, self.field, self.definition))

    def with_location(self, *, field: str | None = None, definition: str | None = None) -> Invalid:
        """A copy that fills in the location this error did not know yet.

        A field given here is the *outer* path: ``Invalid("x", field="a")`` with
        ``field="steps[0].input"`` becomes ``steps[0].input.a``. Used where a helper
        (template parsing, duration parsing) raises without knowing where its input
        sits in the definition.

        Returns:
            A new `Invalid`; the original is left unchanged.
        """
        inner = self.field
        if field is None:
            merged = inner
        elif inner is None:
            merged = field
        elif inner.startswith("["):
            merged = field + inner
        else:
            merged = f"{field}.{inner}"
        return Invalid(
            self.message,
            field=merged,
            definition=definition if definition is not None else self.definition,
        )


def _rebuild_invalid(message: str, field: str | None, definition: str | None) -> Invalid:
    return Invalid(message, field=field, definition=definition)


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")


def field_path(parent: str, key: str | int) -> str:
    """The dotted path of ``key`` inside the field ``parent``.

    ``field_path("steps[1].input", "a")`` is ``steps[1].input.a``; list positions
    and keys that are not plain identifiers use brackets:
    ``field_path("steps", 2)`` is ``steps[2]``, ``field_path("input", "a b")`` is
    ``input['a b']``. An empty ``parent`` is the root.
    """
    if isinstance(key, int):
        return f"{parent}[{key}]"
    if _PLAIN_KEY.match(key) is None:
        return f"{parent}[{key!r}]"
    return f"{parent}.{key}" if parent else key


class TemplateError(StepdError):
    """A template path that does not resolve at render time.

    The run fails the step with class ``template`` (not retried) and the message
    says which path (WORKFLOWS.md "Templates").

    Attributes:
        message: why the path does not resolve.
        path: the template path text, e.g. ``state.tasks`` (without ``${`` ``}``).
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return f"${{{self.path}}}: {self.message}"

    def __repr__(self) -> str:
        return f"TemplateError({self.message!r}, path={self.path!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_template_error, (self.message, self.path))


def _rebuild_template_error(message: str, path: str) -> TemplateError:
    return TemplateError(message, path=path)


class Conflict(StepdError):
    """A well-formed call the current state refuses (PROTOCOL.md "The four rejections").

    Attributes:
        reason: the stable wire reason, one per subclass.
        message: what happened, for people.
    """

    reason: ClassVar[str] = "conflict"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class AlreadyApplied(Conflict):
    """An earlier ``complete``/``fail`` of this same lease arrived; its answer was lost."""

    reason = "already_applied"


class Fenced(Conflict):
    """A later attempt exists, or another lease ended this step."""

    reason = "fenced"


class RunTerminal(Conflict):
    """The run is over (completed, failed, timed out, cancelled)."""

    reason = "run_terminal"


class NotStarted(Conflict):
    """``complete``/``fail`` of an ``at_most_once`` attempt whose ``started`` never arrived."""

    reason = "not_started"


class NotRetryable(Conflict):
    """A retry the run refuses: it is not failed, it failed on a budget (``budget``
    names it: a retry would breach it again), or its deadline has passed.

    Not one of PROTOCOL.md's four worker rejections: only the retry API answers it.

    Attributes:
        budget: the budget the run failed on, or None.
    """

    reason = "not_retryable"

    def __init__(self, message: str = "", *, budget: str | None = None) -> None:
        super().__init__(message)
        self.budget = budget


class IllegalTransition(StepdError):
    """An event the state machine's transition table does not allow now.

    Raised before anything changes (STYLE.md rule 2): the state is untouched.
    """


class NotFound(StepdError):
    """An unknown run, lease, worker or actor path (HTTP 404)."""


class Unprocessable(StepdError):
    """A well-formed request the current state does not allow (HTTP 422).

    Example: starting a run of a workflow no worker has registered.
    """


class Unavailable(StepdError):
    """The daemon cannot serve this call now (HTTP 503): shutting down, or the
    actor that owns the target is being restarted. The caller retries."""
