"""One incarnation of an actor: its mailbox, system queue, timers and life cycle.

A `Runtime` is what an actor is at run time: a bounded mailbox (a deque and
the waiters of senders blocked on it), a system queue (fired timers, child
exits), a state, and flags. It owns no task. Whoever runs one of its handlers
holds it `busy` (one handler at a time):

* a dispatcher of the system's `Scheduler`, for a turn (`turn()`);
* the caller's own task for an *inline ask* (the actor was idle with nothing
  queued, so the asker runs the handler itself, with no task switch at all:
  `ActorRef.ask` / `ask_now` take the handler's first step themselves, this
  class sorts out what follows), for the `start_child` handshake and for a
  graceful stop by its supervisor (`_lifecycle.py`: starting and stopping an
  incarnation, what its supervisor and the system call).

When an owner is done and work is pending, the incarnation goes on the ready
queue (`release_owner()`): work that arrives during an inline ask is served
by a dispatcher, never by the asker.

How it ends (every path closes it first, synchronously: no more sends, the
in-flight and queued asks fail with `ActorDead`, timers die):

* normally or by a crash (`_lifecycle.stop_sequence`): then `on_stop` (if
  overridden), shielded and bounded by the stopper's shutdown limit;
* brutally (`cancel()`: a kill, a brutal shutdown, the system cancelled): the
  handler in flight is cancelled where it stands (its cancel scope, see
  `_drive.py`), no `on_stop`; a supervisor cancels its whole subtree, and
  finishes only once every child has.

`_finish` then reports the exit to the supervisor (its system queue), unless
the supervisor asked for it (`expected_exit`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Protocol

import anyio

from ._actor import Actor, SystemView
from ._drive import Killed, drive
from ._errors import ActorDead, ActorKilled
from ._mailbox import Ask
from ._ref import Cell
from ._spec import ChildSpec
from ._timers import TimerEntry
from ._types import NO_ITEMS, SchedulerLike
from ._waiter import Waiter, cancel_scope_token

__all__ = ["DEAD", "RUNNING", "STARTING", "STOPPING", "ExitWatcher", "Runtime", "RuntimeSystem"]

STARTING = "starting"
RUNNING = "running"
STOPPING = "stopping"
DEAD = "dead"


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, anyio.get_cancelled_exc_class())


class RuntimeSystem(SystemView, Protocol):
    """What an incarnation needs of its `ActorSystem` (`_system.py`, above): its scheduler too."""

    @property
    def _sched(self) -> SchedulerLike[Runtime]: ...
    @property
    def _wall_stamp(self) -> Callable[[], int]: ...
    @property
    def _wall_per_ms(self) -> int: ...


class ExitWatcher(Protocol):
    """What an incarnation needs of its `Supervisor` (`_supervisor.py`, above)."""

    def _child_exited(
        self, child: _Child, runtime: Runtime, reason: BaseException | None
    ) -> None: ...


class _Child(Cell):
    """A supervisor's child: its cell (the registry entry at its path) and its record.

    One object, not a cell and a record beside it: a lease actor is started
    per step. The record adds the spec and the current incarnation (also kept
    after it ended, unlike `current`). Its cell's `retired` says the
    supervisor removed it (nothing else retires a child's cell).
    Here, not in `_supervisor`, because an incarnation reports its exit with it.
    """

    __slots__ = ("last_reason", "runtime", "spec")

    def __init__(self, path: str, registry: dict[str, Cell], spec: ChildSpec) -> None:
        # `Cell.__init__`'s fields, set here: one call per child, not two.
        self.path = path
        self.registry = registry
        self.current = None
        self.kind = "?"
        self.restarts = 0
        self.retired = False
        self.cached_ref = None
        self.spec = spec
        self.runtime: Runtime | None = None
        self.last_reason: BaseException | None = None  # handed to the next incarnation

    @property
    def cell(self) -> Cell:
        """The child's registry entry: the child itself."""
        return self


class Runtime:
    """The runtime state of one incarnation. Private to the package."""

    # The fields every incarnation sets are slots; the ones most never change
    # live in an instance dict (created on the first write) with class-level
    # defaults, so that starting an actor stores a dozen fields, not forty.
    __slots__ = (
        "__dict__", "_done_event", "accepting", "actor", "blocker", "busy", "cancelled", "cell",
        "closed", "current", "deferred", "done", "holders", "hook_pending", "inline", "queue",
        "reason", "sched", "scheduled", "scoped", "senders", "size", "stamp", "start_hook",
        "started", "state", "stop_hook", "stop_requested", "sup", "sync", "sysq", "system",
        "timers",
    )  # fmt: skip

    # Slots although rarely set: a dispatcher reads them before every item, or
    # every stop does (a class default read through an instance is not
    # specialised on 3.11: it costs several slot reads).
    senders: deque[Waiter] | None  # sends waiting for room
    stop_requested: bool
    hook_pending: bool  # on_stop waits for a dispatcher (after an inline crash)
    cancelled: bool  # killed / brutally stopped: end where it stands
    current: Ask | None  # the ask whose handler runs now (dispatcher path)
    holders: int  # children a cancelled supervisor waits for
    blocker: Runtime | None  # the cancelled supervisor waiting for us
    _done_event: anyio.Event | None
    start_pending = False  # on_start waits for a dispatcher (start_child_nowait)
    hook_reason: BaseException | None = None
    cancel_reason: BaseException | None = None
    scope: anyio.CancelScope | None = None  # the waiting handler's scope
    expected_exit = False  # its supervisor stops it: no exit report
    finish_pending = False

    # Set by `_lifecycle.incarnate` (no `__init__`: calling a class with one
    # costs more than all of its stores; see there).
    actor: Actor
    cell: Cell
    system: RuntimeSystem
    sched: SchedulerLike[Runtime]
    sup: ExitWatcher | None  # who hears of its exit (None: the root, or once finished)
    queue: deque[Any]
    size: int
    sysq: deque[Any]
    timers: dict[Hashable, TimerEntry]
    state: str
    start_hook: bool
    stop_hook: bool
    scoped: bool
    deferred: bool
    sync: bool
    busy: bool  # someone runs a handler (or the start or stop) now
    scheduled: bool  # on the ready queue
    inline: bool  # running, accepting, no stop requested: asks may run inline
    accepting: bool
    started: bool
    closed: bool
    done: bool
    reason: BaseException | None
    stamp: int | None  # `system._wall_stamp()` when started

    @property
    def path(self) -> str:
        return self.cell.path

    @property
    def started_at(self) -> int | None:
        """Wall-clock epoch ms when this incarnation finished `on_start` (None: not yet)."""
        stamp = self.stamp
        return None if stamp is None else stamp // self.system._wall_per_ms

    # -- sending -------------------------------------------------------------

    def notify(self) -> None:
        """Work arrived: queue this incarnation for a dispatcher unless someone runs it."""
        if not self.busy and not self.scheduled and not self.done:
            self.sched.schedule(self)

    def put_nowait(self, item: object) -> None:
        """Queue `item` if there is room (`anyio.WouldBlock` if not).

        Raises:
            ActorDead: the incarnation accepts no more messages.
        """
        if not self.accepting:
            raise ActorDead(self.cell.path, self.reason)
        queue = self.queue
        if len(queue) >= self.size:
            raise anyio.WouldBlock
        if queue is NO_ITEMS:
            queue = self.queue = deque()
        queue.append(item)
        if not self.busy and not self.scheduled:
            self.sched.schedule(self)

    async def put(self, item: object) -> None:
        """Queue `item`, waiting while the mailbox is full.

        Raises:
            ActorDead: the incarnation stopped accepting (before or meanwhile).
        """
        while True:
            if not self.accepting:
                raise ActorDead(self.cell.path, self.reason)
            queue = self.queue
            if len(queue) < self.size:
                if queue is NO_ITEMS:
                    queue = self.queue = deque()
                queue.append(item)
                if not self.busy and not self.scheduled:
                    self.sched.schedule(self)
                return
            senders = self.senders
            if senders is None:
                senders = self.senders = deque()
            waiter = Waiter()
            senders.append(waiter)
            try:
                await waiter.wait()
            except BaseException:
                if not waiter.is_set():
                    senders.remove(waiter)
                elif senders and len(self.queue) < self.size:
                    senders.popleft().set()  # pass on the room we were woken for
                raise

    def _take(self) -> Any:
        item = self.queue.popleft()
        senders = self.senders
        if senders:
            senders.popleft().set()
        return item

    # -- control, from other tasks ------------------------------------------

    def request_stop(self) -> None:
        """Stop after the handler in hand (a normal exit); new sends fail at once."""
        if self.stop_requested or self.done:
            return
        self.stop_requested = True
        self.accepting = False
        self.inline = False
        if self.state == RUNNING:
            self.state = STOPPING
        if not self.busy and not self.scheduled:  # `notify()`, inlined: once per lease
            self.sched.schedule(self)

    def cancel(self, reason: BaseException | None) -> None:
        """End the incarnation where it stands (kill, brutal shutdown): no `on_stop`.

        A supervisor cancels its children first (brutally, unreported) and
        finishes after the last of them.
        """
        if self.done or self.cancelled:
            return
        self.cancelled = True
        self.cancel_reason = reason
        self.accepting = False
        self.inline = False
        if self.actor._actor_is_supervisor:
            self.actor._cancel_children(self)  # type: ignore[attr-defined]
        if self.busy:
            scope = self.scope
            if scope is not None:
                scope.cancel()
            return  # its owner ends it as the handler unwinds
        self._close(reason)
        self._finish(reason)

    async def wait_done(self) -> None:
        """Wait until the incarnation has finished, cleanup and `on_stop` included."""
        if self.done:
            return
        if self._done_event is None:
            self._done_event = anyio.Event()
        await self._done_event.wait()

    # -- starting (the rest: `_lifecycle.py`) -----------------------------------

    def mark_started(self) -> None:
        """`on_start` has returned (or there is none): the incarnation runs."""
        self.started = True
        self.stamp = self.system._wall_stamp()
        if self.state == STARTING:
            if self.stop_requested:
                self.state = STOPPING
            else:
                self.state = RUNNING
                self.inline = self.accepting

    # -- inline handlers: run in the caller's task ------------------------------

    async def ask_inline(self, message: object) -> Any:
        """Run the handler for an ask in the caller's task, in a scope entered first.

        For an actor class learnt `_actor_scoped` (see `_drive.py`); every
        other inline ask is run by `ActorRef.ask` itself.

        Raises:
            ActorDead: the handler crashed, or the incarnation was killed.
            Exception: the handler's exception if listed in `reply_errors`.
            BaseException: the caller's cancellation (the incarnation then
                ends like a killed one: its state cannot be trusted).
        """
        self.busy = True
        try:
            value = await drive(self, self.actor.receive(message), cancel_scope_token(), None)
        except BaseException as exc:  # noqa: BLE001 - sorted out by inline_error, re-raised
            raise self.inline_error(exc)  # ActorDead sets its own cause
        self.release_owner()
        return value

    def tell_inline(self, message: object) -> None:
        """Handle a tell in the teller's own call (`Actor.sync_handlers`; the actor is idle).

        As a dispatcher would, minus the queue: one handler at a time (`busy`),
        and nothing queued that it could overtake (the caller checked). The
        handler must finish without waiting: nothing can interleave, so no
        kill can land half way and no scope is needed. One that waits is a
        crash of the actor (a bug in it), as is anything it raises, which the
        teller does not hear of: its supervisor does, as for any tell.
        """
        self.busy = True
        coro = self.actor.receive(message)
        try:
            coro.send(None)
        except StopIteration:
            self.release_owner()
            return
        except Exception as exc:  # noqa: BLE001 - a tell's failure is the actor's crash
            self._crash_later(exc)
            return
        except BaseException:
            self.release_owner()
            raise
        coro.close()
        self._crash_later(RuntimeError(
            f"{self.cell.path}: a handler of a sync_handlers actor waited"))

    def now_error(self, exc: BaseException) -> BaseException:
        """`ActorRef.ask_now`'s handler raised `exc`: what to raise to its caller."""
        if isinstance(exc, Exception):
            return self._handler_raised(exc)
        self.release_owner()
        return exc

    def now_waited(self, coro: Coroutine[Any, Any, Any]) -> ActorDead:
        """`ActorRef.ask_now`'s handler waited: a crash of the actor; what its caller gets."""
        coro.close()
        waited = RuntimeError(f"{self.cell.path}: a handler asked with ask_now waited")
        self._crash_later(waited)
        return ActorDead(self.cell.path, waited)

    def inline_error(self, exc: BaseException) -> BaseException:
        """An inline ask's handler raised `exc` (or was killed): what to raise to the asker."""
        path = self.cell.path
        if self.cancelled:
            reason = self.cancel_reason
            self._end(reason)
            if not isinstance(exc, Killed) and _is_cancel(exc):
                return exc  # the caller is cancelled too
            return ActorDead(path, reason)
        if isinstance(exc, Exception):
            return self._handler_raised(exc)
        # The asker was cancelled (or interrupted) half way through the handler:
        # let it crash; it restarts from scratch like after a kill.
        self._end(ActorKilled(path, "its handler was cancelled in the caller's task"))
        return exc

    def _handler_raised(self, exc: Exception) -> BaseException:
        """An inline handler raised: `reply_errors` go to the caller; the rest crash it."""
        errors = self.actor.reply_errors
        if errors and isinstance(exc, errors):
            self.release_owner()
            return exc
        self._crash_later(exc)
        return ActorDead(self.cell.path, exc)

    def release_owner(self) -> None:
        """The inline owner is done: hand pending work to a dispatcher, or finish a stop."""
        self.busy = False
        if self.done:
            return
        if self.stop_requested and self.started:
            if not self.stop_hook:
                self._close(None)
                self._finish(None)
                return
        elif not self.queue and not self.sysq:
            return
        if not self.scheduled:
            self.sched.schedule(self)

    def _crash_later(self, reason: BaseException) -> None:
        """A crash outside a dispatcher: close now; `on_stop` is a dispatcher's job."""
        self._close(reason)
        if self.started and self.stop_hook:
            self.hook_pending = True
            self.hook_reason = reason
            self.busy = False
            self.notify()
        else:
            self._finish(reason)

    # -- ending -------------------------------------------------------------------

    def _end(self, reason: BaseException | None) -> None:
        """End brutally now: close and finish, no `on_stop`."""
        self._close(reason)
        self._finish(reason)

    def _close(self, reason: BaseException | None) -> None:
        """Stop accepting, fail every pending ask, drop the mailbox and timers.

        Synchronous on purpose: no other task can slip a message in between.
        """
        if self.closed:
            return
        self.closed = True
        self.accepting = False
        self.inline = False
        self.reason = reason
        self.state = STOPPING
        path = self.cell.path
        current = self.current
        if current is not None:
            self.current = None
            current.set_error(ActorDead(path, reason))
        queue = self.queue
        while queue:
            item = queue.popleft()
            if type(item) is Ask:
                item.set_error(ActorDead(path, reason))
        senders = self.senders
        while senders:
            senders.popleft().set()  # they see `accepting` is off and raise ActorDead
        if self.sysq:
            self.sysq.clear()
        if self.timers:
            self.system._timers.cancel_all(self)

    def _finish(self, reason: BaseException | None) -> None:
        """The end: report the exit to the supervisor (unless it asked for it)."""
        self.reason = reason
        self.busy = False
        if self.holders:
            self.finish_pending = True  # a cancelled supervisor waits for its children
            return
        self.state = DEAD
        self.done = True
        if self.finish_pending:  # a class default until set: no instance dict for it
            self.finish_pending = False
        event = self._done_event
        if event is not None:
            event.set()
        blocker = self.blocker
        if blocker is not None:
            self.blocker = None
            blocker.holders -= 1
            if not blocker.holders and blocker.finish_pending:
                blocker._finish(blocker.reason)
        sup = self.sup
        if sup is not None:
            self.sup = None
            child: _Child = self.cell  # type: ignore[assignment]  # a child has a supervisor
            if child.retired:  # removed by its supervisor
                if child.current is self:  # `release()`, inlined: a stopped child
                    child.current = None  # is usually removed already
                if child.runtime is self:
                    child.runtime = None
                actor = self.actor
                if actor._actor_runtime is self:
                    actor._actor_runtime = None
            elif not self.expected_exit and child.runtime is self:
                sup._child_exited(child, self, reason)

    def release(self) -> None:
        """Break the cycles of a finished incarnation whose child is gone for good.

        The actor and its runtime refer to each other, and so do the cell (a
        child record) and the runtime: left alone, every finished incarnation
        is cyclic garbage. A daemon finishes a lease actor per step, and the
        full GC passes that garbage brings (each walking every live object)
        cost a third of its CPU under load. Once released, plain reference
        counting frees it.
        """
        cell = self.cell
        if cell.current is self:
            cell.current = None
        if type(cell) is _Child and cell.runtime is self:
            cell.runtime = None
        if self.actor._actor_runtime is self:
            self.actor._actor_runtime = None

    def add_system(self, item: object) -> None:
        """Queue `item` (a child's exit) on the system queue; its own deque on the first."""
        sysq = self.sysq
        if sysq is NO_ITEMS:
            sysq = self.sysq = deque()
        sysq.append(item)
        self.notify()

    def has_pending(self) -> bool:
        return bool(self.queue) or bool(self.sysq)

