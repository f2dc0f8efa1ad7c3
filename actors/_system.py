"""The entry point: an `ActorSystem` owns the root supervisor, registry and timers.

``async with ActorSystem(clock=..., root=Supervisor(...)) as system:`` opens
one task group that holds the timer service, the dispatcher pool of the
scheduler (which runs every actor: actors own no task) and a task watching
the root supervisor, so no task outlives the block.

Leaving the block:

* normally, or with an exception from the body: the root supervisor stops
  gracefully (children in reverse start order, each within its `shutdown`),
  then the timer service ends; the body's exception, if any, propagates as is.
* cancelled from outside: every actor is cancelled brutally (no `on_stop`),
  pending asks still fail with `ActorDead` (handlers running inline in other
  tasks are cancelled too), and the cancellation propagates.

If the root supervisor crashes (its restart intensity was exceeded, so it
raised `SupervisorEscalation`), the system's task group cancels the body and
the failure leaves the block as an `ExceptionGroup` holding that
`SupervisorEscalation` (catch it with ``except* SupervisorEscalation``). Like
every task group error in anyio and trio, it is grouped, never bare.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ._clock import Clock, SystemClock
from ._errors import ActorDead, ActorKilled, ActorNotFound
from ._lifecycle import incarnate, start_inline, stop_gracefully
from ._ref import ActorRef, Cell
from ._runtime import Runtime
from ._scheduler import DEFAULT_MAX_DISPATCHERS, Scheduler
from ._spec import ChildSpec
from ._stats import ActorStatistics, ActorTree
from ._supervisor import Supervisor, SupervisorRef
from ._timers import TimerService

__all__ = ["ActorSystem"]


def _tree(sup: Supervisor, cell: Cell) -> ActorTree:
    """The subtree of `sup` (at `cell`), children in start order."""
    children = []
    for child in list(sup._children.values()):
        rt = child.runtime
        actor = rt.actor if rt is not None and not rt.done else None
        if isinstance(actor, Supervisor):
            children.append(_tree(actor, child))
        else:
            children.append(ActorTree(child.statistics()))
    return ActorTree(cell.statistics(), tuple(children))


def _split(path: str) -> tuple[str, str]:
    parent, _, child_id = path.rpartition("/")
    return parent or "/", child_id


class ActorSystem:
    """A running tree of actors under one root supervisor.

    Args:
        clock: where actors read time and timers wait (default `SystemClock`).
        root: the root supervisor (default: an empty ``one_for_one``
            `Supervisor`, to which `spawn` adds children). It starts when the
            block is entered, static children included, and `__aenter__`
            returns only after all of them finished `on_start`.
        max_dispatchers: the most dispatcher tasks the scheduler runs at
            once, i.e. how many handlers may wait (on I/O, on another actor)
            at the same time; past it, ready actors wait for one to return.

    Raises:
        TypeError: `root` is not a `Supervisor`.
        ValueError: `max_dispatchers` is not a positive int.
    """

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        root: Supervisor | None = None,
        max_dispatchers: int = DEFAULT_MAX_DISPATCHERS,
    ) -> None:
        if root is not None and not isinstance(root, Supervisor):
            raise TypeError(f"root must be a Supervisor, got {root!r}")
        self.clock: Clock = clock if clock is not None else SystemClock()
        # What an incarnation stamps its start with (`Runtime.started_at`):
        # the system clock's wall time read in one C call (nanoseconds), or
        # any other clock's `time_ms()`.
        if type(self.clock) is SystemClock:
            self._wall_stamp: Callable[[], int] = time.time_ns
            self._wall_per_ms = 1_000_000
        else:
            self._wall_stamp = self.clock.time_ms
            self._wall_per_ms = 1
        self._root = root if root is not None else Supervisor()
        self._registry: dict[str, Cell] = {}
        self._timers = TimerService(self.clock)
        self._sched = Scheduler(max_dispatchers)
        self._tg: TaskGroup | None = None
        self._root_rt: Runtime | None = None
        self._timer_scope: anyio.CancelScope | None = None
        self._dispatch_scope: anyio.CancelScope | None = None
        self._entered = False

    # -- lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Start the timer service and the root supervisor.

        Raises:
            StartFailed: the root supervisor (or one of its static children)
                failed to start; nothing is left running.
            RuntimeError: this system was entered before.
        """
        if self._entered:
            raise RuntimeError("an ActorSystem can be entered only once")
        self._entered = True
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            await tg.start(self._run_timers)
            await tg.start(self._run_dispatchers)
            cell = Cell("/", self._registry)
            cell.register()
            self._root_rt = incarnate(self._root, cell, self)
            cell.install(self._root_rt)
            try:
                await start_inline(self._root_rt)  # the root's start, in this task
            except BaseException:
                cell.retire()
                raise
            tg.start_soon(self._watch_root, name="stepd.actors root watcher")
        except BaseException as exc:
            tg.cancel_scope.cancel()
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                await tg.__aexit__(type(exc), exc, exc.__traceback__)
            else:
                await tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the system (see the module docstring for what happens when).

        It never suppresses an exception: a cancellation that reaches it is
        either from outside (re-raised by the task group) or caused by the
        root supervisor's failure (replaced by the ExceptionGroup below).

        Raises:
            ExceptionGroup: holding `SupervisorEscalation` (or another crash of
                the root supervisor) if the root failed.
        """
        tg = self._tg
        assert tg is not None
        cancelled = anyio.get_cancelled_exc_class()
        pending = exc if isinstance(exc, cancelled) else None
        if pending is None:
            try:
                await self._shutdown()
            except cancelled as stop_exc:
                # The system failed (its task group cancelled us) while stopping:
                # let the task group swallow its own cancellation and report why.
                pending = stop_exc
        if pending is not None:
            # Cancelled from outside (or the root failed): end every actor where
            # it stands, so that no ask waits on one, and forget them all.
            rt = self._root_rt
            if rt is not None:
                rt.cancel(None)
                rt.cell.retire()
            self._stop_services()
        if pending is None:
            await tg.__aexit__(None, None, None)
        else:
            await tg.__aexit__(type(pending), pending, pending.__traceback__)

    async def _shutdown(self) -> None:
        try:
            rt = self._root_rt
            if rt is not None and not rt.done:
                await stop_gracefully(rt, float("inf"))
                await rt.wait_done()
        finally:
            self._stop_services()

    def _stop_services(self) -> None:
        self._sched.close()
        if self._dispatch_scope is not None:
            self._dispatch_scope.cancel()
        if self._timer_scope is not None:
            self._timer_scope.cancel()

    async def _run_timers(self, *, task_status: TaskStatus[None]) -> None:
        with anyio.CancelScope() as scope:
            self._timer_scope = scope
            await self._timers.run(task_status=task_status)

    async def _run_dispatchers(self, *, task_status: TaskStatus[None]) -> None:
        """Own the dispatchers' task group until the system stops."""
        async with anyio.create_task_group() as tg:
            self._dispatch_scope = tg.cancel_scope
            self._sched.tg = tg
            task_status.started()
            await anyio.sleep_forever()

    async def _watch_root(self) -> None:
        """Raise the root supervisor's failure in the system's task group."""
        rt = self._root_rt
        assert rt is not None
        try:
            await rt.wait_done()
        finally:
            rt.cell.retire()
        if rt.reason is not None:
            raise rt.reason

    # -- addressing -----------------------------------------------------------

    @property
    def root(self) -> SupervisorRef:
        """A ref to the root supervisor, at path ``/``."""
        return self.supervisor("/")

    def resolve(self, path: str) -> ActorRef:
        """Return a ref to the actor registered at `path` (a `SupervisorRef` for supervisors).

        Raises:
            ActorNotFound: nothing is registered at `path`.
        """
        cell = self._registry.get(path)
        if cell is None:
            raise ActorNotFound(path)
        ref = cell.cached_ref
        return ref if ref is not None else cell.ref()

    def find(self, path: str) -> ActorRef | None:
        """`resolve`, or None when nothing is registered at `path`.

        For paths that are often absent (a run's actor before its first start):
        building and raising `ActorNotFound` there cost ~1 % of a busy daemon.
        """
        cell = self._registry.get(path)
        if cell is None:
            return None
        ref = cell.cached_ref
        return ref if ref is not None else cell.ref()

    def supervisor(self, path: str = "/") -> SupervisorRef:
        """Return a `SupervisorRef` to the supervisor at `path`.

        Raises:
            ActorNotFound: nothing is registered at `path`.
            TypeError: the actor at `path` is not a supervisor.
        """
        ref = self.resolve(path)
        if not isinstance(ref, SupervisorRef):
            raise TypeError(f"the actor at {path} is not a Supervisor")
        return ref

    async def spawn(self, spec: ChildSpec) -> ActorRef:
        """Start a dynamic child of the root supervisor; return once it has started.

        Raises:
            ChildExists: the root already has a child with this id.
            StartFailed: its `on_start` failed.
            ActorDead: the system is not running.
        """
        return await self.root.start_child(spec)

    async def stop(self, path: str) -> None:
        """Stop the actor at `path` gracefully and remove it from its supervisor.

        Raises:
            ActorNotFound: nothing runs at `path`.
            ActorDead: its supervisor is not running.
            ValueError: `path` is the root (leave the ``async with`` block).
        """
        if path == "/":
            raise ValueError("the root supervisor stops when the async with block ends")
        if path not in self._registry:
            raise ActorNotFound(path)
        parent, child_id = _split(path)
        await self.supervisor(parent).stop_child(child_id)

    async def kill(self, path: str) -> None:
        """Kill the actor at `path` as if it had crashed (reason `ActorKilled`).

        It is cancelled where it stands: no `on_stop`; its pending asks fail
        with `ActorDead`; its timers die. Its supervisor then applies its
        child spec (a permanent or transient child restarts, a temporary one
        is removed). Killing a supervisor kills its whole subtree. Returns once
        the killed incarnation has finished (not when it has restarted).

        Raises:
            ActorNotFound: nothing is registered at `path`.
            ActorDead: the actor at `path` is not running (already dead and
                waiting for its restart).
            ValueError: `path` is the root, which has no parent to restart it.
        """
        if path == "/":
            raise ValueError("the root supervisor has no parent to restart it; it cannot be killed")
        cell = self._registry.get(path)
        if cell is None:
            raise ActorNotFound(path)
        rt = cell.current
        if rt is None or rt.done:
            raise ActorDead(path, rt.reason if rt is not None else None)
        rt.cancel(ActorKilled(path))
        await rt.wait_done()

    # -- introspection --------------------------------------------------------

    def tree(self) -> ActorTree:
        """Return a snapshot of the whole supervision tree, children in start order.

        Raises:
            RuntimeError: the system has not been entered.
        """
        rt = self._root_rt
        if rt is None:
            raise RuntimeError("the actor system is not running")
        return _tree(self._root, rt.cell)

    def statistics(self, path: str) -> ActorStatistics:
        """Return a snapshot of the actor at `path`.

        Raises:
            ActorNotFound: nothing is registered at `path`.
        """
        cell = self._registry.get(path)
        if cell is None:
            raise ActorNotFound(path)
        return cell.statistics()

    def __repr__(self) -> str:
        return f"<ActorSystem actors={len(self._registry)} clock={self.clock!r}>"
