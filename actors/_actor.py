"""The actor: a class you subclass, and the runtime that drives one incarnation.

An `Actor` subclass overrides some of:

* ``async on_start()``: load state (from storage, in stepd). The actor's
  parent learns it has started only after this returns (the startup
  handshake), and messages sent meanwhile wait in the mailbox. If it raises,
  the start fails (`StartFailed`).
* ``async receive(message)``: handle one message. For an ask, the return
  value is the reply. One message at a time, in mailbox order; fired timers
  and stop requests are served ahead of the mailbox.
* ``async on_stop(reason)``: clean up after a normal stop (`reason` is
  `None`) or a crash (`reason` is the exception). It is not called when the
  actor is killed, cancelled from outside, brutally shut down, or never
  finished `on_start`. It runs shielded from outside cancellation, bounded by
  the child spec's `shutdown`.

and calls `stop()`, `arm_timer()`, `cancel_timer()`, and reads `path`, `ref`,
`clock` and `system`.

How an incarnation ends (the *exit reason* its supervisor sees):

* normal (`None`): `stop()` was called, or the supervisor stopped it;
* crash (the exception): `on_start`, `receive` or `on_stop` raised an
  `Exception` not listed in `reply_errors` (or listed, but for a tell);
* killed (`ActorKilled`): `ActorSystem.kill`, or its supervisor was killed.

Whatever the reason, before `on_stop` runs the incarnation stops accepting
messages, its in-flight and queued asks fail with `ActorDead`, and its timers
are cancelled. Every step of that cleanup is synchronous, so it cannot be
interrupted half way.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
from anyio.abc import TaskStatus

from ._errors import ActorDead, StartFailed
from ._mailbox import WAKE, Ask, Mailbox
from ._messages import check_message
from ._ref import ActorRef, Cell
from ._timers import TimerEntry

if TYPE_CHECKING:
    from ._clock import Clock
    from ._system import ActorSystem

__all__ = ["Actor", "Runtime"]

_SEND_CLOSED = (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError)
_RECEIVE_DONE = (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError)


class Runtime:
    """The runtime state of one incarnation: mailbox, system queue, timers, scope.

    Created by the supervisor that starts the incarnation, installed in the
    path's `Cell`, and driven by `run()` in a task of that supervisor's task
    group. Private to the package.
    """

    __slots__ = (
        "_done_event",
        "accepting",
        "actor",
        "cancel_reason",
        "cell",
        "closed",
        "current",
        "done",
        "expected_exit",
        "mailbox",
        "reason",
        "scope",
        "started",
        "started_at",
        "state",
        "stop_requested",
        "sysq",
        "system",
        "timers",
        "wake_pending",
    )

    def __init__(self, actor: Actor, cell: Cell, system: ActorSystem) -> None:
        if actor._actor_incarnated:
            raise RuntimeError(
                f"{type(actor).__name__} instance was already started once; "
                "ChildSpec.start must return a fresh actor for every incarnation"
            )
        size = actor.mailbox_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"{type(actor).__name__}.mailbox_size must be an int >= 1, got {size!r}"
            )
        actor._actor_runtime = self
        actor._actor_incarnated = True
        self.actor = actor
        self.cell = cell
        self.system = system
        self.mailbox: Mailbox[object] = Mailbox(size)
        self.sysq: deque[object] = deque()
        self.timers: dict[Hashable, TimerEntry] = {}
        # Cancelled to kill the incarnation (or shut it down brutally); the
        # reason goes in cancel_reason first.
        self.scope = anyio.CancelScope()
        self.cancel_reason: BaseException | None = None
        self.accepting = True  # sends are let through
        self.stop_requested = False  # leave the loop before the next message
        self.wake_pending = False  # a WAKE token sits in the mailbox
        self.expected_exit = False  # the supervisor is stopping it: no restart
        self.current: Ask | None = None  # the ask being handled
        self.started = False
        self.started_at: int | None = None
        self.closed = False
        self.done = False
        self.reason: BaseException | None = None
        self.state = "starting"
        self._done_event: anyio.Event | None = None
        cell.kind = actor.kind or type(actor).__name__

    @property
    def path(self) -> str:
        return self.cell.path

    # -- control, called from other tasks ------------------------------------

    def poke(self) -> None:
        """Wake the loop if idle: it serves the system queue before the mailbox.

        At most one WAKE token is in flight. If the mailbox is full the loop is
        busy, and checks the system queue before its next receive anyway.
        """
        if self.wake_pending or self.closed:
            return
        try:
            self.mailbox.send_nowait(WAKE)
        except _SEND_CLOSED:
            return
        self.wake_pending = True

    def request_stop(self) -> None:
        """Stop after the message in hand (a normal exit); new sends fail at once."""
        if self.stop_requested or self.done:
            return
        self.stop_requested = True
        self.accepting = False
        if self.state == "running":
            self.state = "stopping"
        self.poke()

    def cancel(self, reason: BaseException | None) -> None:
        """Cancel the incarnation where it stands (kill, or brutal shutdown)."""
        if self.done:
            return
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.accepting = False
        self.scope.cancel()

    async def wait_done(self) -> None:
        """Wait until the incarnation has finished, cleanup and `on_stop` included."""
        if self.done:
            return
        if self._done_event is None:
            self._done_event = anyio.Event()
        await self._done_event.wait()

    # -- the incarnation's own task ------------------------------------------

    def mark_started(self, task_status: TaskStatus[ActorRef]) -> None:
        """Complete the startup handshake: `on_start` has returned."""
        self.started = True
        self.started_at = self.system.clock.time_ms()
        if self.state == "starting":
            self.state = "stopping" if self.stop_requested else "running"
        task_status.started(self.cell.ref())

    async def run(
        self, *, task_status: TaskStatus[ActorRef] = anyio.TASK_STATUS_IGNORED
    ) -> BaseException | None:
        """Run the incarnation from `on_start` to its end; return the exit reason.

        Returns:
            `None` after a normal stop, else the crash exception (`ActorKilled`
            for a kill).

        Raises:
            StartFailed: it ended before `on_start` returned (raised to whoever
                awaits the startup handshake).
        """
        actor = self.actor
        reason: BaseException | None = None
        try:
            with self.scope:
                try:
                    await actor._actor_main(self, task_status)
                except Exception as exc:  # noqa: BLE001 - a crash becomes the exit reason
                    reason = exc
            if self.scope.cancelled_caught:
                reason = self.cancel_reason
        except BaseException:
            # Cancelled from outside (the supervisor died, the system was
            # cancelled), or KeyboardInterrupt and kin: clean up, then let it
            # through. No on_stop: this is a brutal end.
            self._close(None)
            self._finish(None)
            raise
        brutal = self.scope.cancelled_caught
        self._close(reason)
        if not self.started:
            self._finish(reason)
            raise StartFailed(self.path) from reason
        if not brutal:
            reason = await self._call_on_stop(reason)
        self._finish(reason)
        return reason

    async def _call_on_stop(self, reason: BaseException | None) -> BaseException | None:
        if type(self.actor).on_stop is Actor.on_stop:
            return reason  # not overridden: spare the cancel scope (hot path)
        # Shielded from outside cancellation, but the scope is ours to cancel:
        # a shutdown timeout or a kill interrupts a hanging on_stop.
        scope = self.scope = anyio.CancelScope(shield=True)
        with scope:
            try:
                await self.actor.on_stop(reason)
            except Exception as exc:  # noqa: BLE001 - a crash in on_stop is an exit reason
                if reason is None:
                    reason = exc
        if scope.cancelled_caught and reason is None:
            reason = self.cancel_reason
        return reason

    def _close(self, reason: BaseException | None) -> None:
        """Stop accepting, fail every pending ask, drop the mailbox and timers.

        Synchronous on purpose: no other task can slip a message in between.
        """
        if self.closed:
            return
        self.closed = True
        self.accepting = False
        self.reason = reason
        self.state = "stopping"
        path = self.path
        current = self.current
        if current is not None:
            self.current = None
            current.set_error(ActorDead(path, reason))
        box = self.mailbox
        while True:
            # receive_nowait also admits blocked senders one by one, so asks
            # that were waiting for room fail here too.
            try:
                item = box.receive_nowait()
            except _RECEIVE_DONE:
                break
            if type(item) is Ask:
                item.set_error(ActorDead(path, reason))
        self.mailbox.close()
        self.sysq.clear()
        self.system._timers.cancel_all(self)

    def release(self) -> None:
        """Break the cycles of a finished incarnation whose child is gone for good.

        The actor and its runtime refer to each other, and so do the cell and
        the runtime: left alone, every finished incarnation is cyclic garbage.
        A daemon finishes a lease actor per step, and the full GC passes that
        garbage brings (each walking every live object) cost a third of its
        CPU under load. Once released, plain reference counting frees it.
        """
        if self.cell.current is self:
            self.cell.current = None
        if self.actor._actor_runtime is self:
            self.actor._actor_runtime = None

    def _finish(self, reason: BaseException | None) -> None:
        self.reason = reason
        self.state = "dead"
        self.done = True
        if self._done_event is not None:
            self._done_event.set()

    async def loop(self) -> None:
        """Serve the system queue and the mailbox until a stop is requested.

        Raises:
            Exception: whatever a handler raised (a crash).
        """
        actor = self.actor
        receive = actor.receive
        box = self.mailbox
        rx_receive = box.receive
        rx_receive_nowait = box.receive_nowait
        sysq = self.sysq
        reply_errors = actor.reply_errors
        while True:
            if self.stop_requested:
                return
            if sysq:
                await actor._actor_system_item(sysq.popleft())
                continue
            # Take what is buffered without a checkpoint. No other task runs
            # while this one does not yield, and a tell to oneself always
            # checkpoints, so at most a mailbox-full of messages goes by before
            # receive() yields again.
            try:
                item = rx_receive_nowait()
            except anyio.WouldBlock:
                item = await rx_receive()
            if item is WAKE:
                self.wake_pending = False
                continue
            if type(item) is Ask:
                self.current = item
                try:
                    value = await receive(item.message)
                except Exception as exc:
                    if reply_errors and isinstance(exc, reply_errors):
                        self.current = None
                        item.set_error(exc)
                        continue
                    raise
                self.current = None
                item.set_value(value)
            else:
                await receive(item)


class Actor:
    """Subclass me. One instance is one incarnation; a restart makes a new one.

    Class attributes to override:
        kind: the name shown in introspection (default: the class name).
        mailbox_size: the mailbox's capacity (default 1024); a full mailbox
            makes `tell` wait and `tell_nowait` raise `WouldBlock`.
        reply_errors: exception types that `receive` may raise for an *ask*
            without crashing: they are raised to the caller instead, and the
            actor handles its next message. Expected rejections (a conflict,
            invalid input) belong here; for a tell they are still a crash,
            since nobody would hear of them otherwise.
    """

    kind: ClassVar[str | None] = None
    mailbox_size: ClassVar[int] = 1024
    reply_errors: ClassVar[tuple[type[Exception], ...]] = ()

    _actor_runtime: Runtime | None = None
    _actor_incarnated: bool = False
    _actor_ref_type: ClassVar[type[ActorRef]] = ActorRef

    #: Why the incarnation before this one ended, when this one is a restart
    #: of the same child: the crash exception, `ActorKilled` for a kill, or
    #: None (the first start, or a sibling's failure restarted it). Set by the
    #: supervisor before `on_start`, so an actor can tell a crash loop (count
    #: it durably, give up) from fault injection.
    restart_reason: BaseException | None = None

    # -- hooks ----------------------------------------------------------------

    async def on_start(self) -> None:
        """Load the actor's state before it is reported started. Default: nothing.

        Raises:
            Exception: any; the start fails with `StartFailed` chained from it.
        """

    async def receive(self, message: Any) -> Any:
        """Handle one message; for an ask, return the reply.

        Raises:
            Exception: a crash (unless listed in `reply_errors` and the
                message was an ask). The default raises `NotImplementedError`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not handle {message!r}")

    async def on_stop(self, reason: BaseException | None) -> None:
        """Clean up after a normal stop (`reason` is `None`) or a crash.

        Raises:
            Exception: any; after a normal stop it turns the exit into a crash.
        """

    # -- API for the actor's own code ----------------------------------------

    def _rt(self) -> Runtime:
        rt = self._actor_runtime
        if rt is None:
            if self._actor_incarnated:
                raise RuntimeError(f"{type(self).__name__} has stopped and left its supervisor")
            raise RuntimeError(
                f"{type(self).__name__} is not running: start it with a ChildSpec "
                "through a Supervisor or ActorSystem.spawn()"
            )
        return rt

    @property
    def path(self) -> str:
        """This actor's path, e.g. ``/runs/r_1``.

        Raises:
            RuntimeError: the actor was never started.
        """
        return self._rt().cell.path

    @property
    def ref(self) -> ActorRef:
        """A ref to this actor's path (it reaches future incarnations too).

        Raises:
            RuntimeError: the actor was never started.
        """
        return self._actor_ref_type(self._rt().cell)

    @property
    def system(self) -> ActorSystem:
        """The actor system this actor runs in.

        Raises:
            RuntimeError: the actor was never started.
        """
        return self._rt().system

    @property
    def clock(self) -> Clock:
        """The system's clock: read time here, never from `time`.

        Raises:
            RuntimeError: the actor was never started.
        """
        return self._rt().system.clock

    def stop(self) -> None:
        """Stop normally once the current message is handled.

        A normal stop: `on_stop(None)` runs, and a `TRANSIENT` child is not
        restarted (a `PERMANENT` one is). Messages still queued are dropped
        and queued asks fail with `ActorDead`.

        Raises:
            RuntimeError: the actor was never started.
        """
        self._rt().request_stop()

    def has_pending(self) -> bool:
        """True when messages or fired timers wait to be handled.

        An actor that stops itself when it has nothing to do (a passivating
        run) checks this first, so it never drops work already queued for it.
        """
        rt = self._rt()
        depth = rt.mailbox.depth() - (1 if rt.wake_pending else 0)
        return depth > 0 or bool(rt.sysq)

    def arm_timer(self, key: Hashable, deadline: float, message: object) -> None:
        """Deliver `message` to this actor at `deadline` (of `self.clock.now()`).

        One-shot. Re-arming `key` replaces its timer, even one that has fired
        and is not delivered yet. A deadline already past fires at once. The
        timer dies with this incarnation.

        Raises:
            MutableMessageError: `message` is not of an immutable type.
            ValueError: `deadline` is NaN.
            ActorDead: the incarnation is already shutting down.
            RuntimeError: the actor was never started.
        """
        rt = self._rt()
        check_message(message)
        if math.isnan(deadline):
            raise ValueError("deadline must be a number of seconds, got NaN")
        if rt.closed:
            raise ActorDead(rt.path, rt.reason)
        rt.system._timers.arm(rt, key, deadline, message)

    def cancel_timer(self, key: Hashable) -> bool:
        """Cancel timer `key` so it never delivers; return whether it existed.

        Raises:
            RuntimeError: the actor was never started.
        """
        rt = self._rt()
        return rt.system._timers.cancel(rt, key)

    def timer_deadline(self, key: Hashable) -> float | None:
        """Return the deadline of timer `key`, or `None` if it is not armed.

        Raises:
            RuntimeError: the actor was never started.
        """
        entry = self._rt().timers.get(key)
        return None if entry is None else entry.deadline

    # -- runtime hooks (private) --------------------------------------------

    async def _actor_main(self, rt: Runtime, task_status: TaskStatus[ActorRef]) -> None:
        await self.on_start()
        rt.mark_started(task_status)
        await rt.loop()

    async def _actor_system_item(self, item: object) -> None:
        if type(item) is TimerEntry and self._rt().system._timers.delivered(item):
            await self.receive(item.message)

    def __repr__(self) -> str:
        rt = self._actor_runtime
        where = rt.cell.path if rt is not None else "not started"
        return f"<{type(self).__name__} {where}>"
