"""The errors the SDK raises, and the one place an HTTP error answer becomes one.

The hierarchy is the engine's (`stepd.sansio.errors`, closed; STYLE.md rule 15)
plus what a client or a body needs::

    StepdError
    +-- Invalid              400; ``field`` names the offending field
    +-- Unauthorized         401 (a subclass of the daemon's own class)
    +-- Forbidden            403 (likewise)
    +-- NotFound             404: no such run, lease or worker
    +-- Conflict             409, by ``reason``:
    |   +-- AlreadyApplied, Fenced, RunTerminal, NotStarted   (PROTOCOL.md's four)
    |   +-- BudgetExceeded   a signal refused: its transition would breach ``budget``
    |   +-- NotRetryable     a retry refused: not failed, failed on ``budget``, past its deadline
    +-- TooLarge             413: a request body over the daemon's limit
    +-- Unprocessable        422: e.g. starting a workflow nobody registered
    +-- Unavailable          503: the daemon is shutting down; retried for idempotent calls
    +-- ServerError          any other status (500: a daemon bug)
    +-- RunFailed            ``result()`` of a run that did not complete
        +-- RunCancelled
        +-- RunTimedOut

A body raises `Retryable` or `StepFailure` (ordinary exceptions, so they can be
raised and caught anywhere); `Cancelled` is what `StepContext.check_cancelled`
raises, a `BaseException` like `asyncio.CancelledError`, so a body's
``except Exception`` does not swallow it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from stepd.sansio.errors import (
    AlreadyApplied,
    Conflict,
    Fenced,
    Invalid,
    NotFound,
    NotRetryable,
    NotStarted,
    RunTerminal,
    StepdError,
    Unavailable,
    Unprocessable,
)
from stepd.transport import auth as _auth

__all__ = [
    "AlreadyApplied",
    "BudgetExceeded",
    "Cancelled",
    "Conflict",
    "Fenced",
    "Forbidden",
    "Invalid",
    "NotFound",
    "NotRetryable",
    "NotStarted",
    "Retryable",
    "RunCancelled",
    "RunFailed",
    "RunTerminal",
    "RunTimedOut",
    "ServerError",
    "StepFailure",
    "StepdError",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "Unprocessable",
    "error_from_answer",
    "translate",
]


# --------------------------------------------------------------------------- client side


class Unauthorized(_auth.Unauthorized):
    """401: no key, a malformed key, or a key the daemon does not know."""

    def __init__(self, message: str, *, reason: str = "unauthorized") -> None:
        super().__init__(message, reason=reason)


class Forbidden(_auth.Forbidden):
    """403: the key is known but lacks the scope the call needs."""

    def __init__(self, message: str, *, reason: str = "insufficient_scope") -> None:
        StepdError.__init__(self, message)
        self.message = message
        self.reason = reason
        self.key_id = None
        self.need = None  # type: ignore[assignment]


class BudgetExceeded(Conflict):
    """A signal refused because the transition it completes would breach a budget.

    Nothing was recorded and the run keeps waiting (WORKFLOWS.md "Budgets").

    Attributes:
        budget: the budget's name, e.g. ``max_state_bytes``.
    """

    reason: ClassVar[str] = "budget_exceeded"

    def __init__(self, budget: str, message: str = "") -> None:
        super().__init__(message or f"the signal's transition would exceed {budget}")
        self.budget = budget

    def __reduce__(self) -> tuple[Any, ...]:
        return (BudgetExceeded, (self.budget, self.message))


class TooLarge(StepdError):
    """413: a request body over the daemon's limit."""


class ServerError(StepdError):
    """Any answer the protocol does not define (a 500 is a daemon bug: see its log).

    Attributes:
        status: the HTTP status.
    """

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class RunFailed(StepdError):
    """The run ended without completing; raised by ``result()``.

    `RunCancelled` and `RunTimedOut` are subclasses, so ``except RunFailed``
    covers every way a run can end without a result.

    Attributes:
        run_id: the run.
        status: its terminal status (``failed``, ``cancelled``, ``timed_out``).
        error: the status's ``error`` object (``{"reason", "message", "step_id"}``), or None.
        reason: ``error["reason"]`` (``step_failed``, ``budget_exceeded``, ``lease_lost``,
            ``wait_timeout``, ``template``, ``cancelled``, ``deadline``), or None.
        step_id: the step it failed at, or None.
    """

    def __init__(self, run_id: str, status: str, error: dict[str, Any] | None) -> None:
        self.run_id = run_id
        self.status = status
        self.error = error
        self.reason: str | None = (error or {}).get("reason")
        self.step_id: str | None = (error or {}).get("step_id")
        self.message: str = (error or {}).get("message") or status
        super().__init__(f"run {run_id} {status}: {self.reason or ''}: {self.message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.status, self.error))


class RunCancelled(RunFailed):
    """The run was cancelled (``client.cancel``)."""


class RunTimedOut(RunFailed):
    """The run passed its deadline (``deadline=`` at start, or the definition's)."""


_RUN_ERRORS: dict[str, type[RunFailed]] = {
    "failed": RunFailed,
    "cancelled": RunCancelled,
    "timed_out": RunTimedOut,
}


def run_error(run_id: str, status: str, error: dict[str, Any] | None) -> RunFailed:
    """The exception for a run that ended with ``status`` (not ``completed``)."""
    return _RUN_ERRORS.get(status, RunFailed)(run_id, status, error)


# --------------------------------------------------------------------------- body side


class Retryable(Exception):
    """Raise from a body to fail the attempt with class ``retryable``.

    The step is retried within its retry budget (``stepd.Retry``). Only the
    message reaches the journal.
    """


class StepFailure(Exception):
    """Raise from a body to fail the attempt with a named class.

    ``StepFailure("rate_limited", "429 from upstream")`` fails with class
    ``rate_limited``: not retried unless the step's ``retry_on`` lists it.

    Attributes:
        error_class: the class sent (``retryable``, ``fatal`` or any name).
        message: the message sent.
    """

    def __init__(self, error_class: str, message: str = "") -> None:
        if not isinstance(error_class, str) or not error_class:
            raise TypeError("StepFailure(error_class, message): error_class must be a non-empty str")
        super().__init__(error_class, message)
        self.error_class = error_class
        self.message = message

    def __str__(self) -> str:
        return f"{self.error_class}: {self.message}" if self.message else self.error_class


class Cancelled(BaseException):
    """The body's lease was cancelled: raised by ``ctx.check_cancelled()``.

    A `BaseException` (like ``asyncio.CancelledError``), so ``except Exception``
    in a body does not swallow it.

    Attributes:
        reason: ``fenced`` (a later attempt exists, or the step timed out),
            ``run_terminal`` (the run ended), ``lost`` (the daemon no longer knows
            the lease) or ``shutdown`` (the worker is stopping).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------- mapping


_CONFLICTS: dict[str, type[Conflict]] = {
    "already_applied": AlreadyApplied,
    "fenced": Fenced,
    "run_terminal": RunTerminal,
    "not_started": NotStarted,
}


def _strip_location(message: str, field: str | None, definition: str | None) -> str:
    """The daemon sends ``str(Invalid)`` (location included); keep the bare message."""
    parts = []
    if definition is not None:
        parts.append(f"definition {definition!r}")
    if field is not None:
        parts.append(field)
    prefix = ": ".join(parts) + ": " if parts else ""
    return message[len(prefix):] if prefix and message.startswith(prefix) else message


def error_from_answer(status: int, body: Any) -> StepdError:
    """The exception an error answer stands for (HTTP status and JSON body, or a WS frame).

    Args:
        status: the HTTP status (409 for a WebSocket ``conflict`` frame).
        body: the decoded error body (``{"error", "message", ...}``), or anything.
    """
    b = body if isinstance(body, dict) else {}
    message = str(b.get("message") or f"HTTP {status}")
    if status == 400:
        field = b.get("field") if isinstance(b.get("field"), str) else None
        definition = b.get("definition") if isinstance(b.get("definition"), str) else None
        return Invalid(_strip_location(message, field, definition), field=field,
                       definition=definition)
    if status == 401:
        return Unauthorized(message)
    if status == 403:
        return Forbidden(message)
    if status == 404:
        return NotFound(message)
    if status == 409:
        reason = b.get("reason")
        if reason == "budget_exceeded":
            return BudgetExceeded(str(b.get("budget")), message)
        if reason == "not_retryable":
            budget = b.get("budget")
            return NotRetryable(message, budget=budget if isinstance(budget, str) else None)
        cls = _CONFLICTS.get(reason) if isinstance(reason, str) else None
        if cls is not None:
            return cls(message)
        return Conflict(message)
    if status == 413:
        return TooLarge(message)
    if status == 422:
        return Unprocessable(message)
    if status == 503:
        return Unavailable(message)
    return ServerError(message, status=status)


def translate(exc: BaseException) -> BaseException:
    """The SDK error for an error raised by the in-process transport.

    The in-process adapter raises the daemon's own classes; the SDK raises the
    same classes as over HTTP, so `Client` behaves the same on both.
    """
    if isinstance(exc, (Unauthorized, Forbidden, BudgetExceeded, TooLarge)):
        return exc
    if isinstance(exc, _auth.Forbidden):
        return Forbidden(exc.message)
    if isinstance(exc, _auth.Unauthorized):
        return Unauthorized(exc.message, reason=exc.reason)
    name = type(exc).__name__
    if isinstance(exc, Conflict) and exc.reason == "budget_exceeded":
        return BudgetExceeded(str(getattr(exc, "budget", "")), exc.message)
    if name == "TooLarge" and isinstance(exc, StepdError):
        return TooLarge(str(exc))
    return exc
