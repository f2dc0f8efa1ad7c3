"""What a worker holds: its bodies (inspected once), its definitions, its running leases.

`Body.of` decides, once per body at registration, whether it is ``async def``
and how many of ``(ctx, input, steps)`` it takes (the worker passes the first
ones, positionally), so nothing is inspected per lease.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio

from stepd import _otel_context
from stepd._errors import Invalid
from stepd.actors import Waiter
from stepd.context import StepContext, _current_ctx

__all__ = ["Active", "Body", "Definition", "Runner", "call_in_thread"]


@dataclass(frozen=True, slots=True)
class Body:
    name: str
    fn: Callable[..., Any]
    is_async: bool
    nargs: int

    @classmethod
    def of(cls, name: str, fn: Callable[..., Any], workflow: str) -> Body:
        """Inspect a body once: async or not, and how many of (ctx, input, steps) it takes.

        Raises:
            Invalid: it needs more than three positional arguments or a
                keyword-only argument without a default.
        """
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise Invalid(f"cannot inspect body {name!r}: {exc}", field=f"bodies.{name}",
                          definition=workflow) from None
        nargs = 0
        required = 0
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                nargs += 1
                if p.default is p.empty:
                    required += 1
            elif p.kind is p.VAR_POSITIONAL:
                nargs = 3
            elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
                raise Invalid(f"body {name!r} has a keyword-only parameter {p.name!r} without "
                              "a default; a body is called body(ctx, input, steps)",
                              field=f"bodies.{name}", definition=workflow)
        if required > 3:
            raise Invalid(f"body {name!r} requires {required} arguments; a body is called "
                          "body(ctx, input, steps)", field=f"bodies.{name}", definition=workflow)
        is_async = inspect.iscoroutinefunction(fn) or (
            not inspect.isroutine(fn) and not isinstance(fn, type)
            and inspect.iscoroutinefunction(type(fn).__call__))
        return cls(name, fn, is_async, min(nargs, 3))


@dataclass(slots=True)
class Definition:
    name: str
    version: str | None
    wire: dict[str, Any]
    definition_hash: str
    bodies: dict[str, Body]


class Active:
    """A lease whose body this worker runs (from the unservable check to its report).

    Holds no reference back to the worker or its runner, and the context holds
    none to it: when the worker lets go of a finished lease, reference counting
    frees it (no cycle for the garbage collector to find, per step).
    """

    __slots__ = ("beat_scope", "beating", "body", "born_at", "born_tick", "ctx", "finished",
                 "in_body", "lease", "local_async", "local_ctx", "local_records", "outcome", "poke",
                 "poke_pending", "reported", "scope", "started_done", "started_on",
                 "started_state", "sticky_cursor")

    def __init__(self, lease: dict[str, Any], ctx: StepContext, body: Body, scope: Any) -> None:
        self.lease = lease
        self.sticky_cursor: dict[str, Any] | None = None  # what this lease's complete reports
        self.ctx = ctx
        self.body = body
        self.scope = scope  # the runner's cancel scope the body runs in
        self.reported = False
        self.in_body = False  # the body is running: cancelling `scope` interrupts it
        self.outcome: tuple[Any, ...] | None = None
        self.finished = False  # reported (or dropped) and released
        # `started`: 0 not sent (or sent by a task, on an unordered channel),
        # 1 sent on the ordered channel `started_on` (answer pending), 2 answered,
        # 3 held back (at_least_once): folded into `complete`/`fail` if the body
        # ends before its first heartbeat is due, else sent then (`_heartbeats`).
        self.started_state = 0
        self.started_on: Any = None
        self.started_done: Waiter | None = None  # made by whoever waits for state 2
        # Heartbeats (`stepd._heartbeats`): the tick the body started at.
        self.born_tick = 0
        self.born_at = 0.0
        self.beating = False
        self.beat_scope: anyio.CancelScope | None = None
        self.poke: Waiter | None = None
        self.poke_pending = False
        # Local steps (`stepd._local`): the records so far, sent with `complete`,
        # and the context of the local body running now (cancelled with this one).
        self.local_records: list[dict[str, Any]] | None = None
        self.local_ctx: StepContext | None = None
        self.local_async = False  # that local body is async: a cancel interrupts it


class Runner:
    """One of the worker's long-lived lease tasks (at most ``concurrency`` of them)."""

    __slots__ = ("active", "handoff", "holding", "job", "lease", "reporting", "scope", "waiter")

    def __init__(self, lease: dict[str, Any] | None) -> None:
        self.lease = lease  # handed over by `accept`, taken by the runner
        # A lease offered while this runner's `complete`/`fail` was in flight in this
        # task (in process: the daemon offers the next step inside that call); taken
        # when the runner parks, with no task switch (`REPORTING`).
        self.handoff: dict[str, Any] | None = None
        self.reporting = False  # that call is in flight (a task that copied the context
        # while it was, e.g. one the daemon started inside it, must not hand off later)
        self.job: Active | None = None  # or a lease's `started` to send (unordered channels)
        self.active: Active | None = None
        self.holding = False  # counts in the worker's `running`
        self.scope: Any = None
        self.waiter: Waiter | None = None


REPORTING: ContextVar[Runner | None] = ContextVar("stepd_reporting_runner", default=None)
"""The runner whose `complete` or `fail` is in flight in this task (`LeaseCalls._final`).

In process the daemon runs a call in the caller's task, and offers the run's next
step inside the `complete` of the step before it (docs/architecture.md). A lease
that arrives then (`LeaseProtocol.accept`) is handed to that runner, which takes
it as soon as the call returns, in the same task step: no runner woken, no task
switch, and the offer's write and the next `complete`'s write are staged in the
same loop iteration, so the storage writer is woken once per step, not twice.
Over a socket leases arrive in the reader's task, where this is None.
"""


def call_in_thread(fn: Callable[..., Any], args: tuple[Any, ...], ctx: StepContext) -> Any:
    token = _current_ctx.set(ctx)
    otel = None if ctx._otel is None else _otel_context.attach(ctx._otel)
    try:
        return fn(*args)
    finally:
        if otel is not None:
            _otel_context.detach(otel)
        _current_ctx.reset(token)
