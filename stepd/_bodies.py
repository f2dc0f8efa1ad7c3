"""What a worker holds: its bodies (inspected once), its definitions, its running leases.

`Body.of` decides, once per body at registration, whether it is ``async def``
and how many of ``(ctx, input, steps)`` it takes (the worker passes the first
ones, positionally), so nothing is inspected per lease.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from stepd._errors import Invalid
from stepd.context import StepContext, _current_ctx

__all__ = ["Active", "Body", "Definition", "call_in_thread"]


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
    """A lease whose body this worker is running."""

    __slots__ = ("beating", "body_done", "body_started_at", "ctx", "hard_scope", "lease",
                 "poke", "poke_pending", "reported", "started_done", "started_on")

    def __init__(self, lease: dict[str, Any], ctx: StepContext) -> None:
        self.lease = lease
        self.ctx = ctx
        self.poke = anyio.Event()
        self.poke_pending = False
        self.hard_scope = anyio.CancelScope()  # abandons a sync body's thread
        self.reported = False
        self.started_done: anyio.Event | None = None  # `started` answered (or given up)
        self.started_on: Any = None  # the channel `started` last went out on
        self.body_started_at = 0.0  # the event loop's clock when the body started
        self.body_done = False  # the body returned (or raised): no heartbeat task to start
        self.beating = False  # its heartbeat task was started


def call_in_thread(fn: Callable[..., Any], args: tuple[Any, ...], ctx: StepContext) -> Any:
    token = _current_ctx.set(ctx)
    try:
        return fn(*args)
    finally:
        _current_ctx.reset(token)
