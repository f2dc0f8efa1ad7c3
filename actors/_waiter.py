"""Backend shims: a one-shot wake-up, and the identity of the current cancel scope.

Every ask waits for one reply and every idle actor waits for one message: the
runtime's hottest waits. `anyio.Event` is correct but goes through the backend
lookup, an `asyncio.Event` (a set of futures) or a trio `ParkingLot` each
time. `Waiter` waits on the most direct thing each backend has: a bare future
on asyncio, `wait_task_rescheduled` on trio. It has the same contract as a
one-shot event: `set()` (from the event loop thread) wakes the one waiter, or
makes the next `wait()` return at once; cancellation (an anyio cancel scope,
`fail_after`) interrupts `wait()` normally.

Only the waiting side needs to know the backend; `set()` is a plain call.

`cancel_scope_token()` names the current task's innermost cancel scope (an
anyio scope on asyncio, trio's cancel status on trio). The handler driver
(`_drive.py`) compares it before and after a handler's first step to learn
whether the handler suspended inside a cancel scope of its own, which decides
whether a kill scope may be entered around the rest of the handler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

try:  # trio is a dependency, but the runtime must not need it on asyncio
    import trio.lowlevel as _trio_lowlevel
except ImportError:  # pragma: no cover
    _trio_lowlevel = None  # type: ignore[assignment]

__all__ = ["Waiter", "cancel_scope_token", "current_time"]

_get_running_loop = asyncio.get_running_loop
_running_loop = asyncio._get_running_loop  # None outside asyncio, without raising
_InvalidStateError = asyncio.InvalidStateError
# `asyncio.current_task()` is a Python function on 3.11 (a loop lookup and this
# dict's get); the dict itself answers in one C call. Newer Pythons may keep
# it elsewhere: then `current_task` itself.
_current_tasks: Any = getattr(asyncio.tasks, "_current_tasks", None)
_task_of = _current_tasks.get if isinstance(_current_tasks, dict) else asyncio.current_task


def current_time() -> float:
    """`anyio.current_time()` without its backend lookup (~1.5 µs a call).

    The event loop's clock: asyncio's ``loop.time()``, trio's `trio.current_time`
    (a `trio.testing.MockClock` included), exactly what anyio returns.

    Raises:
        RuntimeError: outside an event loop.
    """
    try:
        return _get_running_loop().time()
    except RuntimeError:
        if _trio_lowlevel is None:  # pragma: no cover
            raise
        import trio

        return trio.current_time()  # raises RuntimeError outside trio too


async def _ready() -> None:
    """What `Waiter.wait` returns when the waiter is already set."""


class Waiter:
    """Wake one waiting task, once.

    No `__init__` and no slots: its three fields start as class attributes,
    so making one (every ask through a mailbox, every parked dispatcher or
    reader) runs no Python code at all.
    """

    _is_set = False
    _fut: asyncio.Future[None] | None = None
    _task: Any = None  # a trio task parked in wait()

    def is_set(self) -> bool:
        return self._is_set

    def set(self) -> None:
        if self._is_set:
            return
        self._is_set = True
        fut = self._fut
        if fut is not None:
            self._fut = None
            try:
                fut.set_result(None)
            except _InvalidStateError:  # cancelled meanwhile: its waiter is leaving
                pass
            return
        task = self._task
        if task is not None:
            self._task = None
            _trio_lowlevel.reschedule(task)

    def wait(self) -> Awaitable[None]:
        """Return an awaitable that completes once `set()` was called (at once if it was).

        On asyncio it is the bare future itself (awaiting it runs no Python
        frame of ours, one fewer per wait on the hottest waits); on trio a
        coroutine parked with `wait_task_rescheduled`. Await it right away,
        once.

        Raises:
            the backend's cancellation exception (from the await), if
            cancelled meanwhile.
        """
        if self._is_set:
            return _ready()
        loop = _running_loop()
        if loop is None:
            return self._wait_trio()
        fut = self._fut = loop.create_future()  # set() clears it; a cancelled one stays done
        return fut

    async def wait_at_most(self, seconds: float) -> None:
        """`wait`, given up after ``seconds`` (no error: the caller looks at what it
        waited for; a timeout leaves the waiter set).

        On asyncio a loop timer sets the waiter, not a cancel scope: a scope
        (`move_on_after`) costs ~16-35 calls (its backend lookup, anyio's task
        state, its exit's restart of the parent's cancellation) on a claim or a
        result long-poll. Trio keeps the scope.
        """
        if self._is_set:
            return
        loop = _running_loop()
        if loop is None:
            import anyio

            with anyio.move_on_after(seconds):
                await self._wait_trio()
            self.set()  # as the asyncio timer leaves it (a no-op when woken by `set`)
            return
        timer = loop.call_later(seconds, self.set)
        try:
            await self.wait()
        finally:
            timer.cancel()

    async def _wait_trio(self) -> None:
        self._task = _trio_lowlevel.current_task()

        def abort(_: object) -> Any:
            self._task = None  # set() must not reschedule a task that left
            return _trio_lowlevel.Abort.SUCCEEDED

        await _trio_lowlevel.wait_task_rescheduled(abort)


# anyio keeps each asyncio task's innermost cancel scope in a private
# WeakKeyDictionary; one task (the last one asked about) is cached, because a
# weak-keyed lookup costs more than the rest of an inline ask.
_states: Any = None
_cached_task: Any = None
_cached_state: Any = None


def _asyncio_states() -> Any:
    global _states
    try:
        from anyio._backends._asyncio import _task_states
    except ImportError:  # pragma: no cover - anyio moved it: never "same scope"
        _task_states = None  # type: ignore[assignment]
    _states = _task_states
    return _states


def cancel_scope_token() -> object:
    """Return an object naming the current task's innermost cancel scope.

    Two calls in one task return the same object exactly when no cancel scope
    was entered (and left open) in between. If the backend's internals cannot
    be read, every call returns a fresh object (never "the same"), which is
    the safe answer.
    """
    global _cached_task, _cached_state
    loop = _running_loop()
    if loop is not None:
        task = _task_of(loop)
        if task is _cached_task:
            return _cached_state.cancel_scope
        states = _states if _states is not None else _asyncio_states()
        if states is None:  # pragma: no cover
            return object()
        state = states.get(task)
        if state is None:
            return None  # no anyio scope in this task yet (not cached: one may come)
        _cached_task, _cached_state = task, state
        return state.cancel_scope
    try:
        return _trio_lowlevel.current_task()._cancel_status
    except AttributeError:  # pragma: no cover - trio changed: never "same scope"
        return object()
