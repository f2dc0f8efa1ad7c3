"""The handler driver: run one handler coroutine, killable, with no scope when it never waits.

Every hook of an incarnation (`on_start`, `receive`, a timer delivery, a
supervisor's child exit, `on_stop`) is run by `drive()`, whoever runs it: a
dispatcher task of the `Scheduler`, or the caller's own task (an inline ask,
the `start_child` handshake, a graceful stop). A kill must interrupt the
handler where it stands, which takes a cancel scope around it; an anyio cancel
scope costs more than a whole inline ask (~3 µs on asyncio), so:

1. The handler's first step runs bare (``coro.send(None)``). Most handlers
   (an echo, the daemon's registry, bookkeeping) finish without ever waiting:
   nothing else runs meanwhile, so nothing can kill them, and no scope is
   needed.
2. If it suspends, a cancel scope is entered *then*, around the rest of the
   handler, which `resume` steps exactly as ``await`` would. That is sound
   only if the handler did not itself suspend inside a cancel scope it opened
   during that first step (its scope would have to close inside ours):
   `cancel_scope_token()` before and after tells.
3. If it did, the rest runs without our scope, and a kill is delivered at the
   handler's next resumption (`Killed` is thrown in), and the actor's class
   is marked `_actor_scoped`: from then on its handlers run inside a scope
   entered before the first step. The usual reasons: a nested inline ask (the
   inner ask's late scope is still open when the outer handler suspends), a
   timeout, and on trio any sleep (`trio.sleep` opens a scope).

`on_start` and `on_stop` always run in a scope entered first (`scoped=True`):
they are rare next to messages, and a stop's deadline must hold.

An actor class may opt out of scopes altogether (`Actor.deferred_kill`): its
handlers' waits all end by themselves (a storage commit, another actor's
answer), so every kill of one that waits takes step 3's path, delivered when
the wait in hand ends; `on_start` too (not `on_stop`, whose deadline must
hold). The daemon's run and lease actors do: a lease actor starts and ends on
every step, and its call waits inside the run's inline handler, whose commit
wait was the other scope of a step.

A kill (`Runtime.cancel`) cancels the scope in `rt.scope`; `drive()` then
raises `Killed` (also when the handler swallowed the cancellation and
returned). Whatever else the handler raises propagates unchanged.
"""

from __future__ import annotations

import math
import types
from collections.abc import Coroutine, Generator
from typing import Any

import anyio

from ._types import Dispatcher, Driven
from ._waiter import cancel_scope_token

__all__ = ["Killed", "drive", "rest", "resume"]


class Killed(BaseException):
    """Raised out of `drive()` when the incarnation was cancelled (killed) meanwhile.

    Private to the package; also what a deferred kill throws into a handler.
    A `BaseException`, so a handler's ``except Exception`` lets it through.
    """


_NOTHING: Any = object()


@types.coroutine
def resume(coro: Coroutine[Any, Any, Any], first: Any, rt: Driven | None) -> Generator[Any, Any, Any]:
    """Await the rest of a coroutine whose first step was taken by hand.

    `first` is what that step yielded (a future, a trio trap), handed up to
    the event loop as if the coroutine had been awaited all along. With `rt`
    set, a kill of `rt` is thrown into the coroutine at its next resumption
    (the deferred kill of step 3 in the module docstring). A generator, not
    an object with `__await__`: one frame and no constructor per handler.
    """
    yielded = first
    send = coro.send
    throw = coro.throw
    try:
        while True:
            try:
                received = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the handler
                yielded = throw(exc)
            else:
                if rt is not None and rt.cancelled:
                    yielded = throw(Killed())
                else:
                    yielded = send(received)
    except StopIteration as stop:
        return stop.value


async def rest(rt: Driven, coro: Coroutine[Any, Any, Any], yielded: Any, base: object,
               sched: Dispatcher | None) -> Any:
    """The rest of a message handler whose first step (taken by the caller) suspended.

    What `drive()` does after its own first step, for callers that take that
    step themselves (an inline ask, a dispatcher's turn) so that a handler
    that never waits costs them no call at all. `base` is unused for a
    `deferred_kill` class.

    Raises:
        Killed: `rt` was cancelled while the handler ran.
        BaseException: whatever the handler raised.
    """
    if rt.deferred:
        return await _drive_deferred(rt, coro, yielded, sched)
    return await _drive_rest(rt, coro, yielded, base, sched, False, math.inf)


async def drive(
    rt: Driven,
    coro: Coroutine[Any, Any, Any],
    base: object,
    sched: Dispatcher | None,
    *,
    shield: bool = False,
    deadline: float = math.inf,
    scoped: bool = False,
) -> Any:
    """Run `coro` (a hook of `rt`'s actor) to its end and return its value.

    Args:
        rt: the incarnation the handler belongs to (its `scope` is set while
            the handler waits, so that `Runtime.cancel` can interrupt it).
        coro: the handler's coroutine, not started yet.
        base: `cancel_scope_token()` taken in this task just before.
        sched: the scheduler when a dispatcher runs this (it counts the
            dispatcher as blocked while the handler waits), else None.
        shield: shield the handler from outside cancellation (`on_stop`).
        deadline: cancel the handler at this event loop time (`on_stop`'s
            shutdown limit); it then returns None.
        scoped: enter the scope before the first step whatever the class
            (`on_start` and `on_stop`: rare, and a deadline must hold).

    Raises:
        Killed: `rt` was cancelled while the handler ran.
        BaseException: whatever the handler raised.
    """
    if rt.deferred and not shield and deadline == math.inf:
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            return stop.value
        return await _drive_deferred(rt, coro, yielded, sched)
    if scoped or rt.scoped:
        return await _drive_scoped(rt, coro, sched, shield, deadline)
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return stop.value
    return await _drive_rest(rt, coro, yielded, base, sched, shield, deadline)


async def _drive_deferred(
    rt: Driven,
    coro: Coroutine[Any, Any, Any],
    yielded: Any,
    sched: Dispatcher | None,
) -> Any:
    """The rest of a handler of a `deferred_kill` class: a kill lands at its next resumption."""
    if sched is not None:
        sched.blocked()
    try:
        value = await resume(coro, yielded, rt)
    finally:
        if sched is not None:
            sched.unblocked()
    if rt.cancelled:
        raise Killed
    return value


async def _drive_rest(
    rt: Driven,
    coro: Coroutine[Any, Any, Any],
    yielded: Any,
    base: object,
    sched: Dispatcher | None,
    shield: bool,
    deadline: float,
) -> Any:
    value = _NOTHING
    if sched is not None:
        sched.blocked()
    try:
        if cancel_scope_token() is base:
            with anyio.CancelScope(shield=shield, deadline=deadline) as scope:
                rt.scope = scope
                if rt.cancelled:
                    scope.cancel()
                try:
                    value = await resume(coro, yielded, None)
                finally:
                    rt.scope = None
        else:
            rt.scoped = True
            type(rt.actor)._actor_scoped = True
            value = await resume(coro, yielded, rt)
    finally:
        if sched is not None:
            sched.unblocked()
    if rt.cancelled:
        raise Killed
    return None if value is _NOTHING else value


async def _drive_scoped(
    rt: Driven,
    coro: Coroutine[Any, Any, Any],
    sched: Dispatcher | None,
    shield: bool,
    deadline: float,
) -> Any:
    value = _NOTHING
    if sched is not None:
        sched.blocked()
    try:
        with anyio.CancelScope(shield=shield, deadline=deadline) as scope:
            rt.scope = scope
            if rt.cancelled:
                scope.cancel()
            try:
                value = await coro
            finally:
                rt.scope = None
    finally:
        if sched is not None:
            sched.unblocked()
    if rt.cancelled:
        raise Killed
    return None if value is _NOTHING else value
