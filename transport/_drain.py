"""What the protocol handler has in flight, and the drain that ends it (STYLE.md rule 22).

`Protocol` (protocol.py) is one: the calls in flight (counted, and those with
a cancel scope also cancellable), the long-polls held, the WebSocket
connections open, and the shutdown in stages over them (`begin_drain`,
`wait_quiet`, `abort`, `drain`). Kept apart from the calls themselves: this is
what shutdown needs, and nothing here validates or answers a call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Self

import anyio

from stepd.actors.daemon import Daemon

__all__ = ["Drain"]


class Drain:
    """The calls in flight of a protocol handler, and its shutdown.

    Attributes:
        daemon: the daemon's API (the drain stops its offers).
        draining: True once `drain` began: every new call answers 503.
    """

    daemon: Daemon

    def __init__(self) -> None:
        self.draining = False
        self._inflight = 0
        # Made only by wait_quiet (shutdown) while calls are in flight: an
        # Event per call going from idle to busy cost more than the call's
        # bookkeeping.
        self._idle: anyio.Event | None = None
        self._polls: set[anyio.CancelScope] = set()
        self._task_polls: set[_TaskTracking] = set()  # long-polls `begin_drain` ends by task
        self._calls: set[anyio.CancelScope] = set()
        self._tasks: set[_TaskTracking] = set()  # calls `abort` cancels through their task
        self._aborted = False
        self._connections: set[Any] = set()  # WorkerConnection: close_for_shutdown(), abort()

    def tracking(self) -> _Tracking:
        """Count one call in flight for the duration; `abort` cancels its scope.

        Shutdown waits for the calls in flight (`wait_quiet`); once the grace
        period is over it cancels them (`abort`): the transport then answers
        503 if it still can (a write already submitted still commits).

        ``with protocol.tracking() as scope:`` (an HTTP or in-process call).
        """
        return _Tracking(self)

    def task_tracking(self, task: asyncio.Task[Any] | None = None, *,
                      poll: bool = False) -> _TaskTracking | _Tracking:
        """`tracking` without a cancel scope, for a call that has its asyncio task to
        itself (an HTTP request under stepd's uvicorn protocol): `abort` cancels the
        task, and leaving the ``with`` block swallows that cancellation, as a
        cancelled scope would. ``with`` it at once, in the task.

        Args:
            task: the call's task (the current one when omitted; stepd's uvicorn
                protocol knows it, `HttpExchange.task`, and spares the lookup).
            poll: the call is a long-poll: `begin_drain` ends it too, through the
                task, instead of the cancel scope `Protocol.call` would enter
                (`Protocol.call`'s ``held``); ``drained`` then says so, and the
                caller answers 503 itself.

        An anyio cancel scope cost ~20 calls a request (~85 a step over HTTP), and
        a long-poll had three (this one's, `long_poll`'s and its wait's). A
        cancel is delivered where the task resumes, and `abort` (or the drain)
        reaches only tasks inside the block (it is left with no wait in
        between), so a late cancel never lands after the block: the answer,
        sent after it, is never cut in half. Once aborted, `tracking` (a scope
        cancelled before it is entered) is returned instead.
        """
        if self._aborted:
            return _Tracking(self)
        if task is None:
            task = asyncio.current_task()
            assert task is not None
        return _TaskTracking(self, task, poll)

    def call_begins(self) -> None:
        """`tracking` without a cancel scope or a context manager: counted, not cancelled
        by `abort`; pair it with `call_ends` in a ``finally``.

        For calls that `abort` reaches another way: a WebSocket frame's call
        runs in its connection's task group, which `abort` cancels as a whole
        (`WorkerConnection.abort`). That spares two cancel scopes per step, and
        three calls against a context manager.
        """
        self._inflight += 1

    def call_ends(self) -> None:
        """The call `call_begins` counted is over (`_call_done`, written out: once per step)."""
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    def _call_done(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    @property
    def inflight(self) -> int:
        """Calls in flight (HTTP requests and WebSocket frames being answered)."""
        return self._inflight

    @contextlib.contextmanager
    def long_poll(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope `begin_drain` cancels: long-polls end at once when the daemon drains."""
        scope = anyio.CancelScope()
        if self.draining:
            scope.cancel()
        self._polls.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._polls.discard(scope)

    def add_connection(self, conn: Any) -> None:
        """A WebSocket connection the drain must close (``close_for_shutdown()``, ``abort()``)."""
        self._connections.add(conn)

    def remove_connection(self, conn: Any) -> None:
        self._connections.discard(conn)

    def begin_drain(self) -> None:
        """Shutdown stages 1 and 2 (STYLE.md rule 22): refuse new calls, stop handing out leases.

        Every new call answers 503; the daemon stops offering leases; held
        long-polls end (503); every WebSocket stops reading and pushing and
        closes with 1001 once its in-flight frames are answered. Idempotent.
        """
        if self.draining:
            return
        self.draining = True
        self.daemon.begin_drain()
        for scope in list(self._polls):
            scope.cancel()
        for tracked in list(self._task_polls):
            tracked.drain()
        for conn in list(self._connections):
            conn.close_for_shutdown()

    async def wait_quiet(self) -> None:
        """Wait until no call is in flight and every WebSocket has closed."""
        while True:
            if self._inflight:
                if self._idle is None:
                    self._idle = anyio.Event()
                await self._idle.wait()
            if not self._connections:
                return
            await anyio.sleep(0.005)

    def abort(self) -> None:
        """The grace period is over: cancel every call in flight and every WebSocket."""
        self._aborted = True
        for scope in list(self._calls):
            scope.cancel()
        for tracked in list(self._tasks):
            tracked.cancel()
        for conn in list(self._connections):
            conn.abort()

    async def drain(self, grace_s: float) -> bool:
        """`begin_drain`; wait for calls in flight at most ``grace_s``; then `abort` the rest.

        Returns:
            True when everything in flight finished within the grace period.
        """
        self.begin_drain()
        with anyio.move_on_after(grace_s):
            await self.wait_quiet()
            return True
        self.abort()
        with anyio.move_on_after(1.0):
            await self.wait_quiet()
        return False


class _Tracking:
    """`Protocol.tracking`'s context manager: a class, not a generator context
    manager (which costs four more calls, on every HTTP and in-process call)."""

    __slots__ = ("protocol", "scope")

    # As `_TaskTracking`'s: never a long-poll the drain ends through its task.
    poll = False
    drained = False

    def __init__(self, protocol: Drain) -> None:
        self.protocol = protocol
        self.scope = anyio.CancelScope()

    def __enter__(self) -> anyio.CancelScope:
        protocol, scope = self.protocol, self.scope
        protocol._inflight += 1
        if protocol._aborted:
            scope.cancel()
        protocol._calls.add(scope)
        try:
            scope.__enter__()
        except BaseException:
            self._done()
            raise
        return scope

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        try:
            return bool(self.scope.__exit__(exc_type, exc, tb))
        finally:
            self._done()

    def _done(self) -> None:
        self.protocol._calls.discard(self.scope)
        self.protocol._call_done()


class _TaskTracking:
    """`Protocol.task_tracking`'s context manager: the call counted, cancelled by
    `abort` through its asyncio task (and, for a long-poll, by the drain).
    ``cancelled_caught``: as a scope's; ``drained``: the drain's cancel it was."""

    __slots__ = ("cancelled_caught", "drained", "poll", "protocol", "requested", "task")

    def __init__(self, protocol: Drain, task: asyncio.Task[Any], poll: bool) -> None:
        self.protocol = protocol
        self.task = task
        self.poll = poll
        self.requested = False
        self.cancelled_caught = False
        self.drained = False

    def __enter__(self) -> Self:
        protocol = self.protocol
        protocol._inflight += 1
        protocol._tasks.add(self)
        if self.poll:
            protocol._task_polls.add(self)
        return self

    def cancel(self) -> None:
        """Cancel the call (`abort`, or a disconnect when it is a long-poll's watch)."""
        if not self.requested:
            self.requested = True
            self.task.cancel()

    def drain(self) -> None:
        """The daemon drains: a long-poll ends at once (answered 503 by the caller)."""
        if not self.requested:
            self.drained = True
            self.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        protocol = self.protocol
        protocol._tasks.discard(self)
        if self.poll:
            protocol._task_polls.discard(self)
        protocol._call_done()
        if not self.requested:
            return False
        # Ours: the task's cancel request is withdrawn (whether or not the call let
        # it through), so nothing after the block sees it. Swallowed only when no
        # other cancel of the task is pending (as `asyncio.timeout` does): the
        # server's own goes on.
        if (self.task.uncancel() == 0 and exc_type is not None
                and issubclass(exc_type, asyncio.CancelledError)):
            self.cancelled_caught = True
            return True
        return False
